"""Benchmark `ngram` against transformers' prompt-lookup decoding and plain `model.generate`, greedy.

One run, methods interleaved prompt by prompt (so a busy machine hurts them alike). Reports per category:
mean accepted length (new tokens / target forwards, prefill included — specframe's definition, also
applied to transformers by counting the model's forward calls), mean per-prompt tokens/s, speedup over
plain `generate`, and how many outputs differ from plain greedy `generate`.

    python plugins/specframe-ngram/bench_ngram.py                      # Spec-Bench summarization + rag, 10 each
    python plugins/specframe-ngram/bench_ngram.py --prompts ../shared/data/train_prompts/prompts.jsonl \
        --ngram max_candidates=1 --ngram max_candidates=3                # compare ngram settings (tuning)
    python plugins/specframe-ngram/bench_ngram.py --micro              # cost of one propose() on 2k tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from specframe import DecodeState, SamplingParams, SpeculativeDecoder, load_config
from specframe.decoder import target_info
from specframe.plugins import get_registry

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data from the repository root

Method = Callable[[list[int]], tuple[list[int], int, float]]  # prompt ids -> (new ids, target forwards, seconds)


def load_prompts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(category, first user turn) pairs."""
    if args.prompts:  # a plain prompt file, e.g. train_prompts/prompts.jsonl: take long ones (context-heavy)
        rows = [json.loads(line) for line in open(args.prompts)]
        picked = [r["prompt"] for r in rows if args.min_chars <= len(r["prompt"]) <= args.max_chars]
        return [("prompts", p) for p in picked[args.skip : args.skip + args.n]]
    rows = [json.loads(line) for line in open(args.data)]
    out = []
    for category in args.categories:
        out += [(category, r["turns"][0]) for r in rows if r["category"] == category][: args.n]
    return out


def forward_counter(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def hf_method(model, eos: int, max_new: int, calls: list[int], **kwargs) -> Method:
    def run(ids: list[int]) -> tuple[list[int], int, float]:
        x = torch.tensor([ids])
        calls[0] = 0
        t0 = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=eos, **kwargs)
        seconds = time.perf_counter() - t0
        return out[0, len(ids) :].tolist(), calls[0], seconds

    return run


def specframe_method(decoder: SpeculativeDecoder, max_new: int) -> Method:
    def run(ids: list[int]) -> tuple[list[int], int, float]:
        res = decoder.generate(ids, max_new_tokens=max_new, temperature=0.0)
        return res.token_ids, res.stats["target_forwards"], res.stats["wall_time_s"]

    return run


