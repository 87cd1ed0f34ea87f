"""The `specframe` command line (also `python -m specframe`). Exit codes: 0 ok, 2 bad input, 1 other failure."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from specframe.errors import BadInputError, brief, check_output_path, user_path


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line (exit 2), as every other error of the command line; the
    usage itself is one `--help` away. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` shows the usage)\n")


# train's and distill's --target when none is given: models.DEFAULT_ALIAS (not imported here: that loads torch,
# and the parser is built before any command runs)
DEFAULT_TARGET = "smollm2-135m-instruct"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specframe", description="Exact speculative decoding.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text with a proposer")
    g.add_argument(
        "--proposer",
        help="proposer name (proposer.name); without it and a --config that names one: none, plain decoding",
    )
    g.add_argument("--prompt", help="prompt text; read from standard input when absent")
    g.add_argument("--target", help="target model (target.model)")
    g.add_argument("--max-new-tokens", type=int, help="generation.max_new_tokens (default 128)")
    g.add_argument("--temperature", type=float, help="sampling.temperature (default 0 = greedy)")
    g.add_argument("--top-p", type=float, help="sampling.top_p (default 1 = off)")
    g.add_argument("--top-k", type=int, help="sampling.top_k (default 0 = off; -1 = off too)")
    g.add_argument("--min-p", type=float, help="sampling.min_p (default 0 = off)")
    g.add_argument("--repetition-penalty", type=float, help="sampling.repetition_penalty (default 1 = off)")
    g.add_argument("--presence-penalty", type=float, help="sampling.presence_penalty (default 0 = off)")
    g.add_argument("--frequency-penalty", type=float, help="sampling.frequency_penalty (default 0 = off)")
    g.add_argument("--seed", type=int, help="sampling.seed (default: unset, a fresh seed per run)")
    g.add_argument("--config", help="YAML config file (or the name of a packaged one, e.g. draft.yaml)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats, shapes")
    g.add_argument(
        "--logprobs",
        action="store_const",
        const=True,
        help="generation.logprobs: --json also gives each new token's log-probability under the target",
    )
    g.add_argument(
        "--top-logprobs",
        type=int,
        metavar="N",
        help="generation.top_logprobs: --json also gives the target's N most likely tokens at each new token's "
        "position, with their log-probabilities (implies --logprobs)",
    )
    g.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (OmegaConf dotlist)")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    g.set_defaults(run=cmd_generate)

    p = sub.add_parser("plugins", help="list installed proposers")
    p.add_argument("--json", action="store_true", help="print one JSON object: proposers and plugin failures")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    p.set_defaults(run=cmd_plugins)

    c = sub.add_parser("check", help="run the exactness conformance suite on a proposer (tiny random models)")
    c.add_argument("--proposer", help="proposer name (default: the --config file's proposer.name)")
    c.add_argument(
        "--config",
        help="a `specframe generate` YAML config (or a packaged one's name): its proposer section's options are "
        "checked; KEY=VALUE overrides win",
    )
    c.add_argument("--device", action="append", help="device(s) to check; default: cpu and cuda if present")
    c.add_argument(
        "--dtype",
        action="append",
        help="dtype(s) of the tiny target: float32, bfloat16, float16, auto (= float32); repeat for several; "
        "default float32",
    )
    c.add_argument(
        "--arch",
        action="append",
        help="model type of the tiny target, as in a config.json's model_type (llama, mistral, qwen2, qwen3, "
        "gemma2, gemma3_text, phi3, gpt2, ...; sliding-window types get a 4-token window); repeat for several; "
        "default llama",
    )
    c.add_argument("--quick", action="store_true", help="greedy, rollback and isolation checks only (no statistics)")
    c.add_argument(
        "--no-power",
        action="store_true",
        help="skip the power checks (broken rules that must be caught: they test the suite itself)",
    )
    c.add_argument("--json", action="store_true", help="print the report as one JSON object")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="proposer options, e.g. proposer.max_ngram=2")
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    c.set_defaults(run=cmd_check)

    t = sub.add_parser("train", help="train a proposer's drafter or heads on self-distillation data")
    t.add_argument("--proposer", required=True, help="proposer name")
    t.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (training runs in float32)")
    add_target_load_flags(t, "trained for")
    t.add_argument("--resume", action="store_true", help="continue from the output folder's checkpoint")
    t.add_argument(
        "--config", default=None, help="YAML of training options (e.g. the packaged train-eagle.yaml); KEY=VALUE win"
    )
    t.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="training options (docs/training.md): data=FILE (default runs/distill/smollm2-135m-instruct.jsonl), "
        "out=FOLDER (default runs/<proposer>, e.g. runs/medusa), epochs=N, ...",
    )
    t.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    t.set_defaults(run=cmd_train)

    d = sub.add_parser("data", help="training data")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="distill")
    dist = dsub.add_parser("distill", help="the target's own responses to training prompts (resumable)")
    dist.add_argument(
        "--prompts", default=None, help="JSONL with id and prompt (default: ../shared/data/train_prompts/prompts.jsonl)"
    )
    dist.add_argument("--out", required=True, help="output JSONL (appended; existing ids are skipped)")
    dist.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    dist.add_argument("--dtype", default="bfloat16", help="target dtype for generation (bfloat16 is ~2x faster on CPU)")
    dist.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N (default auto)")
    add_target_load_flags(dist, "answering")
    dist.add_argument("--limit", type=int, default=None, help="use the first N prompts (default: all)")
    dist.add_argument("--batch-size", type=int, default=32, help="sequences generated at once (default 32)")
    dist.add_argument("--max-new-tokens", type=int, default=128, help="longest response (default 128)")
    dist.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts (default 384)")
    dist.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses (default 0)")
    dist.add_argument("--seed", type=int, default=0, help="sampling seed, with --temperature > 0 (default 0)")
    dist.add_argument(
        "--tag",
        default="",
        help="write ids '<prompt id>#TAG': a further response (e.g. sampled) to every prompt of --prompts, in the "
        "same --out",
    )
    dist.add_argument(
        "--raw",
        action="store_true",
        help="take each prompt's text as it is, without the chat template (a base model's; as generate --raw)",
    )
    dist.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    dist.set_defaults(run=cmd_data_distill)

    # Flags left out are absent (SUPPRESS), so that a --config file can set them: flags > file > BenchOptions.
    b = sub.add_parser(
        "bench",
        help="Spec-Bench style speed/acceptance benchmark (writes JSON, Markdown, PNG)",
        argument_default=argparse.SUPPRESS,
    )
    b.add_argument("--config", help="YAML of bench options (BenchOptions' fields, e.g. the packaged bench-cpu.yaml)")
    b.add_argument(
        "--proposers",
        help="comma-separated specframe proposers (an unknown name is an error); ones with no trained artifact "
        "for the target are skipped with a message, and one named by its model option that cannot load is an "
        "error (default: none,draft,medusa,eagle,ngram,union)",
    )
    b.add_argument(
        "--baselines",
        help="comma-separated transformers baselines: hf, hf-assisted, hf-pld ('' for none; default: all three)",
    )
    b.add_argument(
        "--subtasks",
        help="comma-separated Spec-Bench subtasks (default: all six)",
    )
    b.add_argument("--limit", type=int, help="first N questions of each subtask (default: all)")
    b.add_argument(
        "--questions",
        help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench/question.jsonl)",
    )
    b.add_argument("--max-new-tokens", type=int, help="default 128")
    b.add_argument("--target", help="target model (target.model)")
    b.add_argument("--dtype", help="target.dtype: auto, float32, bfloat16, float16 (default auto)")
    b.add_argument("--device", help="target.device: auto, cpu, cuda, cuda:N (default auto)")
    b.add_argument("--temperature", type=float, help="0 = greedy (Spec-Bench); > 0 = sampling")
    b.add_argument("--top-p", type=float, help="nucleus sampling, with --temperature > 0 (default 1 = off)")
    b.add_argument("--top-k", type=int, help="top-k sampling, with --temperature > 0 (default 0 = off; -1 = off too)")
    b.add_argument("--min-p", type=float, help="min-p sampling, with --temperature > 0 (default 0 = off)")
    b.add_argument(
        "--repetition-penalty", type=float, help="every method's, greedy too (default 1 = off; transformers' own)"
    )
    b.add_argument(
        "--presence-penalty",
        type=float,
        help="vLLM's, every method's (default 0 = off; for transformers' baselines a logits processor)",
    )
    b.add_argument("--frequency-penalty", type=float, help="vLLM's, as --presence-penalty (default 0 = off)")
    b.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every method generates --max-new-tokens, past the target's EOS tokens (turns of one length)",
    )
    b.add_argument("--seed", type=int, help="base seed; each (question, turn) derives its own (default 0)")
    b.add_argument("--pld-tokens", type=int, help="hf-pld's prompt_lookup_num_tokens (default 10)")
    b.add_argument(
        "--tie-threshold",
        type=float,
        help="a first difference is a near-tie if the top-2 logit gap <= this x max(1, |top-1 logit|) "
        "(default 1e-3; for a 16-bit target at least its dtype's eps)",
    )
    b.add_argument(
        "--out",
        help="output folder: bench.json, bench.md, *.png (default runs/bench; with --render, BENCH_JSON's own "
        "folder, its report re-made in place)",
    )
    b.add_argument("--results-doc", help="also write this Markdown results page, e.g. docs/results.md (default: none)")
    b.add_argument("--threads", type=int, help="torch threads for the run (default: torch's)")
    b.add_argument(
        "--time-limit",
        type=float,
        dest=BENCH_FIELDS["--time-limit"],
        metavar="SECONDS",
        help="start no question expected to end after this many seconds of timed runs (its turns at the mean time "
        "per turn so far; the first always runs); the questions then take the subtasks in turn, and the report "
        "says where it stopped (default: run them all)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--render",
        metavar="BENCH_JSON",
        help="run nothing: re-make the report (Markdown, plots, --results-doc) from an earlier bench.json "
        "(takes --out and --results-doc only)",
    )
    b.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="target.<key>=... for the target, <proposer>.<key>=... for one proposer "
        "(e.g. draft.num_speculative_tokens=5)",
    )
    b.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    b.set_defaults(run=cmd_bench)

    m = sub.add_parser("models", help="the offline default model(s)")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="pull|list")
    pull = msub.add_parser(
        "pull", help="download, verify and cache a model alias; a cached copy is checked and pulled again if damaged"
    )
    pull.add_argument("alias", nargs="?", default="smollm2-135m-instruct")
    pull.add_argument("--force", action="store_true", help="pull again even when a complete copy is cached")
    pull.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    pull.set_defaults(run=cmd_models_pull)
    lst = msub.add_parser("list", help="aliases and where they are cached")
    lst.add_argument("--json", action="store_true", help="print one JSON list of the aliases")
    lst.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    lst.set_defaults(run=cmd_models_list)
    return parser


def key_values(items: list[str], prefix: str = "") -> list[str]:
    """`items` after checking each is KEY=VALUE (with KEY under `prefix` when given)."""
    for item in items:
        if "=" not in item or not item.startswith(prefix):
            raise BadInputError(f"override '{item}' is not {prefix}KEY=VALUE")
    return items


GENERATE_FLAGS = {  # the config key each `generate` flag sets, and the flag
    "proposer.name": "--proposer",
    "target.model": "--target",
    "generation.max_new_tokens": "--max-new-tokens",
    "sampling.temperature": "--temperature",
    "sampling.top_p": "--top-p",
    "sampling.top_k": "--top-k",
    "sampling.min_p": "--min-p",
    "sampling.repetition_penalty": "--repetition-penalty",
    "sampling.presence_penalty": "--presence-penalty",
    "sampling.frequency_penalty": "--frequency-penalty",
    "sampling.seed": "--seed",
    "generation.logprobs": "--logprobs",
    "generation.top_logprobs": "--top-logprobs",
}


def generate_overrides(args: argparse.Namespace) -> list[str]:
    """Dotlist overrides: KEY=VALUE arguments, then the explicit flags as typed (which win). A flag and an
    override that set one key to different values are refused: which one the user meant is not known."""
    from specframe.config import flag_overrides

    key_values(args.overrides)
    flags = {key: (flag, getattr(args, flag[2:].replace("-", "_"))) for key, flag in GENERATE_FLAGS.items()}
    return list(args.overrides) + flag_overrides(flags, args.overrides)


def cmd_generate(args: argparse.Namespace) -> int:
    from specframe.config import greedy_note, load_config
    from specframe.decoder import SpeculativeDecoder, check_text

    cfg = load_config(args.config, generate_overrides(args))
    s = cfg.sampling
    defaults = (("top_p", s.top_p == 1.0), ("top_k", s.top_k == 0), ("min_p", s.min_p == 0.0), ("seed", s.seed is None))
    unused = [k for k, off in defaults if not off]
    note = greedy_note([f"sampling.{k}" for k in unused]) if s.temperature == 0 else None
    if note:  # (greedy draws nothing: as transformers, say so rather than ignore it)
        print(f"specframe: note: {note}; give --temperature > 0 to sample", file=sys.stderr)
    # (from standard input without the line end that `echo` or a file's last line adds, as --prompt has none)
    if args.prompt is None and sys.stdin.isatty():  # (else it would wait without a word)
        print(
            "specframe: reading the prompt from standard input (end it with Ctrl-D; or give --prompt)", file=sys.stderr
        )
    prompt = args.prompt if args.prompt is not None else read_stdin().removesuffix("\n").removesuffix("\r")
    if not prompt:
        raise BadInputError("the prompt is empty")
    check_text(prompt)  # (bytes that are not UTF-8: refused before the model loads)
    decoder = SpeculativeDecoder.from_config(cfg)
    if decoder.tokenizer is None:
        raise BadInputError(
            f"target '{cfg.target.model}' has no tokenizer, so a text prompt cannot be encoded: add the "
            "tokenizer's files to the model folder, or call the Python API with the prompt as a list of token ids"
        )
    if not args.raw and not getattr(decoder.tokenizer, "chat_template", None):  # (as bench says it)
        print(
            "specframe: note: the target's tokenizer has no chat template: the prompt is given as it is",
            file=sys.stderr,
        )
    result = decoder.generate(prompt, raw=args.raw, stream=None if args.json else write_now)
    if args.json:
        shapes = measured_shapes(decoder.proposer)  # (they decide which random numbers a sampled run draws)
        shown = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats, "shapes": shapes}
        if result.logprobs is not None:
            shown["logprobs"] = result.logprobs
        if result.top_logprobs is not None:  # (a list per token, most likely first: JSON keys would be text)
            shown["top_logprobs"] = [
                [{"token_id": i, "text": decoder.tokenizer.decode([i]), "logprob": lp} for i, lp in top.items()]
                for top in result.top_logprobs
            ]
        print(json.dumps(shown))
    else:
        print(flush=True)  # (the text itself was streamed: its pieces add up to result.text)
        s = result.stats
        print(
            f"[{cfg.proposer_name}] {s['new_tokens']} tokens, {s['target_forwards']} target forwards, "
            f"mean accepted length {s['mean_accepted_length']:.2f}, {s['tokens_per_s']:.1f} tokens/s"
            f"{shapes_said(measured_shapes(decoder.proposer))}",
            file=sys.stderr,
        )
    if result.stats["finish_reason"] == "context":  # (never a silent cut: --json says it in its stats too)
        print(
            f"specframe: stopped after {result.stats['new_tokens']} of generation.max_new_tokens="
            f"{cfg.generation.max_new_tokens} tokens: the target's {decoder.context_kind} "
            f"({decoder.context_window} tokens) is full",
            file=sys.stderr,
        )
    return 0


def write_now(text: str) -> None:
    """Write a piece of streamed text to standard output at once."""
    sys.stdout.write(text)
    sys.stdout.flush()


def read_stdin() -> str:
    """Standard input as text, its bytes that are not UTF-8 kept as lone surrogates (as Python keeps them in
    arguments) whatever the locale, for `check_text` to refuse by name, not as a codec error."""
    binary = getattr(sys.stdin, "buffer", None)  # (none when a caller of `main` replaced stdin with a text stream)
    return binary.read().decode("utf-8", "surrogateescape") if binary is not None else sys.stdin.read()


def shown_bytes(text: str) -> str:
    """`text` with its bytes that are not UTF-8 (kept as lone surrogates) shown as \\xNN."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def measured_shapes(proposer) -> list[str]:
    """The proposal shapes `proposer` (or a union's members) chose by timing this machine at load, as
    "eagle: chain of 2" (none when the shape was saved or configured, or not on a CPU); bench gives the timings."""
    from specframe.bench import proposer_and_members

    return [
        f"{p.name}: {p.measured_shape}" for p in proposer_and_members(proposer) if getattr(p, "measured_shape", None)
    ]


