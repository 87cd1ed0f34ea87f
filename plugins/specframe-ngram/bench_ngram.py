"""Benchmark and tune `ngram` (a front end to specframe's own benchmark, `specframe.bench`).

    python plugins/specframe-ngram/bench_ngram.py [QUESTIONS]          # issue 6's measurement (below)
    python plugins/specframe-ngram/bench_ngram.py --prompts ../shared/data/train_prompts/prompts.jsonl -n 6
    python plugins/specframe-ngram/bench_ngram.py --replay runs/bench-ngram/bench.json \
        --ngram max_candidates=1 --ngram max_candidates=3,num_speculative_tokens=8
    python plugins/specframe-ngram/bench_ngram.py --micro

Default: Spec-Bench's summarization and rag questions (the first `-n` of each; they have one turn), greedy,
128 new tokens, the default target; `ngram` against transformers' prompt lookup (`hf-pld`) and plain
`generate` (`hf`), interleaved question by question in one run, every output checked token for token against
`hf`'s. `--prompts` runs the same on prompts that are not Spec-Bench (to tune on).

`--replay`: greedy verification accepts the longest tree path that matches the target's own output, so a
bench.json's greedy outputs say exactly what any ngram setting would accept, without running the model. It
reports each setting's mean accepted length and tree size, and a decode-time estimate from the target's
forward cost measured here for each tree size (a ranking aid; confirm the winner with a real run).

`--micro`: the cost of one `propose()` as a ~2k-token sequence grows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specframe import DecodeState, SamplingParams, SpeculativeDecoder, load_config
from specframe.bench import BenchOptions, main_table, run_bench

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data from the repository root


def parse_setting(setting: str) -> list[str]:
    """'a=1,b=2' -> ['proposer.a=1', 'proposer.b=2']."""
    return [f"proposer.{kv}" for kv in setting.split(",") if kv]


def prompts_as_questions(path: str, n: int, skip: int, min_chars: int, out: Path) -> Path:
    """Long prompts from a {'prompt': ...} jsonl, written as one-turn Spec-Bench questions (labelled `qa`)."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    picked = [r["prompt"] for r in rows if min_chars <= len(r["prompt"]) <= 4 * min_chars][skip : skip + n]
    out.mkdir(parents=True, exist_ok=True)
    questions = out / "questions.jsonl"
    with questions.open("w", encoding="utf-8") as f:
        for i, text in enumerate(picked):
            f.write(json.dumps({"question_id": 10_000 + i, "category": "qa", "turns": [text]}) + "\n")
    return questions


def bench(args: argparse.Namespace) -> None:
    if args.prompts:
        questions = prompts_as_questions(args.prompts, args.n, args.skip, args.min_chars, Path(args.out))
        subtasks = ["qa"]
    else:
        questions, subtasks = Path(args.questions), ["summarization", "rag"]
    options = BenchOptions(
        proposers=["ngram"] + (["none"] if args.engine_none else []),
        baselines=["hf", "hf-pld"],
        subtasks=subtasks,
        limit=args.n,
        questions=str(questions),
        max_new_tokens=args.max_new_tokens,
        target=args.target,
        overrides=[f"ngram.{kv}" for kv in (args.ngram or [""])[0].split(",") if kv],
        pld_tokens=args.pld_tokens,
        out=args.out,
    )
    doc = run_bench(options)
    print("\n".join(main_table(doc)))
    print(
        f"load average: start {doc['loadavg_start']}, end {doc['loadavg_end']}; {doc['duration_s']:.0f} s; "
        f"torch threads {doc['settings']['torch_threads']}; details in {args.out}/bench.md"
    )