def micro(decoder: SpeculativeDecoder, text: str, rounds: int = 3) -> None:
    """Time begin() on 1.5k tokens, then propose() each step as the sequence grows by 1-4 tokens to 2k."""
    ids = decoder.encode(text)
    ids = torch.cat([ids] * (2048 // ids.numel() + 1))[:2048]  # repeated text: many matches, full proposals
    proposer, g = decoder.proposer, torch.Generator()
    begins, times, sizes = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        proposer.begin(ids[:1500], {})
        begins.append(time.perf_counter() - t0)
        length = 1501
        while length <= 2048:
            state = DecodeState(ids[:length], 1500, SamplingParams(), g, 10)
            t0 = time.perf_counter()
            p = proposer.propose(state)
            times.append(time.perf_counter() - t0)
            sizes.append(len(p))
            length += 1 + length % 4
    times.sort()
    print(f"begin() on 1500 tokens: median {statistics.median(begins) * 1e3:.2f} ms")
    print(f"propose() at 1.5k-2k tokens, {len(times)} calls: median {statistics.median(times) * 1e6:.0f} us, "
          f"p90 {times[int(0.9 * len(times))] * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us; "
          f"mean proposal {statistics.mean(sizes):.1f} nodes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA / "spec_bench" / "question.jsonl"), help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", nargs="+", default=["summarization", "rag"])
    ap.add_argument("-n", type=int, default=10, help="prompts per category")
    ap.add_argument("--prompts", help="a jsonl of {'prompt': ...} to use instead of Spec-Bench (tuning)")
    ap.add_argument("--skip", type=int, default=0, help="with --prompts: skip this many eligible prompts")
    ap.add_argument("--min-chars", type=int, default=1500, help="with --prompts: shortest prompt taken")
    ap.add_argument("--max-chars", type=int, default=6000, help="with --prompts: longest prompt taken")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--target", default=None, help="target.model (default: specframe's default)")
    ap.add_argument("--ngram", action="append", default=None, metavar="K=V,K=V",
                    help="an ngram setting (proposer.* overrides); repeat to compare several; default: defaults")
    ap.add_argument("--hf-k", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    ap.add_argument("--hf-ngram", type=int, default=2, help="transformers max_matching_ngram_size")
    ap.add_argument("--no-hf-pld", action="store_true", help="skip transformers' prompt lookup")
    ap.add_argument("--engine-none", action="store_true", help="also time specframe's `none` (engine baseline)")
    ap.add_argument("--replay", metavar="JSON", help="no model: replay the greedy outputs saved by --out and "
                    "report each --ngram setting's accepted length and tree size (exact for greedy decoding)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro", action="store_true", help="only time propose() on a 2k-token sequence")
    ap.add_argument("--out", help="write per-prompt results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    base = [] if args.target is None else [f"target.model={args.target}"]
    settings = args.ngram or [""]
    if args.replay:
        replay(json.loads(Path(args.replay).read_text()), settings)
        return
    decoders = {}
    for s in settings:
        overrides = ["proposer.name=ngram", *base, *(f"proposer.{kv}" for kv in s.split(",") if kv)]
        cfg = load_config(overrides=overrides)
        if not decoders:
            first = SpeculativeDecoder.from_config(cfg)
            model, tokenizer = first.model, first.tokenizer
        proposer = get_registry().get("ngram").cls.from_config(cfg.proposer, target_info(model, tokenizer))
        decoders[f"ngram[{s}]" if s else "ngram"] = SpeculativeDecoder(model, proposer, tokenizer=tokenizer)
    some = next(iter(decoders.values()))
    if args.micro:
        micro(some, load_prompts(args)[0][1])
        return

    eos = next(iter(some.eos_ids))
    calls = forward_counter(model)
    methods: dict[str, Method] = {"hf_generate": hf_method(model, eos, args.max_new_tokens, calls)}
    if not args.no_hf_pld:
        methods[f"hf_pld[k={args.hf_k},n={args.hf_ngram}]"] = hf_method(
            model, eos, args.max_new_tokens, calls, prompt_lookup_num_tokens=args.hf_k,
            max_matching_ngram_size=args.hf_ngram)
    for name, dec in decoders.items():
        methods[name] = specframe_method(dec, args.max_new_tokens)
    if args.engine_none:
        none_cfg = load_config(overrides=["proposer.name=none", *base]).proposer
        none = get_registry().get("none").cls.from_config(none_cfg, target_info(model, tokenizer))
        methods["specframe_none"] = specframe_method(SpeculativeDecoder(model, none, tokenizer=tokenizer),
                                                     args.max_new_tokens)

    prompts = load_prompts(args)
    print(f"{len(prompts)} prompts, {len(methods)} methods, threads={args.threads}, target dtype {some.info.dtype}")
    warm = some.encode("Say hello.").tolist()
    for run in methods.values():
        run(warm)
    rows = []  # one dict per (prompt, method)
    with torch.inference_mode():
        for i, (category, text) in enumerate(prompts):
            ids = some.encode(text).tolist()
            ref = None
            for name, run in methods.items():
                out, forwards, seconds = run(ids)
                if name == "hf_generate":
                    ref = out
                first_diff = next((j for j, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b),
                                  None if len(out) == len(ref) else min(len(out), len(ref)))
                rows.append({"prompt": i, "category": category, "method": name, "prompt_tokens": len(ids),
                             "new_tokens": len(out), "forwards": forwards, "seconds": seconds,
                             "first_diff": first_diff, "prompt_ids": ids if name == "hf_generate" else None,
                             "token_ids": out})
            line = "  ".join(f"{r['method']}={r['new_tokens'] / r['seconds']:.1f}" for r in rows[-len(methods) :])
            print(f"[{i + 1}/{len(prompts)}] {category} ({len(ids)} tokens) tok/s: {line}", flush=True)
    report(rows, list(methods))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def replay(rows: list[dict], settings: list[str]) -> None:
    """Greedy decoding accepts the longest tree path that matches the target's own output, so a saved
    greedy output tells exactly what each ngram setting would have accepted, without running the model."""
    from specframe_ngram import NgramConfig, NgramProposer

    refs = [r for r in rows if r["method"] == "hf_generate"]
    print(f"| ngram setting | mean accepted length | mean nodes per step | mean depth per step |\n|---|---|---|---|")
    for s in settings:
        config = NgramConfig(**{k: int(v) for k, v in (kv.split("=") for kv in s.split(",") if kv)})
        proposer = NgramProposer(config, None)
        emitted = forwards = nodes = depth = 0
        for r in refs:
            prompt, out = r["prompt_ids"], r["token_ids"]
            proposer.begin(torch.tensor(prompt), {})
            pos, forwards = 1, forwards + 1  # the prefill emits out[0]
            while pos < len(out):
                tokens = torch.tensor(prompt + out[:pos])
                p = proposer.propose(DecodeState(tokens, len(prompt), SamplingParams(), None, len(out) - pos - 1))
                children: dict[int, dict[int, int]] = {}
                for i, (t, parent) in enumerate(zip(p.tokens.tolist(), p.parents.tolist(), strict=True)):
                    children.setdefault(parent, {})[t] = i
                node, k = -1, 0
                while pos + k < len(out) and out[pos + k] in children.get(node, {}):
                    node, k = children[node][out[pos + k]], k + 1
                pos, forwards = pos + k + 1, forwards + 1
                nodes, depth = nodes + len(p), depth + max(p.depths(), default=0)
            emitted += len(out)
        steps = forwards - len(refs)
        print(f"| {s or 'defaults'} | {emitted / forwards:.2f} | {nodes / steps:.1f} | {depth / steps:.1f} |")


def report(rows: list[dict], methods: list[str]) -> None:
    categories = sorted({r["category"] for r in rows})
    print(f"\n| category | method | mean accepted length | tokens/s | speedup | outputs != greedy generate |")
    print("|---|---|---|---|---|---|")
    for category in [*categories, "overall"] if len(categories) > 1 else categories:
        sel = [r for r in rows if category in ("overall", r["category"])]
        base = statistics.mean(r["new_tokens"] / r["seconds"] for r in sel if r["method"] == "hf_generate")
        for m in methods:
            rs = [r for r in sel if r["method"] == m]
            mal = sum(r["new_tokens"] for r in rs) / sum(r["forwards"] for r in rs)
            tps = statistics.mean(r["new_tokens"] / r["seconds"] for r in rs)
            diffs = [f"#{r['prompt']}@{r['first_diff']}" for r in rs if r["first_diff"] is not None]
            print(f"| {category} | {m} | {mal:.2f} | {tps:.1f} | {tps / base:.2f}x | "
                  f"{len(diffs)}/{len(rs)} {' '.join(diffs)} |")


if __name__ == "__main__":
    main()