def shapes_said(shapes: list[str]) -> str:
    """`measured_shapes` for the end of generate's stats line ("" when there are none)."""
    return f"; {', '.join(shapes)}, chosen at load from this CPU's timings" if shapes else ""


def cmd_plugins(args: argparse.Namespace) -> int:
    from specframe.plugins import get_registry

    reg = get_registry()
    rows = [
        {
            "name": e.name,
            "plugin": e.plugin,
            "distribution": e.distribution,
            "version": e.version,
            "class": f"{e.cls.__module__}.{e.cls.__qualname__}",
        }
        for e in sorted(reg.proposers.values(), key=lambda e: e.name)
    ]
    if args.json:
        print(json.dumps({"proposers": rows, "failures": reg.failures}))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  plugin {r['plugin']}  ({r['distribution']} {r['version']})")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from specframe.config import load_yaml, models_named, split_override, structured, with_defaults, with_overrides
    from specframe.plugins import get_registry
    from specframe.testing.conformance import run_suite, suite_archs, suite_devices_and_dtypes

    options = OmegaConf.create()
    name = args.proposer
    if args.config:
        raw = load_yaml(args.config)
        section = raw.get("proposer")
        if not OmegaConf.is_dict(section):
            what = "has no proposer section" if section is None else "has a proposer section that is not a mapping"
            raise BadInputError(f"--config {args.config} {what}: check takes a `specframe generate` config")
        named = section.get("name")
        if name is None:
            name = named
        elif named is not None and named != name:
            raise BadInputError(f"--proposer {name} and --config {args.config}'s proposer.name {named} differ")
        if name is not None:  # (resolved as generate resolves it: interpolations may name other sections)
            section.name = name
            options = with_defaults(raw).proposer
            options.pop("name", None)
    if name is None:
        raise BadInputError("give --proposer NAME (or a --config file whose proposer section names one)")
    entry = get_registry().get(name)
    # (built here even without overrides: a field with no default is then named, as generate names it)
    typed = key_values(args.overrides, "proposer.")
    values = with_overrides(options, [o.removeprefix("proposer.") for o in typed])
    config = structured(entry.cls.config_class, values, "proposer")
    named = models_named(config)  # (the suite builds every proposer with random weights on tiny targets)
    # A generate config names the trained models it runs: the file's are set aside (said); a typed one is refused.
    typed_keys = [split_override(o)[0] for o in typed]

    def from_file(item: str) -> bool:  # "proposer.model=X": not typed, as its key or a section holding it
        key = item.partition("=")[0]
        return bool(args.config) and not any(key == t or key.startswith(t + ".") for t in typed_keys)

    dropped = [n for n in named if from_file(n)]
    if dropped:
        for item in dropped:  # "proposer.model=X", "proposer.options.<member>.model=X"
            parent, _, leaf = item.partition("=")[0].removeprefix("proposer.").rpartition(".")
            (OmegaConf.select(values, parent) if parent else values).pop(leaf)
        config = structured(entry.cls.config_class, values, "proposer")
        named = [n for n in named if n not in dropped]
        print(
            f"specframe check: note: {', '.join(dropped)} from --config {args.config} not loaded: the suite "
            "tests the proposer's options with random weights on tiny targets",
            file=sys.stderr,
            flush=True,
        )
    if named:
        raise BadInputError(
            f"check tests proposer '{entry.name}' with random weights on tiny targets: {', '.join(named)} would "
            "not be used; drop it (trained weights are checked on their target by comparing `specframe bench` or "
            "`generate --json` outputs with proposer none's)"
        )
    suite_devices_and_dtypes(args.device, args.dtype)  # (bad names refused before the header)
    suite_archs(args.arch)
    if not args.json:  # (then each check's line as it finishes, then the totals)
        print(f"conformance of proposer '{entry.name}':", flush=True)
    report = run_suite(
        entry.cls,
        devices=args.device,
        config=config,
        quick=args.quick,
        log=None if args.json else lambda line: print(line, flush=True),
        dtypes=args.dtype,
        power=False if args.no_power else None,
        debug=getattr(args, "debug", False),
        archs=args.arch,
    )
    print(json.dumps(report.as_dict(traces=getattr(args, "debug", False))) if args.json else report.totals())
    return 0 if report.passed else 1


