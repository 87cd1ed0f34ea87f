"""Median time of one target forward of 1-16 tokens (300 cached), on the stock kernels with transformers'
`DynamicCache`, on specframe's CPU kernels with its own cache (`specframe.kv_cache.new_cache`), and on those
through specframe's lean forward (`specframe.lean_forward`, where it applies to the target), with the
q/k/v and gate/up products separate and fused, and the same with the float32 weights only (not their GGUF blocks,
`specframe.block_weights`).

    python scripts/kernel_timings.py [--target smollm2-135m-instruct] [--threads 2]

The modes are interleaved in one run (compare them, not times across runs); the table in
specframe/cpu_kernels.py comes from this script.
"""

import argparse
import functools
import time

import torch
from transformers import DynamicCache

from specframe import block_weights
from specframe.cpu_kernels import stock_kernels
from specframe.kv_cache import new_cache
from specframe.lean_forward import engine_forward, lean_llama_forward
from specframe.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.target, dtype="float32", device="cpu", quiet=True).model
    torch.manual_seed(0)
    caches = {"stock": DynamicCache(config=model.config), "fast": new_cache(model)}
    lean = ("lean, separate products", "lean, float32 weights", "lean")
    caches.update({mode: new_cache(model) for mode in lean})
    runs = {"stock": model, "fast": model, "lean": engine_forward(model)}  # (fused products, lean_forward.py)
    runs["lean, float32 weights"] = runs["lean"]
    runs["lean, separate products"] = functools.partial(lean_llama_forward, model, fuse_projections=False)
    rows = (1, 2, 3, 4, 5, 6, 8, 12, 16)
    context = int(__import__("os").environ.get("CONTEXT", "300"))
    times: dict[str, dict[int, list[float]]] = {mode: {r: [] for r in rows} for mode in caches}

    def forward(k: int, mode: str) -> float:
        cache = caches[mode]
        t0 = time.perf_counter()
        runs[mode](input_ids=torch.randint(0, 1000, (1, k)), cache=cache, use_cache=True)
        dt = time.perf_counter() - t0
        cache.crop(-k)
        return dt

    with torch.inference_mode():
        prompt = torch.randint(0, 1000, (1, context))
        for cache in caches.values():
            model(input_ids=prompt, cache=cache, use_cache=True)
        for _ in range(args.repeats):
            with stock_kernels(model):
                for r in rows:
                    times["stock"][r].append(forward(r, "stock"))
            for mode in ("fast", *lean):
                block_weights.use_blocks = mode != "lean, float32 weights"
                for r in rows:
                    times[mode][r].append(forward(r, mode))
    print(cache_update_times(model, context, args.repeats))
    print("| tokens in the forward | " + " | ".join(map(str, rows)) + " |")
    print("|---|" + "---|" * len(rows))
    for mode, by_rows in times.items():
        cells = " | ".join(f"{sorted(v)[len(v) // 2] * 1e3:.0f}" for v in by_rows.values())
        print(f"| {mode} (ms) | {cells} |")


def cache_update_times(model: torch.nn.Module, context: int, repeats: int) -> str:
    """Median time to add one position to every layer's cache after `context` cached, then crop it: transformers'
    DynamicCache (a concatenation) against specframe's (a write into a buffer)."""
    shape = (1, model.config.num_key_value_heads, context, model.config.hidden_size // model.config.num_attention_heads)
    one = torch.randn(*shape[:2], 1, shape[3])
    medians = {}
    with torch.inference_mode():
        for name, cache in (("DynamicCache", DynamicCache(config=model.config)), ("specframe's", new_cache(model))):
            for i in range(len(cache.layers)):
                cache.update(torch.randn(shape), torch.randn(shape), i)
            times = []
            for _ in range(5 * repeats):
                t0 = time.perf_counter()
                for i in range(len(cache.layers)):
                    cache.update(one, one, i)
                times.append(time.perf_counter() - t0)
                cache.crop(-1)
            medians[name] = sorted(times)[len(times) // 2] * 1e3
    return f"cache update, one position in each of {len(cache.layers)} layers after {context} cached: " + ", ".join(
        f"{name} {ms:.2f} ms" for name, ms in medians.items()
    )


if __name__ == "__main__":
    main()