def forward_costs(decoder: SpeculativeDecoder, context: int, sizes: list[int], repeats: int = 5) -> dict[int, float]:
    """Seconds of one target forward over `n` new tokens after `context` cached ones (median of repeats)."""
    from specframe.kv_cache import new_cache

    model, costs = decoder.model, {}
    ids = torch.randint(100, 1000, (1, context), device=decoder.device)
    with torch.inference_mode():
        for n in sizes:
            times = []
            for _ in range(repeats):
                cache = new_cache(model)
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                x = torch.randint(100, 1000, (1, n), device=decoder.device)
                t0 = time.perf_counter()
                model(input_ids=x, position_ids=torch.arange(context, context + n)[None], cache=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
            costs[n] = statistics.median(times)
    return costs


def replay(args: argparse.Namespace) -> None:
    doc = json.loads(Path(args.replay).read_text())
    texts = {
        json.loads(line)["question_id"]: json.loads(line)["turns"]
        for line in open(doc["settings"]["questions"], encoding="utf-8")
    }
    refs = [r for r in doc["records"] if r["method"] == "hf" and r["turn"] == 0]
    decoder = SpeculativeDecoder.from_config(load_config(overrides=["proposer.name=ngram"]))
    prompts = [decoder.encode(texts[r["question_id"]][0]).tolist() for r in refs]
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    costs = forward_costs(decoder, int(statistics.mean(map(len, prompts))), sizes)
    print("forward cost (ms) by tokens verified: " + ", ".join(f"{n}: {c * 1e3:.0f}" for n, c in costs.items()))

    def cost(n: int) -> float:  # linear interpolation in the measured table
        lo = max(s for s in sizes if s <= n)
        hi = min((s for s in sizes if s >= n), default=lo)
        return costs[lo] if hi == lo else costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)

    print("\n| ngram setting | mean accepted length | nodes per step | depth per step | est. decode tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for setting in args.ngram or [""]:
        config = load_config(overrides=["proposer.name=ngram", *parse_setting(setting)]).proposer
        proposer = type(decoder.proposer)(config, decoder.info)
        emitted = forwards = nodes = depth = 0
        seconds = 0.0
        for prompt, r in zip(prompts, refs, strict=True):
            out = r["token_ids"]
            proposer.begin(torch.tensor(prompt), {})
            pos, forwards = 1, forwards + 1  # the prefill emitted out[0]
            while pos < len(out):
                state = DecodeState(
                    torch.tensor(prompt + out[:pos]), len(prompt), SamplingParams(), None, len(out) - pos - 1
                )
                p = proposer.propose(state)
                children: dict[tuple[int, int], int] = {}
                for i, (t, parent) in enumerate(zip(p.tokens.tolist(), p.parents.tolist(), strict=True)):
                    children[(parent, t)] = i
                node, k = -1, 0
                while pos + k < len(out) and (node, out[pos + k]) in children:
                    node, k = children[(node, out[pos + k])], k + 1
                pos, forwards = pos + k + 1, forwards + 1
                nodes, depth, seconds = nodes + len(p), depth + max(p.depths(), default=0), seconds + cost(len(p) + 1)
            emitted += len(out)
        steps = forwards - len(refs)
        print(
            f"| {setting or 'defaults'} | {emitted / forwards:.2f} | {nodes / steps:.1f} | {depth / steps:.1f} | "
            f"{(emitted - len(refs)) / seconds:.1f} |"
        )


def micro(args: argparse.Namespace) -> None:
    """Time begin() on 1.5k tokens, then propose() each step as the sequence grows by 1-4 tokens to 2k."""
    decoder = SpeculativeDecoder.from_config(
        load_config(overrides=["proposer.name=ngram", *parse_setting((args.ngram or [""])[0])])
    )
    text = next(
        json.loads(line)["turns"][0]
        for line in open(args.questions, encoding="utf-8")
        if json.loads(line)["category"] == "summarization"
    )
    ids = decoder.encode(text)
    ids = torch.cat([ids] * (2048 // ids.numel() + 1))[:2048]  # repeated text: many matches, full proposals
    proposer, g = decoder.proposer, torch.Generator()
    begins, times, sizes = [], [], []
    for _ in range(3):
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
    print(
        f"propose() at 1.5k-2k tokens, {len(times)} calls: median {statistics.median(times) * 1e6:.0f} us, "
        f"p90 {times[int(0.9 * len(times))] * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us; "
        f"mean proposal {statistics.mean(sizes):.1f} nodes"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "questions",
        nargs="?",
        default=str(DATA / "spec_bench" / "question.jsonl"),
        help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench/question.jsonl)",
    )
    ap.add_argument("-n", type=int, default=10, help="questions per subtask (or prompts with --prompts)")
    ap.add_argument("--prompts", help="a jsonl of {'prompt': ...} to run instead of Spec-Bench (for tuning)")
    ap.add_argument("--skip", type=int, default=0, help="with --prompts: skip this many eligible prompts")
    ap.add_argument("--min-chars", type=int, default=1500, help="with --prompts: shortest prompt taken")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--target", help="target.model (default: specframe's default)")
    ap.add_argument(
        "--ngram",
        action="append",
        metavar="K=V,K=V",
        help="ngram setting (proposer keys); bench and --micro use the first, --replay compares all",
    )
    ap.add_argument("--pld-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    ap.add_argument("--engine-none", action="store_true", help="also run specframe's `none` (engine baseline)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the benchmark machine has 2 cores)")
    ap.add_argument("--out", default="runs/bench-ngram")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--replay", metavar="BENCH_JSON", help="compare --ngram settings on saved greedy outputs")
    mode.add_argument("--micro", action="store_true", help="time propose() on a ~2k-token sequence")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)
    (replay if args.replay else micro if args.micro else bench)(args)


if __name__ == "__main__":
    main()