def add_target_load_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """--adapter and --trust-remote-code: how the target is loaded, as generate's target.adapter and
    target.trust_remote_code say it."""
    parser.add_argument(
        "--adapter",
        default=None,
        help=f"PEFT adapter folder merged into the target at load (as generate's target.adapter): the model {role} "
        "is the adapted one",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run the target's own model code (as target.trust_remote_code; off by default)",
    )


def load_target(args: argparse.Namespace, dtype: str):
    """The target of `train` or `data distill`: --target on --device, loaded as the flags of
    `add_target_load_flags` say."""
    from specframe.models import load_model

    return load_model(
        args.target,
        dtype=dtype,
        device=args.device,
        quiet=True,
        adapter=args.adapter or None,
        trust_remote_code=args.trust_remote_code,
    )


def cmd_train(args: argparse.Namespace) -> int:
    from specframe.config import recipe_for, structured
    from specframe.data import only_writer
    from specframe.plugins import get_registry
    from specframe.training.common import TrainRunConfig, check_run_inputs

    entry = get_registry().get(args.proposer)
    if entry.cls.train_config_class is None:
        raise BadInputError(f"proposer '{entry.name}' has nothing to train")

    schema = entry.cls.train_config_class
    options = merged_options(args.config, args.overrides)
    if "target" in options:  # (generate's and bench's target section: here it would be "Key 'target' not in ...")
        given = next((o for o in args.overrides if o.split("=", 1)[0].split(".", 1)[0] == "target"), None)
        raise BadInputError(
            f"{given or f'--config {args.config} has a target section'}: train takes its target as --target MODEL "
            "(and --device, --adapter, --trust-remote-code); it trains in float32, with the target as loaded from there"
        )
    config = structured(schema, recipe_for(entry.name, options, schema), "train")
    # (a built-in trainer's out folder locked, its data and checkpoint checked: before the target loads)
    built_in = isinstance(config, TrainRunConfig)
    with only_writer(config.out, "train.out", "training run") if built_in else contextlib.nullcontext():
        if built_in:
            check_run_inputs(config, args.resume)
        loaded = load_target(args, dtype="float32")
        default = " (the default; --target chooses another)" if args.target == DEFAULT_TARGET else ""
        print(f"specframe: training {entry.name} for target {loaded.source}{default}", file=sys.stderr, flush=True)
        try:
            metrics = entry.cls.train(config, loaded.model, loaded.tokenizer, resume=args.resume)
        except KeyboardInterrupt:  # (Ctrl-C or SIGTERM; then "specframe: interrupted"/"terminated", as for any command)
            from specframe.training.common import checkpoint_progress

            where = checkpoint_progress(Path(config.out) / "checkpoint") if built_in else None
            if where is not None:
                print(f"specframe: the last checkpoint ({where}) is in {config.out}/checkpoint: continue with "
                      "--resume and the same options", file=sys.stderr)  # fmt: skip
            raise
    print(json.dumps(metrics.get("heldout", metrics)))
    return 0


