"""Pick the Medusa tree size for this machine from held-out path statistics and measured verification costs.

    python scripts/tune_medusa_tree.py runs/medusa [--target smollm2-135m-instruct] [--write]

For each candidate size n, the expected accepted length E(n) comes from the heads' held-out path statistics
(training prompts, never the benchmark), and the cost of a step is measured here: one target forward over
n + 1 tokens with a 300-token context, plus the heads. The best n maximises E(n) / cost(n); `--write` stores
that tree in the heads' medusa_config.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specframe.kv_cache import new_cache, tree_attention_mask
from specframe.models import load_model
from specframe.training.medusa import best_tree, expected_accepted_length


def verify_cost(model, tree, context: int = 300, repeats: int = 7) -> float:
    """Median seconds of one verification forward of `tree` (with its tree mask) after `context` tokens."""
    index = {p: i for i, p in enumerate(tree)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in tree]
    depths = [len(p) for p in tree]
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 1000, (1, context)), cache=cache, use_cache=True, logits_to_keep=1)
        times = []
        for _ in range(repeats):
            ids = torch.randint(0, 1000, (1, len(tree) + 1))
            pos = (context + torch.tensor([0, *depths]))[None]
            mask = tree_attention_mask(parents, context, model.dtype, model.device)
            t0 = time.perf_counter()
            model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=mask,
                cache=cache,
                use_cache=True,
                output_hidden_states=True,
            )
            times.append(time.perf_counter() - t0)
            cache.crop(-(len(tree) + 1))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="4,6,8,12,16,20,24,32,40")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    meta_file = Path(args.heads) / "medusa_config.json"
    meta = json.loads(meta_file.read_text())
    counts = meta["path_counts"]
    model = load_model(args.target, dtype="float32", device="cpu", quiet=True).model
    base = verify_cost(model, [], repeats=9)  # a plain decode step: one token
    rows, best = [], None
    for n in [int(s) for s in args.sizes.split(",")]:
        tree = [p for p in best_tree(counts, n) if len(p) <= meta["num_heads"]]
        e = expected_accepted_length(counts, tree)
        cost = verify_cost(model, tree)
        speed = e / cost * base  # predicted speedup over plain decoding (head time not included)
        rows.append((len(tree), e, cost, speed))
        if best is None or speed > best[3]:
            best = (len(tree), e, cost, speed, tree)
    print(f"plain decode step: {base * 1000:.1f} ms")
    print("| nodes | expected accepted length | verify ms | predicted speedup |")
    print("|---|---|---|---|")
    for n, e, c, s in rows:
        print(f"| {n} | {e:.2f} | {c * 1000:.1f} | {s:.2f}x |")
    print(f"best: {best[0]} nodes")
    if args.write:
        meta["tree"] = [list(p) for p in best[4]]
        meta["tree_tuning"] = {"nodes": best[0], "table": rows, "decode_ms": base * 1000}
        meta_file.write_text(json.dumps(meta, indent=1))
        print(f"wrote the {best[0]}-node tree to {meta_file}")


if __name__ == "__main__":
    main()
