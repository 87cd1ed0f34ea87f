"""Choose a proposer's tree/draft size on held-out *training* prompts (never on the benchmark).

    python scripts/tune_on_heldout.py --proposer medusa --grid tree_nodes=8,12,16,24,32 [--prompts 10]
    python scripts/tune_on_heldout.py --proposer eagle --grid total_tokens=8,12,16,24 --grid depth=4,6
    python scripts/tune_on_heldout.py --proposer union --grid "members=[eagle]|[ngram]|[eagle,ngram]"
    python scripts/tune_on_heldout.py --proposer draft --setting "num_speculative_tokens=1" \
        --setting "num_speculative_tokens=4 confidence_threshold=0.5"

Prompts are the held-out split (5%, by id, the trainers' split) of the self-distillation data. Each setting
decodes every prompt greedily (128 new tokens), settings interleaved per prompt in rotating order with plain
decoding (`none`), on one loaded target. Prints mean accepted length, tokens/s and speedup over `none`
(ratio of total tokens over total time), as a Markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from specframe import SpeculativeDecoder, load_config
from specframe.data import read_distill
from specframe.decoder import target_info
from specframe.plugins import get_registry
from specframe.training.common import split_heldout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proposer", required=True)
    ap.add_argument("--grid", action="append", default=[], help="KEY=V1,V2,... or KEY=V1|V2|... (proposer options)")
    ap.add_argument("--setting", action="append", default=[], help='one more setting: "KEY=V KEY=V ..."')
    ap.add_argument("--data", default="runs/distill/smollm2-135m-instruct.jsonl")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="fixed proposer options KEY=VALUE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, held = split_heldout(read_distill(args.data), 0.05, 0)
    prompts = [e.prompt_ids for e in held][: args.prompts]
    keys = [g.split("=", 1)[0] for g in args.grid]
    # Values are comma-separated, or |-separated when a value holds commas (members=[eagle]|[eagle,ngram]).
    values = [g.split("=", 1)[1].split("|" if "|" in g else ",") for g in args.grid]
    settings = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)] if args.grid else []
    settings += [dict(kv.split("=", 1) for kv in s.split()) for s in args.setting]
    if not settings:
        ap.error("give at least one --grid or --setting")
    base = SpeculativeDecoder.from_config(load_config(overrides=["proposer.name=none"]))
    info = target_info(base.model, base.tokenizer, name=load_config().target.model)
    cls = get_registry().get(args.proposer).cls
    decoders = {"none": base}
    for s in settings:
        opts = [f"proposer.{k}={v}" for k, v in s.items()] + [f"proposer.{o}" for o in args.overrides]
        cfg = load_config(overrides=[f"proposer.name={args.proposer}", *opts])
        decoders[" ".join(f"{k}={v}" for k, v in s.items())] = SpeculativeDecoder(
            base.model, cls.from_config(cfg.proposer, info), tokenizer=base.tokenizer
        )
    names = list(decoders)
    totals = {n: [0, 0, 0.0] for n in names}  # tokens, target forwards, seconds
    decoders["none"].generate(prompts[0], max_new_tokens=8)  # warm-up
    for i, prompt in enumerate(prompts):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            res = decoders[n].generate(prompt, max_new_tokens=args.max_new_tokens)
            totals[n][0] += res.stats["new_tokens"]
            totals[n][1] += res.stats["target_forwards"]
            totals[n][2] += time.perf_counter() - t0
    plain = totals["none"][0] / totals["none"][2]
    print(f"{args.proposer}, {len(prompts)} held-out training prompts, {args.max_new_tokens} new tokens, greedy")
    print("| setting | mean accepted length | tok/s | speedup vs none |")
    print("|---|---|---|---|")
    for n in names:
        tok, fwd, sec = totals[n]
        print(f"| {n} | {tok / fwd:.2f} | {tok / sec:.1f} | {tok / sec / plain:.2f}x |")


if __name__ == "__main__":
    main()