def merged_options(path: str | None, overrides: list[str]) -> Any:
    """A `--config` YAML of options (a mapping; a packaged name works too) with KEY=VALUE overrides on top."""
    from omegaconf import OmegaConf

    from specframe.config import load_yaml, with_overrides

    return with_overrides(load_yaml(path) if path else OmegaConf.create({}), key_values(overrides))


def cmd_data_distill(args: argparse.Namespace) -> int:
    from specframe.bench import default_benchmark_turns
    from specframe.data import (
        DEFAULT_PROMPTS,
        check_tag,
        distill,
        only_writer,
        read_distill,
        read_prompts,
        shared_data_file,
    )
    from specframe.sampling import check_sampling, check_seed

    check_tag(args.tag)  # (distill checks these two too; here they fail before the model loads)
    check_output_path(args.out, "--out", folder=False)
    for name in ("limit", "batch_size", "max_new_tokens", "max_prompt_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise BadInputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check_sampling(args.temperature, 0, 1.0, prefix="--")
    check_seed(args.seed, "--seed", unset="")
    # (the benchmark's own questions are never training prompts, whatever file they come in)
    path = args.prompts or shared_data_file(DEFAULT_PROMPTS)
    if args.prompts is None and not Path(path).exists():  # (the shared data folder is not part of the package)
        raise BadInputError(
            f"the default prompts file '{path}' does not exist (the project's shared data, beside its checkout): "
            'give --prompts FILE, a JSONL file with one {"id": ..., "prompt": ...} object per line'
        )
    empty: list[str] = []
    prompts = read_prompts(path, benchmark_turns=default_benchmark_turns(), empty=empty, limit=args.limit)
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        print(f"skipping {len(empty)} empty prompt{'s' * (len(empty) > 1)} in '{path}': {shown}", file=sys.stderr)
    with only_writer(args.out):  # (before the model loads: a second run on the same file is refused at once)
        if Path(args.out).is_file():  # (before the model loads; distill checks it again, then appends)
            read_distill(args.out, unfinished_tail=True)
        loaded = load_target(args, dtype=args.dtype)
        if loaded.tokenizer is None:
            raise BadInputError(
                f"target '{args.target}' has no tokenizer: distillation needs one to encode the prompts"
            )
        added = distill(
            loaded.model,
            loaded.tokenizer,
            prompts,
            args.out,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            max_prompt_tokens=args.max_prompt_tokens,
            temperature=args.temperature,
            seed=args.seed,
            tag=args.tag,
            raw=args.raw,
        )
    created = "" if Path(args.out).exists() else f" ('{args.out}' was not created)"
    print(f"added {added} response{'' if added == 1 else 's'} to {args.out}{created}", file=sys.stderr)
    return 0


RENDER_TAKES = {"render", "out", "results_doc", "debug", "no_progress", "run", "command"}  # (argparse's keys too)
BENCH_FIELDS = {"--time-limit": "time_limit_s"}  # bench flags whose BenchOptions field is not named after them


def cmd_bench(args: argparse.Namespace) -> int:
    import dataclasses

    from omegaconf import OmegaConf

    from specframe.bench import TARGET_FLAGS, BenchOptions, main_table, render, run_bench
    from specframe.config import flag_overrides, load_yaml, structured

    def names(text: str) -> list[str]:
        return [n.strip() for n in text.split(",") if n.strip()]

    given = vars(args)  # only the flags given on the command line (the parser suppresses absent ones)
    if given.get("render"):
        ignored = [k for k, v in given.items() if k not in RENDER_TAKES and not (k == "overrides" and not v)]
        if ignored:  # (they would be ignored: the records were made with the run's own options)
            flag = f"--{ignored[0].replace('_', '-')}" if ignored[0] != "overrides" else "KEY=VALUE overrides"
            raise BadInputError(
                f"--render re-makes the report of an earlier run from its records: it takes --out and "
                f"--results-doc only, not {flag} (run the benchmark again to change what it measures)"
            )
        doc = render(args.render, given.get("out"), given.get("results_doc"))
        print("\n".join(main_table(doc)))
        return 0
    flags = {k: v for k, v in given.items() if k in {f.name for f in dataclasses.fields(BenchOptions)}}
    for key in ("proposers", "baselines", "subtasks"):
        if key in flags:
            flags[key] = names(flags[key])
    if given.get("no_progress"):
        flags["progress"] = False
    # The file through OmegaConf (validated, interpolated); the flags, typed by argparse, as given (a path with
    # "${" in it stays text); overrides: the file's, then the command line's.
    from_file = load_yaml(args.config) if given.get("config") else None
    given_sections = (from_file or {}).get
    sections = [k for k in ("target", "proposer", "sampling", "generation") if OmegaConf.is_dict(given_sections(k))]
    if sections:  # (a `specframe generate` config: its sections are no bench options)
        raise BadInputError(
            f"--config {args.config} is a `specframe generate` config (it has {', '.join(sections)}): bench takes "
            "its own options (e.g. bench-cpu.yaml: proposers, baselines, limit, max_new_tokens, ...; a proposer's "
            "options as overrides, e.g. eagle.depth=6)"
        )
    try:
        options = structured(BenchOptions, from_file, "bench")
    except BadInputError as e:  # (name the file and its key: `bench.subtasks` is no key the user could type)
        # (where `structured` names a key: first, and in its examples; not `bench.` in, say, a file's name)
        said = re.sub(r"(^|with |e\.g\. )bench\.", r"\1", str(e))
        raise BadInputError(f"--config {args.config}: {said}") from e
    typed = key_values(flags.pop("overrides", []))
    # A flag and an override typed together that disagree are refused (a file's options give way to both).
    target_flags = {key: (flag, flags.get(flag.removeprefix("--"))) for key, flag in TARGET_FLAGS.items()}
    flag_overrides(target_flags, [item for item in typed if item.startswith("target.")])
    overrides = [*options.overrides, *typed]
    options = dataclasses.replace(options, **flags, overrides=overrides)
    try:
        options.validate()  # (run_bench's own first step, here to say where a bad value came from)
    except BadInputError as e:
        flag = str(e).split()[0] if str(e).startswith("--") else ""
        key = BENCH_FIELDS.get(flag, flag.removeprefix("--").replace("-", "_"))  # (the BenchOptions field it sets)
        if flag and key not in flags and from_file is not None and key in from_file:  # (the file's, not a flag's)
            raise BadInputError(f"--config {args.config}: {key}{str(e)[len(flag) :]}") from e
        raise
    doc = run_bench(options)
    print("\n".join(main_table(doc)))
    from specframe.bench import plots_possible

    wrote = [f"{options.out}/bench.json", f"{options.out}/bench.md"] + (
        [f"{options.out}/*.png"] if plots_possible() else []
    )
    print(f"wrote {', '.join(wrote + ([options.results_doc] if options.results_doc else []))}", file=sys.stderr)
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from specframe.models import pull_default_model

    print(pull_default_model(args.alias, force=args.force, verify=True))
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from specframe.models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print("  ".join(str(v) for v in r.values()))
    return 0


def show_plugin_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Plugin problems and CUDA graphs turned off as one clean line on stderr; other warnings as Python shows them."""
    from specframe.cuda_graphs import GraphsWarning
    from specframe.plugins import PluginWarning

    if issubclass(category, (PluginWarning, GraphsWarning)):
        print(f"specframe: warning: {message}", file=sys.stderr)
    else:
        _show_warning(message, category, filename, lineno, file, line)


_show_warning = warnings.showwarning


# Options that name files or folders: a leading `~` is the home folder there (model names are read by load_model).
PATH_ARGUMENTS = ("out", "prompts", "questions", "results_doc", "render", "config", "adapter")


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = show_plugin_warning
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # argparse fills the KEY=VALUE positional once: KEY=VALUE items after a later option land here, in order.
    more = [a for a in rest if "=" in a and not a.startswith("-")]
    if more and hasattr(args, "overrides") and len(more) == len(rest):
        args.overrides = [*args.overrides, *more]
    elif rest:
        subcommand_parser(parser, args).error(f"unrecognized arguments: {' '.join(rest)}")
    for name in PATH_ARGUMENTS:  # (`--out=~/x` reaches us unexpanded: the shell expands only a word's start)
        if isinstance(getattr(args, name, None), str):
            setattr(args, name, user_path(getattr(args, name)))
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        with terminated_as_interrupt():
            for given in sys.argv[1:] if argv is None else argv:  # (undecodable bytes reach Python as surrogates)
                try:
                    given.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadInputError(f"the argument '{shown_bytes(given)}' is not UTF-8 text") from None
            return run(args)
    except BadInputError as e:
        return fail(args, e, 2)
    except KeyboardInterrupt as e:
        print(f"specframe: {'terminated' if isinstance(e, Terminated) else 'interrupted'}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:  # (its reader has gone, e.g. `| head -1`: quietly, as cat does; nothing more to write)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        return fail(args, e, 1)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's or `kill`'s stop), raised where the process is, as Ctrl-C's KeyboardInterrupt
    is: so that it unwinds the same way (a training run's checkpoint hint, locks and temporary files cleaned up)
    instead of dying on the spot."""


@contextlib.contextmanager
def terminated_as_interrupt() -> Any:
    """SIGTERM raises Terminated for the duration (the main thread only: signals can be handled nowhere else; and
    not where the parent process set it to be ignored)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> NoReturn:
        raise Terminated()

    before = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:  # (None: a handler set outside Python, which cannot be put back; the default is what it most likely was)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def subcommand_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command that `args` chose, so that its usage is the one shown with an error."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                return subcommand_parser(chosen, args)
    return parser


def fail(args: argparse.Namespace, e: Exception, code: int) -> int:
    if getattr(args, "debug", False):
        traceback.print_exc()
    print(f"specframe: error: {brief(e)}", file=sys.stderr)
    return code
