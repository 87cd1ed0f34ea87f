"""Median time of one target forward of 1-16 tokens (300 cached), on the stock and on specframe's CPU kernels.

    python scripts/kernel_timings.py [--target smollm2-135m-instruct] [--threads 2]

The two are interleaved in one run (compare them, not times across runs); the table in
specframe/cpu_kernels.py comes from this script.
"""

import argparse
import time

import torch
from transformers import DynamicCache

from specframe.cpu_kernels import stock_kernels
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
    cache = DynamicCache(config=model.config)
    rows = (1, 2, 3, 4, 5, 6, 8, 12, 16)
    context = int(__import__("os").environ.get("CONTEXT", "300"))
    times: dict[str, dict[int, list[float]]] = {"stock": {r: [] for r in rows}, "fast": {r: [] for r in rows}}

    def forward(k: int) -> float:
        t0 = time.perf_counter()
        model(input_ids=torch.randint(0, 1000, (1, k)), cache=cache, use_cache=True)
        dt = time.perf_counter() - t0
        cache.crop(-k)
        return dt

    with torch.inference_mode():
        model(input_ids=torch.randint(0, 1000, (1, context)), cache=cache, use_cache=True)
        for _ in range(args.repeats):
            with stock_kernels(model):
                for r in rows:
                    times["stock"][r].append(forward(r))
            for r in rows:
                times["fast"][r].append(forward(r))
    print("| tokens in the forward | " + " | ".join(map(str, rows)) + " |")
    print("|---|" + "---|" * len(rows))
    for mode, by_rows in times.items():
        cells = " | ".join(f"{sorted(v)[len(v) // 2] * 1e3:.0f}" for v in by_rows.values())
        print(f"| {mode} (ms) | {cells} |")


if __name__ == "__main__":
    main()
