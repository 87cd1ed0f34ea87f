"""Spec-Bench style benchmark: every method on one shared target, interleaved prompt by prompt, in one run.

Methods are specframe proposers (`none`, `draft`, `ngram`, ...) and transformers baselines on the same
model object: `hf` (plain `generate`), `hf-assisted` (assisted generation with the `draft` proposer's draft)
and `hf-pld` (prompt-lookup decoding). Spec-Bench's protocol: batch 1, greedy by default, every turn of a
question fed in order with the method's own earlier answers in context, one warm-up call per method.

The numbers (docs/architecture.md "Stats"; the data: shared/data/README.md):
- mean accepted length: new tokens / target forwards (prefill included), pooled over every turn of the
  subtask (total tokens / total forwards), so long answers weigh more than short ones;
- tokens/s: Spec-Bench's mean over questions of (the question's new tokens over all its turns / its seconds);
- speedup: ratio of those means, over `hf` and over `none`, measured in the same run;
- acceptance rate: accepted / proposed draft tokens (tree: accepted / depth proposed), and by draft position;
- identity (greedy only): each turn's tokens against `hf`'s for the same conversation; at a first difference
  the target's top-2 logits are recomputed from scratch in float32 to tell a near-tie from a bug;
- predicted speedup (chain proposers): Leviathan et al.'s model fed with the measured α and costs (a
  consistency check of the model against the run's own timings, not an independent prediction).

Results go to `<out>/bench.json`, `<out>/bench.md` and two PNG plots; `results_doc` also writes a Markdown
page with the machine and the command (docs/results.md).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib.util
import json
import math
import os
import platform
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from specframe.config import greedy_note, literal, split_override
from specframe.data import read_jsonl, shared_data_file
from specframe.errors import BadInputError, brief, check_output_path, is_count, user_path
from specframe.sampling import History, SamplingParams, apply_penalties

# Spec-Bench's six subtasks and the `category` values of question.jsonl that make them up.
SUBTASKS: dict[str, tuple[str, ...]] = {
    "mt_bench": ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"),
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
    "rag": ("rag",),
}
SUBTASK_OF = {category: subtask for subtask, categories in SUBTASKS.items() for category in categories}
BASELINES = ("hf", "hf-assisted", "hf-pld")
DEFAULT_PROPOSERS = ("none", "draft", "medusa", "eagle", "ngram", "union")
DEFAULT_PLUGINS = {"ngram": "specframe-ngram"}  # default proposers that a plugin of this repository registers
# config key: the flag that sets it (named as the BenchOptions field it fills)
TARGET_FLAGS = {"target.model": "--target", "target.dtype": "--dtype", "target.device": "--device"}
REFERENCE = "hf"  # greedy reference and the first speedup denominator
ENGINE_BASELINE = "none"  # the second speedup denominator; also gives the plain decode step's cost
QUESTIONS = "spec_bench/question.jsonl"  # under ../shared/data
OVERALL = "overall"
WARMUP_PROMPT = "Say hello."
WARMUP_TOKENS = 8
FORMAT = "specframe-bench"


def default_questions_path() -> Path:
    """`../shared/data/spec_bench/question.jsonl` from the working directory, else from this source checkout."""
    return shared_data_file(QUESTIONS)


def default_benchmark_turns() -> list[str]:
    """Every turn of the default Spec-Bench questions file (`specframe data distill` refuses them as training
    prompts), or none when that file is not at hand."""
    path = default_questions_path()
    if not path.is_file():
        return []
    turns = [row.get("turns") for _, row in read_jsonl(path, "questions file")]
    return [t for ts in turns if isinstance(ts, list) for t in ts if isinstance(t, str)]  # (read_questions checks)


# ------------------------------------------------------------------------------------------------ options


@dataclass
class BenchOptions:
    # Methods: specframe proposer names, then transformers baselines (see BASELINES).
    proposers: list[str] = field(default_factory=lambda: list(DEFAULT_PROPOSERS))
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))
    # Spec-Bench subtasks to run (keys of SUBTASKS), each with its first `limit` questions (None = all).
    subtasks: list[str] = field(default_factory=lambda: list(SUBTASKS))
    limit: int | None = None
    # question.jsonl; None = the shared data folder (default_questions_path).
    questions: str | None = None
    max_new_tokens: int = 128
    # Target (target.model / dtype / device); None = the config default.
    target: str | None = None
    dtype: str | None = None
    device: str | None = None
    # Sampling: temperature 0 = greedy (Spec-Bench's setting); > 0 reports speed and acceptance, not identity.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Penalties (vLLM's three; in greedy decoding too): every method applies them, transformers' baselines
    # repetition_penalty as their own and presence/frequency through `OutputPenalties`.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Every method generates max_new_tokens, past the target's EOS tokens (vLLM's benchmarks' ignore_eos): turns of
    # one length for every method.
    ignore_eos: bool = False
    seed: int = 0  # each (question, turn) gets seed + 10 * question_id + turn, the same for every method
    # KEY=VALUE: `target.*` for the target, `<proposer>.<key>` for one proposer (e.g. draft.num_speculative_tokens=5).
    overrides: list[str] = field(default_factory=list)
    # transformers prompt lookup: tokens proposed per step (its max_matching_ngram_size stays at its default).
    pld_tokens: int = 10
    # A first difference is a near-tie when the target's top-2 logit gap <= tie_threshold * max(1, |top-1 logit|).
    tie_threshold: float = 1e-3
    out: str = "runs/bench"
    results_doc: str | None = None  # also write this Markdown page (docs/results.md)
    progress: bool = True  # tqdm bar with ETA on stderr
    # torch intra-op threads for the run; None = torch's default. On a machine other work shares, fewer threads
    # than cores can be much faster (a thread waiting for a busy core stalls every matmul).
    threads: int | None = None
    # Start no question expected to end after this many seconds of timed generation (its turns at the mean time per
    # turn so far; None = run them all; the first always runs). The questions then take the subtasks in turn, so a
    # cut run still covers each, and the report says where it stopped.
    time_limit_s: float | None = None

    def validate(self) -> None:
        """Raise BadInputError (exit 2) on options that cannot run, before any model is loaded."""
        for name in ("out", "questions", "results_doc"):  # (from a YAML file too: `~` is the home folder)
            if isinstance(getattr(self, name), str):
                setattr(self, name, user_path(getattr(self, name)))
        check_report_paths(self.out, self.results_doc)
        for flag, names in (("subtasks", self.subtasks), ("proposers", self.proposers), ("baselines", self.baselines)):
            twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
            if twice is not None:  # (a subtask would run twice; a method's two runs would pool under one name)
                raise BadInputError(f"--{flag} lists '{twice}' twice")
        unknown = [s for s in self.subtasks if s not in SUBTASKS]
        if unknown:
            raise BadInputError(f"unknown subtask '{unknown[0]}'; known: {', '.join(SUBTASKS)}")
        if not self.subtasks:
            raise BadInputError(f"no subtask given; known: {', '.join(SUBTASKS)}")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise BadInputError(f"unknown baseline '{unknown[0]}'; known: {', '.join(BASELINES)}")
        if not self.proposers and not self.baselines:
            raise BadInputError("nothing to run: give --proposers and/or --baselines")
        clash = set(self.proposers) & set(BASELINES)
        if clash:
            raise BadInputError(f"'{sorted(clash)[0]}' is a baseline: list it under --baselines")
        from specframe.plugins import get_registry

        seed_ok = isinstance(self.seed, int) and not isinstance(self.seed, bool) and -(2**63) <= self.seed < 2**63
        if not seed_ok:  # (each question's seed adds 10 x its id + the turn: it must stay a generator's seed)
            raise BadInputError(f"--seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        registry = get_registry()
        for name in self.proposers:  # (a typo or a plugin that is not installed: said before the target loads)
            try:
                registry.get(name)
            except BadInputError as e:
                plugin = DEFAULT_PLUGINS.get(name) if registry.autoload and name not in registry.contested else None
                if plugin is None:
                    raise
                raise BadInputError(
                    f"{e}. '{name}' comes from the {plugin} plugin (plugins/{plugin} in specframe's repository: "
                    f"pip install ./plugins/{plugin}); or leave it out of --proposers"
                ) from None
        for name, value in (
            ("limit", self.limit),
            ("max-new-tokens", self.max_new_tokens),
            ("pld-tokens", self.pld_tokens),
            ("threads", self.threads),
        ):
            if value is not None and not is_count(value):
                raise BadInputError(f"--{name} must be an integer >= 1, got {value!r}")
        if self.threads is not None and self.threads >= 2**31:  # (torch.set_num_threads takes a C int)
            raise BadInputError(f"--threads must be below 2**31, got {self.threads}")
        limit = self.time_limit_s
        number = isinstance(limit, (int, float)) and not isinstance(limit, bool)
        if limit is not None and not (number and 0 < limit < math.inf):
            raise BadInputError(f"--time-limit must be a finite number of seconds > 0, got {limit!r}")
        tie = self.tie_threshold
        number = isinstance(tie, (int, float)) and not isinstance(tie, bool)
        if not (number and 0 <= tie < math.inf):
            raise BadInputError(f"--tie-threshold must be a finite number >= 0, got {tie!r}")
        from specframe.errors import ConfigError, is_flag
        from specframe.sampling import check_penalties, check_sampling, top_k_off_as_zero

        try:
            check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, prefix="--")
            check_penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, prefix="--")
        except ConfigError as e:  # name the flag as typed: --top-p, not --top_p
            flag = str(e).split()[0]
            raise BadInputError(flag.replace("_", "-") + str(e)[len(flag) :]) from None
        if not is_flag(self.ignore_eos):
            raise BadInputError(f"--ignore-eos must be true or false, got {self.ignore_eos!r}")
        self.top_k = top_k_off_as_zero(self.top_k)  # (transformers' generate takes 0 for off, not -1)
        split_overrides(self.overrides, self.override_heads())

    def target_overrides(self) -> list[str]:
        """The `target.*` overrides that `target`, `dtype` and `device` make (those set); they win over `overrides`
        (a command line's flag and override that disagree are refused before: `specframe.cli.cmd_bench`)."""
        values = {key: getattr(self, flag.removeprefix("--")) for key, flag in TARGET_FLAGS.items()}
        return [f"{key}={literal(value)}" for key, value in values.items() if value is not None]

    def override_heads(self) -> list[str]:
        """Proposers that `<proposer>.<key>=...` may name: those run, and `draft` when hf-assisted borrows it."""
        return [*self.proposers, *(["draft"] if "hf-assisted" in self.baselines else [])]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalties(self) -> SamplingParams:
        """The penalties as SamplingParams (the rest at their defaults): what the tie check penalises with."""
        return SamplingParams(
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

    def command(self) -> str:
        """The `specframe bench` command that reproduces this run (every setting spelt out)."""
        argv = [
            "specframe",
            "bench",
            "--proposers",
            ",".join(self.proposers),
            "--baselines",
            ",".join(self.baselines),
            "--subtasks",
            ",".join(self.subtasks),
        ]
        if self.limit is not None:
            argv += ["--limit", str(self.limit)]
        argv += ["--max-new-tokens", str(self.max_new_tokens)]
        for flag, value in (
            ("--questions", self.questions),
            ("--target", self.target),
            ("--dtype", self.dtype),
            ("--device", self.device),
        ):
            if value is not None:
                argv += [flag, str(value)]
        if not self.greedy:
            argv += ["--temperature", str(self.temperature), "--top-p", str(self.top_p), "--top-k", str(self.top_k)]
            if self.min_p:
                argv += ["--min-p", str(self.min_p)]
        default = {f.name: f.default for f in fields(self)}
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(self, name) != default[name]:
                argv += [f"--{name.replace('_', '-')}", str(getattr(self, name))]
        if self.ignore_eos:
            argv += ["--ignore-eos"]
        for flag, name in (("--seed", "seed"), ("--pld-tokens", "pld_tokens"), ("--tie-threshold", "tie_threshold")):
            if getattr(self, name) != default[name]:
                argv += [flag, str(getattr(self, name))]
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.time_limit_s is not None:
            argv += ["--time-limit", str(self.time_limit_s)]
        argv += ["--out", self.out]
        if self.results_doc:
            argv += ["--results-doc", self.results_doc]
        return shlex.join(argv + list(self.overrides))


def split_overrides(overrides: list[str], proposers: Iterable[str]) -> tuple[list[str], dict[str, list[str]]]:
    """KEY=VALUE overrides -> (`target.*` dotlist for every config, {proposer: its `proposer.*` dotlist})."""
    names = set(proposers)
    shared: list[str] = []
    own: dict[str, list[str]] = {}
    for item in overrides:
        key, value = split_override(item) if "=" in item else (item, None)
        head, dot, rest = key.partition(".")
        if value is None or not dot or not rest:
            raise BadInputError(f"override '{item}' is not KEY=VALUE with KEY = target.<key> or <proposer>.<key>")
        if head == "target":
            shared.append(item)
        elif head in names:
            own.setdefault(head, []).append(f"proposer.{rest}={value}")
        else:
            raise BadInputError(
                f"override '{item}': '{head}' is neither 'target' nor a proposer of this run "
                f"({', '.join(sorted(names)) or 'none'}); sampling and generation have their own flags"
            )
    return shared, own


# ------------------------------------------------------------------------------------------------ questions


@dataclass
class Question:
    question_id: int
    subtask: str
    category: str
    turns: list[str]


def read_questions(
    path: str | Path, subtasks: list[str], limit: int | None = None, log: Callable[[str], None] | None = None
) -> list[Question]:
    """The questions of `subtasks` (first `limit` of each, in file order), grouped by subtask. `log` is told of
    questions whose category belongs to no Spec-Bench subtask (left out)."""
    p = Path(path)
    others: dict[str, int] = {}  # categories of no subtask -> questions
    found: set[str] = set()  # the subtasks the file has questions of
    by_subtask: dict[str, list[Question]] = {s: [] for s in subtasks}
    hint = " (give --questions PATH of Spec-Bench's question.jsonl)"
    seen: dict[int, int] = {}  # question id -> line (results, seeds and identity are keyed by the id)
    for number, row in read_jsonl(p, "questions file", hint):
        where = f"questions file '{p}' line {number}"
        missing = [key for key in ("question_id", "category", "turns") if key not in row]
        if missing:
            raise BadInputError(f"{where}: not a Spec-Bench question (no {', '.join(missing)})")
        qid, category, turns = row["question_id"], row["category"], row["turns"]
        if not isinstance(qid, int) or isinstance(qid, bool):
            raise BadInputError(f"{where}: question_id must be an integer, got {qid!r}")
        if not isinstance(category, str):
            raise BadInputError(f"{where}: category must be a string, got {category!r}")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise BadInputError(f"{where}: turns must be a list of strings, got {turns!r:.80}")
        q = Question(qid, SUBTASK_OF.get(category, ""), category, turns)
        if not q.turns:
            raise BadInputError(f"questions file '{p}' line {number}: question {q.question_id} has no turns")
        if q.question_id in seen:
            raise BadInputError(
                f"questions file '{p}' line {number}: question_id {q.question_id} is also on line "
                f"{seen[q.question_id]} (ids must be unique)"
            )
        seen[q.question_id] = number
        if not q.subtask:
            others[category] = others.get(category, 0) + 1
        found.add(q.subtask)
        if q.subtask in by_subtask and (limit is None or len(by_subtask[q.subtask]) < limit):
            by_subtask[q.subtask].append(q)
    listed = ", ".join(f"'{c}' ({n})" for c, n in sorted(others.items()))
    n = sum(others.values())
    if others and log is not None:
        log(
            f"note: {n} question{'s' if n > 1 else ''} in '{p}' of categories that belong to no Spec-Bench subtask "
            f"left out: {listed} (Spec-Bench's categories: {', '.join(SUBTASK_OF)})"
        )
    empty = [s for s, qs in by_subtask.items() if not qs]
    if empty:
        has = sorted(found - {""})
        raise BadInputError(
            f"questions file '{p}' has no question of subtask '{empty[0]}'; --subtasks chooses which to run"
            + (f" (this file has {', '.join(has)})" if has else "")
        )
    return [q for s in subtasks for q in by_subtask[s]]


def subtasks_in_turn(questions: list[Question]) -> list[Question]:
    """The questions reordered to take the subtasks in turn (first of each, second of each, ...)."""
    by_subtask: dict[str, list[Question]] = {}
    for q in questions:
        by_subtask.setdefault(q.subtask, []).append(q)
    rounds = max((len(qs) for qs in by_subtask.values()), default=0)
    return [qs[i] for i in range(rounds) for qs in by_subtask.values() if i < len(qs)]


# ------------------------------------------------------------------------------------------------ methods


@dataclass
class Output:
    token_ids: list[int]  # new tokens, up to and including the first EOS
    target_forwards: int  # prefill included
    seconds: float  # perf_counter around the call
    stats: dict[str, Any] | None  # specframe's stats (docs/architecture.md "Stats"); None for transformers


@dataclass
class Method:
    name: str
    kind: str  # "specframe" or "transformers"
    description: str
    run: Callable[[list[int], int, int], Output]  # (prompt ids, max new tokens, seed) -> Output
    decoder: Any = None  # specframe's methods: their SpeculativeDecoder


class ForwardCounter:
    """Counts the target's forward calls in transformers' runs (transformers reports none): a pre-hook on the top
    module, there only inside `counting()`. (Left on the shared target, a hook would turn specframe's lean forward
    off in every other method's run: `lean_forward_applies` refuses models with hooks.)"""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls = 0

    def _hook(self, *_: Any) -> None:
        self.calls += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.calls = 0
        handle = self.model.register_forward_pre_hook(self._hook)
        try:
            yield
        finally:
            handle.remove()


def note_graphs_turned_off(methods: list[Method]) -> None:
    """Add to a specframe method's description that its CUDA graphs were turned off while it ran (a failed
    capture for larger buffers, say), which its warning, hidden during the run, would have said."""
    for method in methods:
        status = method.decoder.graphs_status() if method.decoder is not None else ""
        if status.startswith("CUDA graphs off:") and "CUDA graphs off" not in method.description:
            method.description += "; " + status.replace("off:", "off during the run:", 1)


def proposer_and_members(proposer: Any) -> list[Any]:
    """`proposer`, then a union's members (and theirs), in order."""
    return [proposer, *(p for member in getattr(proposer, "members", None) or [] for p in proposer_and_members(member))]


def shape_choices(proposer: Any) -> list[str]:
    """How a proposer (or a union's members) chose its proposal shape on this machine, where it was measured."""
    return [f"{p.name}: {p.shape_choice}" for p in proposer_and_members(proposer) if getattr(p, "shape_choice", None)]


def specframe_method(name: str, decoder: Any, options: BenchOptions, description: str) -> Method:
    def run(ids: list[int], max_new: int, seed: int) -> Output:
        t0 = time.perf_counter()  # around the whole call, as for transformers (stats' wall_time_s is inside it)
        res = decoder.generate(
            ids,
            max_new_tokens=max_new,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            min_p=options.min_p,
            repetition_penalty=options.repetition_penalty,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            ignore_eos=options.ignore_eos,
            seed=seed,
        )
        seconds = time.perf_counter() - t0
        return Output(res.token_ids, res.stats["target_forwards"], seconds, res.stats)

    return Method(name, "specframe", description, run, decoder)


def hf_method(
    name: str,
    model: Any,
    counter: ForwardCounter,
    eos_ids: list[int],
    options: BenchOptions,
    description: str,
    **extra: Any,
) -> Method:
    """transformers `generate` on the shared target, on PyTorch's and transformers' own kernels; `extra` selects
    assisted or prompt-lookup decoding."""
    from transformers import LogitsProcessorList

    from specframe.cpu_kernels import stock_kernels
    from specframe.kv_cache import context_limit
    from specframe.models import neutral_generation_config

    pad = eos_ids[0] if eos_ids else None
    # As specframe's decoder: no token past the target's context window, or the sliding attention window of a target
    # served only inside it, where that is smaller (transformers would go on past either).
    window, kind = context_limit(model)
    # The baselines run from a neutral generation config (a fresh one per call), as specframe's methods do;
    # sampling settings are passed explicitly.

    def run(ids: list[int], max_new: int, seed: int) -> Output:
        if len(ids) >= window:
            raise BadInputError(
                f"the prompt has {len(ids)} tokens; the target's {kind} is {window}, which leaves no room for a "
                "new token"
            )
        max_new = min(max_new, window - len(ids))
        x = torch.tensor([ids], device=model.device)
        ends = None if options.ignore_eos else eos_ids or None  # (no EOS token id: transformers goes on to max_new)
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "eos_token_id": ends, "pad_token_id": pad}
        if options.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = options.repetition_penalty
        if options.presence_penalty or options.frequency_penalty:  # (transformers has neither)
            penalties = OutputPenalties(len(ids), options.presence_penalty, options.frequency_penalty)
            kwargs["logits_processor"] = LogitsProcessorList([penalties])
        if options.greedy:
            kwargs["do_sample"] = False
        else:
            # The transform of specframe's T: temperature, top-k (0 = off), top-p (at a top-p cut inside a run of
            # tied logits the two may keep different tokens of equal mass: specframe.sampling), min-p (0 = off).
            kwargs.update(do_sample=True, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p)
            if options.min_p:
                kwargs["min_p"] = options.min_p
            torch.manual_seed(seed)
        assistant = extra.get("assistant_model")  # (on the stock kernels too, as a transformers user runs it)
        assistant_kernels = stock_kernels(assistant) if assistant is not None else contextlib.nullcontext()
        with neutral_generation_config(model), stock_kernels(model), assistant_kernels, counter.counting():
            t0 = time.perf_counter()
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kwargs, **extra)
            seconds = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        return Output(new if options.ignore_eos else cut_at_eos(new, eos_ids), counter.calls, seconds, None)

    return Method(name, "transformers", description, run)


class OutputPenalties:
    """vLLM's presence and frequency penalties as a transformers logits processor (transformers has neither),
    for the baselines: each token the output (the ids after the first `prompt_length`) holds loses
    `presence` from its logit, and `frequency` times its count, as specframe.sampling.apply_penalties takes
    them (after the repetition penalty, before the temperature: transformers runs a given processor after its
    own penalties and before its warpers)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length = prompt_length
        self.params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        unseen = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)  # (no repetition penalty)
        return apply_penalties(scores, unseen, counts, self.params)


def cut_at_eos(ids: list[int], eos_ids: Iterable[int]) -> list[int]:
    eos = set(eos_ids)
    at = next((i for i, t in enumerate(ids) if t in eos), None)
    return ids if at is None else ids[: at + 1]


def hf_assistant(draft: Any, target_vocab: int) -> tuple[torch.nn.Module, int]:
    """The `draft` proposer's model as transformers wants an assistant, with its own generation config; and γ."""
    from specframe.shared_draft import as_full_vocab_model

    gamma = int(draft.gamma)
    vocab_ids = getattr(draft, "vocab_ids", None)
    if vocab_ids is not None:  # a reduced-vocabulary shared draft: give it the target's full vocabulary
        assistant = as_full_vocab_model(draft.model, vocab_ids, target_vocab)
    else:
        # A shallow copy shares the weights; only the generation config, which transformers reads and
        # mutates, must be this copy's own so the proposer's model is left untouched.
        assistant = copy.copy(draft.model)
    cfg = copy.deepcopy(assistant.generation_config)
    cfg.num_assistant_tokens = gamma
    cfg.num_assistant_tokens_schedule = "constant"
    # transformers stops drafting early below this confidence by default; 0 makes it draft exactly γ tokens
    # per step, as specframe's `draft` does, so the two differ only in their engines and kernels (transformers'
    # run on its stock kernels; `target.fast_cpu_kernels=false` puts specframe's there too, docs/results-stock.md).
    cfg.assistant_confidence_threshold = 0.0
    assistant.generation_config = cfg
    return assistant, gamma


@dataclass
class Setup:
    """Everything built once, before the timed loop."""

    model: Any
    tokenizer: Any
    encoder: Any  # a SpeculativeDecoder whose `encode` turns a conversation into the ids every method gets
    methods: list[Method]
    skipped: dict[str, str]  # method -> why it is not run
    target: str
    dtype: str
    device: str
    adapter: str = ""  # target.adapter, merged into the target (also said in the report)


def build(options: BenchOptions, log: Callable[[str], None]) -> Setup:
    """Load the target once and build every method on it; methods with nothing trained for this target are skipped
    with a reason (one whose `model` option names an artifact that cannot load ends the run)."""
    from specframe.architectures import eos_token_ids
    from specframe.config import load_config, models_named
    from specframe.decoder import SpeculativeDecoder, proposer_who, target_info
    from specframe.errors import ModelLoadError
    from specframe.models import load_target
    from specframe.plugins import get_registry
    from specframe.proposer import built_proposer

    shared, own = split_overrides(options.overrides, options.override_heads())
    shared = shared + options.target_overrides()
    cfg = load_config(overrides=["proposer.name=none", *shared])
    registry = get_registry()

    def proposer_config(name: str) -> Any:
        # Not caught below: a bad override (unknown key, wrong type) is the user's to fix and ends the run.
        try:
            return load_config(overrides=[f"proposer.name={name}", *shared, *own.get(name, [])]).proposer
        except BadInputError as e:
            raise type(e)(bench_keys(name, brief(e))) from e

    # Before the target loads, so a typo fails in a second.
    configs = {name: proposer_config(name) for name in options.override_heads() if name in registry.proposers}
    t = cfg.target
    loaded = load_target(t)
    model, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise ModelLoadError(f"target '{t.model}' has no tokenizer: the benchmark's questions are text")
    info = target_info(model, tokenizer, name=t.model)
    eos_ids = sorted(eos_token_ids(model, tokenizer))

    def proposer(name: str) -> Any:
        """Build proposer `name` on the shared target; raises BadInputError when it cannot be built for it."""
        entry = registry.get(name)
        built = entry.cls.from_config(configs[name] if name in configs else proposer_config(name), info)
        return built_proposer(built, proposer_who(entry.name, entry.plugin), "from_config")

    def cannot_build(name: str, e: BadInputError) -> str:
        """Why `name` is skipped: nothing trained for this target. An artifact the user named (a `model`
        option, a union member's included) that cannot be built ends the run instead."""
        if models_named(configs[name] if name in configs else proposer_config(name)):
            raise type(e)(f"{name}: {bench_keys(name, brief(e))}") from e
        return bench_keys(name, brief(e))

    skipped: dict[str, str] = {}
    methods: list[Method] = []
    built: dict[str, Any] = {}
    for name in options.proposers:  # (all installed: `validate` refused any other name)
        try:
            built[name] = proposer(name)
        except BadInputError as e:  # no trained artifact for this target, or one that does not fit it
            skipped[name] = cannot_build(name, e)
            continue
        entry = registry.get(name)
        decoder = SpeculativeDecoder(
            model, built[name], tokenizer=tokenizer, plugin=entry.plugin, cuda_graphs=t.cuda_graphs
        )
        about = f"specframe proposer '{name}' (plugin {entry.plugin}, {entry.distribution} {entry.version})"
        about += "".join(f"; {how}" for how in shape_choices(built[name]))
        graphs = decoder.graphs_status()  # (the warning that says it is hidden under the progress bar)
        about += f"; {graphs}" if graphs else ""
        methods.append(specframe_method(name, decoder, options, about))
    encoder = SpeculativeDecoder(model, built.get("none") or proposer("none"), tokenizer=tokenizer, cuda_graphs=False)

    counter = ForwardCounter(model)

    def baseline(name: str, description: str, **extra: Any) -> Method:
        return hf_method(name, model, counter, eos_ids, options, description, **extra)

    for name in options.baselines:
        if name == "hf":
            methods.append(baseline(name, "transformers generate (plain)"))
        elif name == "hf-pld":
            about = (
                f"transformers prompt-lookup decoding, prompt_lookup_num_tokens={options.pld_tokens}, "
                "default max_matching_ngram_size"
            )
            methods.append(baseline(name, about, prompt_lookup_num_tokens=options.pld_tokens))
        elif name == "hf-assisted":
            draft = built.get("draft")
            if draft is None and "draft" in skipped:
                skipped[name] = f"no draft model: {skipped['draft']}"
                continue
            if draft is None:
                try:
                    draft = proposer("draft")
                except BadInputError as e:
                    skipped[name] = f"no draft model: {cannot_build('draft', e)}"
                    continue
            assistant, gamma = hf_assistant(draft, info.vocab_size)
            about = (
                "transformers assisted generation with the `draft` proposer's draft, "
                f"num_assistant_tokens={gamma} (constant schedule, confidence threshold 0)"
            )
            methods.append(baseline(name, about, assistant_model=assistant))
    if not methods:
        raise BadInputError(
            "nothing to run: every method was skipped (" + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ")"
        )
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    if not getattr(tokenizer, "chat_template", None):
        log("the target's tokenizer has no chat template: each conversation is given as its turns' texts, one a line")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    device = str(info.device)
    return Setup(model, tokenizer, encoder, methods, skipped, t.model, dtype, device, t.adapter or "")


# ------------------------------------------------------------------------------------------------ identity


def first_difference(reference: list[int], output: list[int]) -> int | None:
    """Index of the first position where the two token lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(reference, output, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


@torch.no_grad()
def top2_logits(
    model: torch.nn.Module, context: list[int], prompt_length: int = 0, penalties: SamplingParams | None = None
) -> tuple[tuple[int, float], tuple[int, float]]:
    """The target's two largest next-token logits after `context`: one from-scratch forward (no cache), float32;
    with `penalties` (a SamplingParams whose penalties are on), penalised as greedy decoding chooses on them, the
    first `prompt_length` tokens of `context` being the prompt."""
    x = torch.tensor([context], device=next(model.parameters()).device)
    logits = model(input_ids=x, use_cache=False).logits[0, -1].float()
    if penalties is not None and penalties.penalised:
        history = History(x[0, :prompt_length], logits.shape[-1], x[0, prompt_length:])
        logits = history.penalised(logits, penalties)
    values, ids = logits.topk(2)
    return (int(ids[0]), float(values[0])), (int(ids[1]), float(values[1]))


def is_near_tie(top1: float, top2: float, threshold: float) -> bool:
    """Near-tie: the top-2 gap is within `threshold` of the top logit's magnitude (at least 1, for logits near 0)."""
    return top1 - top2 <= threshold * max(1.0, abs(top1))


def explain_difference(
    model32: torch.nn.Module,
    prompt: list[int],
    reference: list[int],
    output: list[int],
    at: int,
    threshold: float,
    penalties: SamplingParams | None = None,
) -> dict[str, Any]:
    """Why `output` leaves `reference` at position `at`: the float32 top-2 of the target there (penalised with
    `penalties`' penalties, where on)."""
    (t1, l1), (t2, l2) = top2_logits(model32, prompt + reference[:at], len(prompt), penalties)
    return {
        "position": at,
        "reference_token": reference[at] if at < len(reference) else None,
        "method_token": output[at] if at < len(output) else None,
        "top1": {"token": t1, "logit": l1},
        "top2": {"token": t2, "logit": l2},
        "gap": l1 - l2,
        "relative_gap": (l1 - l2) / max(1.0, abs(l1)),
        "near_tie": is_near_tie(l1, l2, threshold),
    }


# ------------------------------------------------------------------------------------------------ the run


def run_bench(options: BenchOptions, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and write its outputs; returns the JSON document (also in `<out>/bench.json`)."""
    from tqdm import tqdm

    log = log or (lambda msg: print(f"specframe bench: {msg}", file=sys.stderr, flush=True))
    options.validate()
    if not plots_possible():  # (said before the run, not found after it)
        log(f"note: {NO_PLOTS}")
    defaults = (("--top-p", options.top_p == 1.0), ("--top-k", options.top_k == 0), ("--min-p", options.min_p == 0.0))
    unused = [flag for flag, off in defaults if not off]
    note = greedy_note(unused) if options.greedy else None
    if note:  # (as generate says it: greedy draws nothing)
        log(f"note: {note}")
    questions_path = (Path(options.questions) if options.questions else default_questions_path()).resolve()
    questions = read_questions(questions_path, options.subtasks, options.limit, log)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    threads = torch.get_num_threads()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    made: list[dict[str, Any]] = []  # (filled as the run goes: kept when it stops early)
    failed: dict[str, str] = {}  # (the methods dropped as it goes, their records removed from `made`)
    # An error or Ctrl-C after questions were timed (in the timed loop, the identity check's float32 copy of the
    # target, writing the report): their records are kept.
    try:
        try:
            with warnings.catch_warnings(), quiet_transformers():
                warnings.simplefilter("ignore")  # transformers' per-call advice would bury the progress bar
                setup = build(options, log)
                tie = tie_threshold(setup.model, options)
                records, _, ran = timed_loop(setup, questions, options, log, tqdm, made, failed)
                note_graphs_turned_off(setup.methods)
                cut = cut_by_context_window(records, setup.encoder.context_window, options.max_new_tokens)
                if cut:
                    log(
                        f"note: {cut} of {len(records)} turns stopped at the target's context window before "
                        f"--max-new-tokens {options.max_new_tokens} (tokens/s count the tokens made)"
                    )
                if options.greedy and any(m.name == REFERENCE for m in setup.methods) and REFERENCE not in failed:
                    check_identity(records, setup, tie, options.penalties)
            run_threads = torch.get_num_threads()
        finally:
            torch.set_num_threads(threads)
        load_end = os.getloadavg()
        for r in records:  # prompts are long and re-made from the questions; the JSON keeps their length only
            del r["prompt_ids"]
        skipped = {**setup.skipped, **failed}
        methods = [m for m in setup.methods if m.name not in failed]
        doc = {
            "format": FORMAT,
            "version": 1,
            "command": options.command(),
            "date": started.isoformat(timespec="seconds"),
            "duration_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
            "machine": machine_info(setup.device),
            "loadavg_start": list(load_start),
            "loadavg_end": list(load_end),
            "settings": {
                **{k: v for k, v in asdict(options).items() if k not in ("progress", "threads")},
                "questions": str(questions_path),
                "target": setup.target,
                "adapter": setup.adapter,
                "dtype": setup.dtype,
                "device": setup.device,
                "greedy": options.greedy,
                "torch_threads": run_threads,
                "questions_run": {s: sum(q.subtask == s for q in ran) for s in options.subtasks},
                "questions_planned": len(questions),
            },
            "methods": {m.name: {"kind": m.kind, "description": m.description} for m in methods},
            "skipped": skipped,
            "definitions": DEFINITIONS
            | {
                "near_tie": f"top-1 minus top-2 logit <= {tie:g} x max(1, |top-1 logit|), float32 from-scratch "
                "forward"
                + (" (a 16-bit target's dtype eps, above --tie-threshold)" if tie > options.tie_threshold else "")
            },
            "summary": summarize(records, [m.name for m in methods], options.subtasks),
            "turns_cut_by_context_window": cut,
            "records": records,
        }
        # (an earlier, stopped run's records: this run's report replaces them; `render` leaves them)
        (Path(options.out) / PARTIAL).unlink(missing_ok=True)
        write_outputs(doc, Path(options.out), options.results_doc)
    except BaseException:
        if made:
            log(f"stopped early: the {len(made)} records made so far are in {save_partial(made, failed, options)}")
            earlier = Path(options.out) / "bench.json"
            if earlier.is_file():  # (it would read as this run's report; write_outputs writes it last)
                log(f"note: {earlier} beside it is an earlier run's report, not this run's")
        raise
    return doc


PLOT_FILES = ("speedup.png", "accepted_lengths.png")
REPORT_FILES = ("bench.json", "bench.md", *PLOT_FILES)  # what a run writes in --out
NO_PLOTS = "matplotlib is not installed, so the report will have no plots (pip install 'specframe[bench]' for them)"


def plots_possible() -> bool:
    """Whether matplotlib (the `bench` extra) is installed; without it a report is written without plots."""
    return importlib.util.find_spec("matplotlib") is not None


def bench_keys(name: str, message: str) -> str:
    """`message` with proposer `name`'s config keys as bench takes them: `<name>.<key>`, not `proposer.<key>`
    as in generate."""
    message = re.sub(r"(?<![\w.])proposer(?=[.:])", name, message)
    if "Key 'proposer' not in" in message:  # (`union.proposer.members=...`: the generate spelling, prefixed)
        message += (
            f" (bench takes a proposer's keys as {name}.<key>, e.g. {name}.<key>=VALUE, not {name}.proposer.<key>)"
        )
    return message


PARTIAL = "bench.partial.json"  # the records of a run that stopped early, in --out


def save_partial(records: list[dict[str, Any]], failed: dict[str, str], options: BenchOptions) -> Path:
    """Write the records of a run that stopped before its report (an error, Ctrl-C) to `<out>/bench.partial.json`
    (per-turn records as in bench.json, prompts by their length, none of the `failed` methods, which are named
    with why; no report is made from them)."""
    path = Path(options.out) / PARTIAL
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = [{k: v for k, v in r.items() if k != "prompt_ids"} for r in records]
    doc = {"command": options.command(), "partial": True, "failed": failed, "records": kept}
    path.write_text(json.dumps(doc, indent=1))
    return path


def check_report_paths(out: str | Path, results_doc: str | None) -> None:
    """Refuse (BadInputError) a report folder or results page that cannot be written, or a results page that
    would overwrite one of the report's own files, before any work."""
    if not str(out).strip():
        raise BadInputError("--out must name a folder (it would write the report into the current one)")
    check_output_path(out, "--out", folder=True)
    if results_doc:
        if Path(results_doc).resolve() == Path(out).resolve():  # (a folder the run is about to make)
            raise BadInputError(f"--results-doc '{results_doc}' is the --out folder: name a Markdown file")
        check_output_path(results_doc, "--results-doc", folder=False)
        own = {(Path(out) / name).resolve() for name in REPORT_FILES}
        if Path(results_doc).resolve() in own:
            raise BadInputError(
                f"--results-doc '{results_doc}' is one of the report's own files in --out '{out}': name another file"
            )


def render(path: str | Path, out: str | Path | None = None, results_doc: str | None = None) -> dict[str, Any]:
    """Re-make the summary, Markdown and plots of an earlier run from its bench.json (no generation).

    The numbers are recomputed from the stored per-turn records, so a report change needs no new run; the page
    still names the command that produced the records."""
    p = Path(path)
    out = p.parent if out is None else out
    check_report_paths(out, results_doc)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # (not JSON, not UTF-8, nested too deeply)
        raise BadInputError(f"cannot read bench results '{p}': {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BadInputError(f"'{p}' is not a specframe bench.json")
    try:
        doc["definitions"] = DEFINITIONS | {"near_tie": doc["definitions"]["near_tie"]}
        doc["summary"] = summarize(doc["records"], list(doc["methods"]), doc["settings"]["subtasks"])
        results_page(doc)  # (everything the pages read, checked before anything is written)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise BadInputError(f"'{p}' is an incomplete or damaged bench.json ({type(e).__name__}: {e})") from e
    if not plots_possible():
        print(f"specframe bench: note: {NO_PLOTS}", file=sys.stderr)
    write_outputs(doc, Path(out), results_doc)
    return doc


DEFINITIONS = {
    "mean_accepted_length": "total new tokens / total target forwards (prefill included) over every turn of the "
    "subtask (pooled, not a mean of per-turn ratios); plain decoding scores 1.00",
    "tokens_per_s": "mean over questions of (new tokens of all its turns / seconds of all its turns), Spec-Bench's",
    "speedup": "tokens/s of the method / tokens/s of the baseline (hf or none) on the same questions, same run",
    "speedup_vs_none_interval": "in parentheses after a speedup vs none: a 90% interval of it from resampling the "
    "questions with replacement (2,000 draws, paired: a question drawn counts for both methods): how much the "
    "ratio depends on which questions ran, the machine's load changing during the run included",
    "kernels": "transformers' methods (hf, hf-assisted, hf-pld) run on PyTorch's and transformers' own kernels, as "
    "a transformers user gets them; specframe's methods on its CPU kernels when target.fast_cpu_kernels "
    "is on (specframe/cpu_kernels.py) and, for a Llama target, on its lean forward (specframe/lean_forward.py, "
    "the same results, with the q/k/v and gate/up products fused on the CPU kernels), so speedup vs none is "
    "the gain of speculation alone and speedup vs hf also "
    "counts the faster kernels and forward",
    "acceptance_rate": "accepted draft tokens / proposed draft tokens (tree: / depth proposed), pooled",
    "acceptance_by_position": "[d] = verification steps that accepted a token at draft depth d+1 / steps that "
    "proposed one there (not conditional on depth d being accepted, so it falls with "
    "depth even when every draft is accepted with the same probability)",
    "accepted_length_histogram": "[k] = verification steps (prefill excluded) that accepted k drafts, emitting "
    "k+1 tokens (k drafts + the target's token; k tokens in a turn's last step that an EOS or a stop string cut "
    "among its drafts)",
    "alpha": "per-token acceptance probability, estimated as accepted / (accepted + rejections); a step that "
    "accepted fewer drafts than the deepest depth proposed counts one rejection (so a whole shorter "
    "draft near the token budget, or a turn's last step cut by an EOS or a stop string among its drafts, counts "
    "as a rejection: a slight underestimate); only for chains of one depth "
    "(at most gamma + 1 steps a turn drafting fewer, near its token budget): of others the prediction is not made",
    "predicted_speedup": "Leviathan et al.: E[tokens/step] = (1 - alpha^(gamma+1)) / (1 - alpha); speedup = "
    "E[tokens/step] x plain step cost / (gamma x draft cost per token + verify cost per "
    "step); costs from the stats' propose_time_s / proposed_tokens and verify_time_s / steps, "
    "the plain step from `none` (propose + verify time per step). A consistency check of the model against this "
    "run's own alpha and costs, not an independent prediction: the measured decode-loop speedup comes from the "
    "same times, so for gamma 1 the two agree by construction. A draft model's cost per token includes its own "
    "prompt prefill (its first proposal of each turn feeds the prompt); the target's prefill is in neither cost",
    "identical": "greedy only: the turn's tokens equal hf's for the same conversation; a turn after an earlier "
    "difference has another context and is not compared",
}


def conversation_ids(encoder: Any, turns: list[str], answers: list[str]) -> list[int]:
    """Ids of the conversation so far (user turns with the method's own answers between), generation prompt on;
    for a tokenizer without a chat template (a base model), its texts one a line."""
    messages: list[dict[str, str]] = []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    if not getattr(encoder.tokenizer, "chat_template", None):
        return encoder.encode("\n".join(m["content"] for m in messages), raw=True).tolist()
    return encoder.encode(messages).tolist()


def longest_conversation(encoder: Any, questions: list[Question], max_new_tokens: int) -> int:
    """The most positions a conversation of `questions` may fill: its last turn's prompt, with each earlier
    answer as an empty one in the chat template plus `max_new_tokens` (an estimate: the answer's text encoded
    again may differ by a few tokens), and its own answer. Questions over the context window are left out
    (said when they run)."""
    longest = 0
    for q in questions:
        earlier = len(q.turns) - 1
        try:
            context = len(conversation_ids(encoder, q.turns, [""] * earlier))
        except BadInputError:
            continue
        longest = max(longest, context + (earlier + 1) * max_new_tokens)
    return longest


def reserve_graph_buffers(
    methods: list[Method], encoder: Any, questions: list[Question], max_new_tokens: int, log: Callable[[str], None]
) -> None:
    """Make each CUDA-graphed method's static buffers (`specframe.cuda_graphs`) long enough for the longest
    conversation the run may hold (`longest_conversation`, at most the target's context window), their graphs
    captured now rather than inside the timed run whose prompt first outgrows them. One that outgrows the
    estimate still works, its new buffers made in its timed run; one whose buffers cannot be made now (out of
    memory, say) is left to make them as it runs, as without this."""
    graphed = [m for m in methods if getattr(m.decoder, "graphs", None) is not None]
    longest = longest_conversation(encoder, questions, max_new_tokens) if graphed else 0
    for m in graphed:
        try:
            m.decoder.graphs.new_cache(min(longest, m.decoder.context_window))
        except Exception as e:
            log(f"note: {m.name}'s CUDA-graph buffers are made as it runs: {brief(e, typed=True)}")


def timed_loop(
    setup: Setup,
    questions: list[Question],
    options: BenchOptions,
    log: Callable[[str], None],
    tqdm: Any,
    records: list[dict[str, Any]] | None = None,
    failed: dict[str, str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str], list[Question]]:
    """Warm up every method, then run question by question, every method on each (order rotated per question),
    until the questions or `options.time_limit_s` run out. Returns the records (also kept in `records` as they
    are made, when given; a method that fails has its records removed, as the report leaves them out), the failed
    methods (also in `failed`, when given) and the questions that ran."""
    methods = list(setup.methods)
    failed = {} if failed is None else failed
    first_turn_ids: dict[int, list[int]] = {}  # (the same for every method)
    for q in questions:  # a first turn longer than the context window: said now, not after the ones before it ran
        try:
            first_turn_ids[q.question_id] = conversation_ids(setup.encoder, q.turns[:1], [])
        except BadInputError as e:
            window = " (leave it out of --questions, or give a target with a longer one)" if "window" in str(e) else ""
            raise BadInputError(f"question {q.question_id} ({q.subtask}): {e}{window}") from e
    try:
        warm = setup.encoder.encode(WARMUP_PROMPT).tolist()
    except BadInputError as e:  # (a target with a very short context window: not about the user's prompts)
        raise BadInputError(f"the benchmark's warm-up prompt {WARMUP_PROMPT!r}: {e}") from e
    for m in list(methods):
        try:
            m.run(warm, min(WARMUP_TOKENS, options.max_new_tokens), options.seed)
        except Exception as e:  # a baseline transformers refuses, or a broken plugin: report, keep the rest
            failed[m.name] = f"failed in warm-up: {type(e).__name__}: {' '.join(str(e).split())}"
            log(f"dropping {m.name}: {failed[m.name]}")
            methods.remove(m)
    reserve_graph_buffers(methods, setup.encoder, questions, options.max_new_tokens, log)
    records = [] if records is None else records
    total = sum(len(q.turns) for q in questions) * len(methods)
    bar = tqdm(total=total, unit="gen", desc="bench", disable=not options.progress, file=sys.stderr, dynamic_ncols=True)
    if options.time_limit_s is not None:
        questions = subtasks_in_turn(questions)
    ran: list[Question] = []
    started = time.perf_counter()
    with bar, torch.inference_mode():
        for qi, q in enumerate(questions):
            if ran and options.time_limit_s is not None:  # (the first question always runs)
                # A question starts only if it is expected to end within the limit: its turns at the mean time
                # per turn so far (a limit checked only before each question let the last one overrun it by
                # a whole question: all methods, every turn).
                elapsed = time.perf_counter() - started
                expected_end = elapsed * (1 + len(q.turns) / sum(len(r.turns) for r in ran))
                if expected_end > options.time_limit_s:
                    log(
                        f"time limit of {options.time_limit_s:g} s: stopped after {qi} of {len(questions)} "
                        f"questions ({elapsed:.3g} s timed; the next would end at about {expected_end:.3g} s)"
                    )
                    break
            ran.append(q)
            k = qi % len(methods) if methods else 0
            for m in methods[k:] + methods[:k]:  # rotate so drift over the run hits every method alike
                if m.name in failed:
                    continue
                bar.set_postfix_str(f"{q.subtask} q{q.question_id} {m.name}")
                answers: list[str] = []
                try:
                    for turn in range(len(q.turns)):
                        ids = (
                            list(first_turn_ids[q.question_id])  # (a copy per method)
                            if turn == 0
                            else conversation_ids(setup.encoder, q.turns[: turn + 1], answers)
                        )
                        out = m.run(ids, options.max_new_tokens, options.seed + 10 * q.question_id + turn)
                        answers.append(setup.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip())
                        records.append(record(m, q, turn, ids, out))
                        bar.update(1)
                except BadInputError as e:  # e.g. a later turn longer than the context window: the user's to fix
                    raise BadInputError(f"question {q.question_id} turn {turn + 1}, {m.name}: {e}") from e
                except Exception as e:
                    failed[m.name] = (
                        f"failed on question {q.question_id}: {type(e).__name__}: {' '.join(str(e).split())}"
                    )
                    records[:] = [r for r in records if r["method"] != m.name]
                    log(f"dropping {m.name}: {failed[m.name]}")
    if failed and not records:  # (not an empty report that exits 0)
        raise RuntimeError("every method failed: " + "; ".join(f"{name} {why}" for name, why in failed.items()))
    return records, failed, ran


def record(m: Method, q: Question, turn: int, prompt: list[int], out: Output) -> dict[str, Any]:
    stats = out.stats
    if stats is not None:
        stats = {k: v for k, v in stats.items() if k not in ("new_tokens", "target_forwards")}
    return {
        "method": m.name,
        "question_id": q.question_id,
        "subtask": q.subtask,
        "category": q.category,
        "turn": turn,
        "prompt_ids": prompt,
        "prompt_tokens": len(prompt),
        "token_ids": out.token_ids,
        "new_tokens": len(out.token_ids),
        "target_forwards": out.target_forwards,
        "seconds": out.seconds,
        "stats": stats,
        "identical": None,
        "context_differs": None,
        "difference": None,
    }


def cut_by_context_window(records: list[dict[str, Any]], window: int, max_new_tokens: int) -> int:
    """How many turns stopped short of `max_new_tokens` because prompt and answer filled the context `window`."""
    return sum(r["prompt_tokens"] + r["new_tokens"] >= window and r["new_tokens"] < max_new_tokens for r in records)


def tie_threshold(model: torch.nn.Module, options: BenchOptions) -> float:
    """The near-tie threshold for this target: --tie-threshold, but for a 16-bit target at least its dtype's eps
    (its forwards then round each logit to about eps x its magnitude, and two forwards that batch the same
    tokens differently, as a verification and transformers' one-token steps do, round differently). One eps,
    not the conformance suite's 8 (`rounding_tolerance`, sized for drift over many steps on tiny targets): a
    first difference is then called a near-tie only where a single rounding can explain it."""
    dtype = next(model.parameters()).dtype
    return max(options.tie_threshold, torch.finfo(dtype).eps) if torch.finfo(dtype).bits < 32 else options.tie_threshold


def check_identity(
    records: list[dict[str, Any]], setup: Setup, threshold: float, penalties: SamplingParams | None = None
) -> None:
    """Mark each record identical or not to hf's turn; explain every first difference by the target's top-2
    (a near-tie within `threshold`, `tie_threshold`; penalised with `penalties`, where on)."""
    model32 = None
    ref = {(r["question_id"], r["turn"]): r for r in records if r["method"] == REFERENCE}
    by_conversation: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        if r["method"] != REFERENCE:
            by_conversation.setdefault((r["method"], r["question_id"]), []).append(r)
    for turns in by_conversation.values():
        for r in turns:
            base = ref.get((r["question_id"], r["turn"]))
            if base is None:
                continue
            if r["prompt_ids"] != base["prompt_ids"]:
                r["context_differs"] = True  # an earlier answer differed: this turn answers another conversation
                continue
            r["context_differs"] = False
            at = first_difference(base["token_ids"], r["token_ids"])
            r["identical"] = at is None
            if at is not None:
                if model32 is None:
                    model32 = float32_copy(setup.model)
                r["difference"] = explain_difference(
                    model32, r["prompt_ids"], base["token_ids"], r["token_ids"], at, threshold, penalties
                )


def float32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The target in float32 (itself when it already is) for the tie check's from-scratch forward."""
    if next(model.parameters()).dtype == torch.float32:
        return model
    return copy.deepcopy(model).float()


# ------------------------------------------------------------------------------------------------ aggregation


def mean_accepted_length(records: list[dict[str, Any]]) -> float | None:
    """Total new tokens / total target forwards (docs/architecture.md "Stats"), pooled over the records."""
    forwards = sum(r["target_forwards"] for r in records)
    return sum(r["new_tokens"] for r in records) / forwards if forwards else None


def question_speeds(records: list[dict[str, Any]]) -> dict[int, float]:
    """Per question: all its turns' tokens over all their seconds (questions timed at 0 s left out)."""
    per_q: dict[int, list[float]] = {}
    for r in records:
        acc = per_q.setdefault(r["question_id"], [0.0, 0.0])
        acc[0] += r["new_tokens"]
        acc[1] += r["seconds"]
    return {q: tokens / seconds for q, (tokens, seconds) in per_q.items() if seconds > 0}


def tokens_per_second(records: list[dict[str, Any]]) -> float | None:
    """Spec-Bench's speed: the mean over questions of `question_speeds`."""
    speeds = list(question_speeds(records).values())
    return statistics.mean(speeds) if speeds else None


def speedup_interval(
    records: list[dict[str, Any]], method: str, baseline: str, draws: int = 2000
) -> list[float] | None:
    """A 90% interval of the speedup of `method` over `baseline` (their `tokens_per_second` ratio), from
    resampling the questions both ran with replacement (paired: a question drawn counts for both); None with
    fewer than 3 such questions. Seeded: the same records give the same interval."""
    rates = {m: question_speeds([r for r in records if r["method"] == m]) for m in (method, baseline)}
    both = sorted(set(rates[method]) & set(rates[baseline]))
    if len(both) < 3:
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        drawn = [rng.choice(both) for _ in both]
        ratios.append(sum(rates[method][q] for q in drawn) / sum(rates[baseline][q] for q in drawn))
    ratios.sort()
    return [ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]]


def add_lists(a: list[int], b: list[int]) -> list[int]:
    """Elementwise sum of two count lists of different lengths (missing entries count 0)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def pooled_stats(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Sums of specframe's counters over the records; None when none of them carries stats (transformers)."""
    with_stats = [r for r in records if r["stats"] is not None]
    if not with_stats:
        return None
    pooled: dict[str, Any] = {
        "proposed_tokens": 0,
        "accepted_tokens": 0,
        "proposed_nodes": 0,
        "propose_time_s": 0.0,
        "verify_time_s": 0.0,
        "steps": 0,
        "decode_tokens": 0,
        "turns": len(with_stats),
        "proposed_by_position": [],
        "accepted_by_position": [],
    }
    for r in with_stats:
        s = r["stats"]
        for key in ("proposed_tokens", "accepted_tokens", "proposed_nodes", "propose_time_s", "verify_time_s"):
            pooled[key] += s.get(key) or 0
        pooled["steps"] += r["target_forwards"] - 1  # verification steps: every forward after the prefill
        pooled["decode_tokens"] += r["new_tokens"] - 1  # the prefill emits the first token
        for key in ("proposed_by_position", "accepted_by_position"):
            pooled[key] = add_lists(pooled[key], s.get(key) or [])
    return pooled


def acceptance_by_position(proposed: list[int], accepted: list[int]) -> list[float | None]:
    """[d] = accepted[d] / proposed[d]: how often a draft at depth d+1 was accepted when one was proposed there."""
    return [(accepted[d] if d < len(accepted) else 0) / p if p else None for d, p in enumerate(proposed)]


def accepted_length_histogram(steps: int, accepted_by_position: list[int]) -> list[int]:
    """[k] = steps that accepted exactly k drafts, from [d] = steps that accepted >= d+1."""
    at_least = [steps, *accepted_by_position, 0]
    return [at_least[k] - at_least[k + 1] for k in range(len(accepted_by_position) + 1)]


def estimate_alpha(
    accepted_tokens: int, proposed_by_position: list[int], accepted_by_position: list[int]
) -> float | None:
    """Per-token acceptance probability of a chain, accepted / (accepted + rejections) (see DEFINITIONS)."""
    if not proposed_by_position or not proposed_by_position[0]:
        return None
    gamma = len(proposed_by_position)
    whole = accepted_by_position[gamma - 1] if len(accepted_by_position) >= gamma else 0
    rejections = proposed_by_position[0] - whole
    tried = accepted_tokens + rejections
    return accepted_tokens / tried if tried else None


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al. eq. 1: tokens per step of a γ-token chain accepted i.i.d. with probability α."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost: float, plain_cost: float) -> float:
    """Expected tokens per step over one step's cost (γ draft tokens + one verification), in plain steps."""
    return expected_tokens_per_step(alpha, gamma) * plain_cost / (gamma * draft_cost + verify_cost)


def prediction(pooled: dict[str, Any] | None, plain: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Leviathan et al. prediction for a chain proposer, beside what was measured; None where it does not apply."""
    if pooled is None or not pooled["proposed_tokens"] or not pooled["steps"]:
        return None
    if pooled["proposed_nodes"] != pooled["proposed_tokens"]:
        return {"applies": False, "why": "tree proposals: the chain formula does not apply"}
    if plain is None or not plain["steps"]:
        return {"applies": False, "why": f"needs `{ENGINE_BASELINE}` in the run for the plain step's cost"}
    gamma = len(pooled["proposed_by_position"])
    # The formula is for γ drafts every step. Near each turn's token budget up to γ steps draft fewer, and one
    # none; more than that, and the chain's depth varied (a confidence threshold, a lookup that found less).
    shorter = pooled["steps"] - pooled["proposed_by_position"][-1]
    if shorter > (gamma + 1) * pooled.get("turns", 1):
        return {
            "applies": False,
            "why": f"the chain's depth varied: {shorter} of {pooled['steps']} steps drafted fewer than its "
            f"deepest {gamma} (the formula is for {gamma} every step)",
        }
    alpha = estimate_alpha(pooled["accepted_tokens"], pooled["proposed_by_position"], pooled["accepted_by_position"])
    draft_cost = pooled["propose_time_s"] / pooled["proposed_tokens"]
    verify_cost = pooled["verify_time_s"] / pooled["steps"]
    plain_cost = (plain["propose_time_s"] + plain["verify_time_s"]) / plain["steps"]
    loop_time = pooled["propose_time_s"] + pooled["verify_time_s"]
    plain_loop = plain["propose_time_s"] + plain["verify_time_s"]
    return {
        "applies": True,
        "gamma": gamma,
        "alpha": alpha,
        "expected_tokens_per_step": expected_tokens_per_step(alpha, gamma),
        "measured_tokens_per_step": pooled["decode_tokens"] / pooled["steps"],
        "draft_cost_per_token_s": draft_cost,
        "verify_cost_per_step_s": verify_cost,
        "plain_step_s": plain_cost,
        "predicted_speedup": predicted_speedup(alpha, gamma, draft_cost, verify_cost, plain_cost),
        # The formula models the decode loop only; this is the same loop measured (prefill and overhead excluded).
        "measured_loop_speedup": (pooled["decode_tokens"] / loop_time) / (plain["decode_tokens"] / plain_loop)
        if loop_time > 0 and plain_loop > 0 and plain["decode_tokens"]
        else None,
    }


def identity_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    compared = [r for r in records if r["identical"] is not None]
    if not compared:
        return None
    differ = [r for r in compared if not r["identical"]]
    return {
        "compared": len(compared),
        "identical": len(compared) - len(differ),
        "differ": len(differ),
        "differ_at_near_tie": sum(bool(r["difference"] and r["difference"]["near_tie"]) for r in differ),
        "differ_not_tie": sum(not (r["difference"] and r["difference"]["near_tie"]) for r in differ),
        "context_differs": sum(bool(r["context_differs"]) for r in records),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(records: list[dict[str, Any]], methods: list[str], subtasks: list[str]) -> dict[str, Any]:
    """{subtask or 'overall': {method: numbers}} — see DEFINITIONS for each number."""
    out: dict[str, Any] = {}
    for subtask in [*subtasks, OVERALL]:
        rows = [r for r in records if subtask in (OVERALL, r["subtask"])]
        speed = {m: tokens_per_second([r for r in rows if r["method"] == m]) for m in methods}
        plain = pooled_stats([r for r in rows if r["method"] == ENGINE_BASELINE])
        table: dict[str, Any] = {}
        for m in methods:
            rs = [r for r in rows if r["method"] == m]
            if not rs:
                continue
            pooled = pooled_stats(rs)
            table[m] = {
                "questions": len({r["question_id"] for r in rs}),
                "turns": len(rs),
                "new_tokens": sum(r["new_tokens"] for r in rs),
                "target_forwards": sum(r["target_forwards"] for r in rs),
                "seconds": sum(r["seconds"] for r in rs),
                "mean_accepted_length": mean_accepted_length(rs),
                "tokens_per_s": speed[m],
                "speedup_vs_hf": ratio(speed[m], speed.get(REFERENCE)),
                "speedup_vs_none": ratio(speed[m], speed.get(ENGINE_BASELINE)),
                "speedup_vs_none_interval": speedup_interval(rows, m, ENGINE_BASELINE),
                "acceptance_rate": ratio(pooled["accepted_tokens"], pooled["proposed_tokens"]) if pooled else None,
                "proposed_by_position": pooled["proposed_by_position"] if pooled else None,
                "accepted_by_position": pooled["accepted_by_position"] if pooled else None,
                "acceptance_by_position": acceptance_by_position(
                    pooled["proposed_by_position"], pooled["accepted_by_position"]
                )
                if pooled
                else None,
                "accepted_length_histogram": accepted_length_histogram(pooled["steps"], pooled["accepted_by_position"])
                if pooled
                else None,
                "identity": identity_summary(rs),
                "prediction": prediction(pooled, plain),
            }
        out[subtask] = table
    return out


# ------------------------------------------------------------------------------------------------ outputs


def machine_info(device: str) -> dict[str, Any]:
    import transformers

    from specframe.measurements import cpu_name

    info = {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def identity_cell(identity: dict[str, Any] | None) -> str:
    if identity is None:
        return "–"
    text = f"{identity['identical']}/{identity['compared']}"
    if identity["differ"]:
        text += f" ({identity['differ_at_near_tie']} at near-tie, {identity['differ_not_tie']} not)"
    return text


def main_table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| subtask | method | questions | mean accepted length | tokens/s | speedup vs hf | speedup vs none | "
        "acceptance rate | greedy output = hf |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for subtask, table in doc["summary"].items():
        for m, s in table.items():
            lines.append(
                f"| {subtask} | {m} | {s['questions']} | {fmt(s['mean_accepted_length'])} | "
                f"{fmt(s['tokens_per_s'], '.1f')} | {fmt(s['speedup_vs_hf'], '.2f', 'x')} | "
                f"{fmt(s['speedup_vs_none'], '.2f', 'x')}{interval_cell(s, m)} | {fmt(s['acceptance_rate'], '.3f')} | "
                f"{identity_cell(s['identity'])} |"
            )
    return lines


def interval_cell(numbers: dict[str, Any], method: str) -> str:
    """ " (1.15-1.40)": the 90% interval of a method's speedup vs none, where one was computed (reports before
    2026-12-06 have none); "" for `none` itself."""
    interval = numbers.get("speedup_vs_none_interval")
    return "" if interval is None or method == ENGINE_BASELINE else f" ({interval[0]:.2f}-{interval[1]:.2f})"


def markdown(doc: dict[str, Any], plots: bool = True) -> str:
    """The report as Markdown: setup, main table, acceptance by position, prediction, differences, skipped."""
    s, mach = doc["settings"], doc["machine"]
    mode = (
        "greedy"
        if s["greedy"]
        else f"sampling (temperature {s['temperature']}, top-p {s['top_p']}, top-k {s['top_k']}"
        + (f", min-p {s['min_p']})" if s.get("min_p") else ")")  # (no min_p in a bench.json before 2026-12-07)
    )
    for key, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if s.get(key, off) != off:  # (no penalties in a bench.json before 2026-12-07, nor ignore_eos)
            mode += f", {key.replace('_', ' ')} {s[key]}"
    if s.get("ignore_eos"):
        mode += ", past EOS tokens (ignore_eos)"
    categories: dict[str, dict[int, str]] = {}  # subtask -> question id -> category (mt_bench has eight)
    for r in doc["records"]:
        categories.setdefault(r["subtask"], {})[r["question_id"]] = r.get("category", r["subtask"])
    per = ", ".join(f"{k} {v}{categories_in_words(categories.get(k, {}), k)}" for k, v in s["questions_run"].items())
    planned, ran = s.get("questions_planned"), sum(s["questions_run"].values())
    if planned is not None and ran < planned:
        per += f"; stopped by the time limit ({s['time_limit_s']:g} s) after {ran} of {planned} questions"
    adapter = f" with adapter `{s['adapter']}` merged" if s.get("adapter") else ""  # (reports before 2026-12-06: none)
    cut = doc.get("turns_cut_by_context_window")
    if cut:
        per += f"; {cut} turns stopped at the target's context window before max_new_tokens"
    lines = [
        f"- command: `{doc['command']}`",
        f"- date: {doc['date']} (took {doc['duration_s']:.0f} s)",
        f"- target: `{s['target']}`{adapter} ({s['dtype']}, {s['device']}); {mode}; "
        f"max_new_tokens {s['max_new_tokens']}; batch 1; torch threads {s['torch_threads']}",
        f"- questions: {per} (from `{s['questions']}`)",
        f"- machine: {mach['nproc']} CPUs ({mach['cpu']}){', GPU ' + mach['gpu'] if 'gpu' in mach else ''}; "
        f"Python {mach['python']}, torch {mach['torch']}, transformers {mach['transformers']}",
        f"- load average (1/5/15 min) at start {fmt_load(doc['loadavg_start'])}, at end {fmt_load(doc['loadavg_end'])}",
        *busy_note(doc),
        "",
        "## Speed, acceptance, identity",
        "",
        *main_table(doc),
        "",
        *(
            []
            if s["greedy"]
            else [
                "Sampled outputs are not compared with `hf`'s (identity is a greedy check); that sampling keeps the "
                "target's distribution is what `specframe check` tests, statistically.",
                "",
            ]
        ),
    ]
    overall = doc["summary"].get(OVERALL, {})
    pos = {m: v["acceptance_by_position"] for m, v in overall.items() if v["acceptance_by_position"]}
    if pos:
        depth = max(len(v) for v in pos.values())
        lines += [
            "## Acceptance by draft position (all subtasks)",
            "",
            "| method | " + " | ".join(f"depth {d + 1}" for d in range(depth)) + " |",
            "|---|" + "---:|" * depth,
        ]
        for m, v in pos.items():
            cells = [fmt(v[d], ".3f") if d < len(v) else "–" for d in range(depth)]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    preds = [
        (sub, m, v["prediction"])
        for sub, t in doc["summary"].items()
        for m, v in t.items()
        if v["prediction"] is not None
    ]
    if preds:
        lines += [
            "## Predicted vs measured speedup (chain proposers; Leviathan et al.; a consistency check, see "
            "predicted_speedup below)",
            "",
            "| subtask | method | γ | α | tokens/step predicted | measured | draft cost/token | "
            "verify cost/step | plain step | predicted speedup | measured (decode loop) | "
            "measured (end to end, vs none) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for sub, m, p in preds:
            if not p["applies"]:
                lines.append(f"| {sub} | {m} | {p['why']} |" + " |" * 9)  # (12 columns in all)
                continue
            lines.append(
                f"| {sub} | {m} | {p['gamma']} | {fmt(p['alpha'], '.3f')} | "
                f"{fmt(p['expected_tokens_per_step'])} | {fmt(p['measured_tokens_per_step'])} | "
                f"{fmt(1e3 * p['draft_cost_per_token_s'], '.1f', ' ms')} | "
                f"{fmt(1e3 * p['verify_cost_per_step_s'], '.1f', ' ms')} | "
                f"{fmt(1e3 * p['plain_step_s'], '.1f', ' ms')} | "
                f"{fmt(p['predicted_speedup'], '.2f', 'x')} | {fmt(p['measured_loop_speedup'], '.2f', 'x')} | "
                f"{fmt(doc['summary'][sub][m]['speedup_vs_none'], '.2f', 'x')} |"
            )
        lines.append("")
    diffs = [r for r in doc["records"] if r["difference"] is not None]
    if diffs:
        lines += [
            "## Outputs that differ from hf's greedy output",
            "",
            "| method | question | turn | position | hf token | method token | top-2 gap (float32) | "
            "relative | near-tie |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in diffs:
            d = r["difference"]
            lines.append(
                f"| {r['method']} | {r['question_id']} | {r['turn'] + 1} | {d['position']} | "
                f"{d['reference_token']} | {d['method_token']} | {d['gap']:.3g} | {d['relative_gap']:.3g} | "
                f"{'yes' if d['near_tie'] else '**no**'} |"
            )
        lines.append("")
    if doc["skipped"]:
        lines += ["## Skipped", ""] + [f"- `{m}`: {why}" for m, why in doc["skipped"].items()] + [""]
    lines += ["## Methods", ""] + [f"- `{m}`: {v['description']}" for m, v in doc["methods"].items()] + [""]
    lines += ["## Definitions", ""] + [f"- {k}: {v}" for k, v in doc["definitions"].items()] + [""]
    if plots:
        speedup = ["![speedup per subtask](speedup.png)", ""] if "speedup.png" in plot_files(doc) else []
        lines += ["## Plots", "", *speedup, "![accepted lengths](accepted_lengths.png)", ""]
    return "\n".join(lines)


def categories_in_words(categories: dict[int, str], subtask: str) -> str:
    """Which categories a subtask's questions came from, e.g. " (writing 5)", where they are not the subtask itself
    (MT-bench's eight; `--limit` takes each subtask's first questions in file order, MT-bench's first ten being
    all writing), else ""."""
    counts: dict[str, int] = {}
    for category in categories.values():
        counts[category] = counts.get(category, 0) + 1
    if set(counts) <= {subtask}:
        return ""
    return " (" + ", ".join(f"{c} {n}" for c, n in counts.items()) + ")"


def busy_note(doc: dict[str, Any]) -> list[str]:
    """A warning line when other work was using the CPUs as the run started (load measured before it began)."""
    load, cpus = doc["loadavg_start"][0], doc["machine"]["nproc"] or 1
    if doc["settings"]["device"].startswith("cuda") or load < cpus / 2:
        return []
    return [
        f"- **the machine was busy**: 1-minute load {load:.2f} on {cpus} CPUs before the run started, so "
        "absolute tokens/s are depressed and noisy; the ratios between methods, interleaved prompt by "
        "prompt, are less so, not immune: a turn stalled by another process skews its method's mean, so "
        "confirm a surprising ratio on an idle machine"
    ]


def fmt_load(load: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def speedup_basis(doc: dict[str, Any]) -> tuple[str, str] | None:
    """The speedup the plot shows and its denominator: over `hf`, else over `none`; None when neither ran."""
    if REFERENCE in doc["methods"]:
        return "speedup_vs_hf", REFERENCE
    if ENGINE_BASELINE in doc["methods"]:
        return "speedup_vs_none", ENGINE_BASELINE
    return None


def plot_files(doc: dict[str, Any]) -> tuple[str, ...]:
    """The plots `write_plots` makes of `doc`: speedup.png only where hf or none ran."""
    return PLOT_FILES if speedup_basis(doc) is not None else ("accepted_lengths.png",)


def write_plots(doc: dict[str, Any], out: Path) -> list[Path]:
    """speedup.png (per subtask and method; where hf or none ran) and accepted_lengths.png (share of steps by
    tokens emitted)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    summary = doc["summary"]
    methods = list(doc["methods"])
    subtasks = list(summary)
    paths: list[Path] = []
    basis = speedup_basis(doc)
    if basis is not None:
        key, base = basis
        shown = [m for m in methods if m != base]
        fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(subtasks) * max(1, len(shown)) / 2), 4))
        width = 0.8 / max(1, len(shown))
        for i, m in enumerate(shown):  # (no bar where a method has no speedup: not measured there)
            at = [x for x, s in enumerate(subtasks) if summary[s].get(m, {}).get(key) is not None]
            ax.bar([x + i * width for x in at], [summary[subtasks[x]][m][key] for x in at], width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(subtasks))], subtasks, rotation=20)
        ax.set_ylabel(f"speedup over {base} (tokens/s ratio)")
        ax.set_title(f"{doc['settings']['target']}, {'greedy' if doc['settings']['greedy'] else 'sampling'}")
        if shown:
            ax.legend(fontsize="small")
        fig.tight_layout()
        paths.append(out / "speedup.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    overall = summary.get(OVERALL, {})
    hists = {
        m: v["accepted_length_histogram"]
        for m, v in overall.items()
        if v["accepted_length_histogram"] and len(v["accepted_length_histogram"]) > 1
    }
    width = 0.8 / max(1, len(hists))
    for i, (m, h) in enumerate(hists.items()):
        total = sum(h) or 1
        offset = (i - (len(hists) - 1) / 2) * width  # the group of bars centred on its integer tick
        ax.bar([k + 1 + offset for k in range(len(h))], [c / total for c in h], width, label=m)
    if hists:
        ax.set_xticks(range(1, max(len(h) for h in hists.values()) + 1))
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no proposer drafted tokens", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("tokens emitted per verification step (accepted drafts + 1)")
    ax.set_ylabel("share of steps")
    ax.set_title("accepted lengths, all subtasks")
    fig.tight_layout()
    paths.append(out / "accepted_lengths.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def results_page(doc: dict[str, Any], path: str = "docs/results.md", plots: bool = True) -> str:
    """The results page (docs/results.md; docs/results-gpu.md for the GPU check's run): the run's Markdown with
    how it was made; regenerated by the command it names. `plots`: whether the run's folder has them."""
    in_docs = Path(path).parent.name == "docs"  # (beside docs/gpu.md: a relative link to it works)
    files = ", ".join(f"`{name}`" for name in ("bench.json", *(plot_files(doc) if plots else ())))
    head = [
        "# Results" + (" on a GPU" if "gpu" in doc["machine"] else ""),
        "",
        f"<!-- Generated by `specframe bench ... --results-doc {path}`; do not edit by hand. -->",
        "",
        "The latest benchmark numbers on this machine. Regenerate this page with the command below (with "
        f"`--results-doc {path}` where it lacks one: it rewrites this file); plots and per-turn records are in the "
        f"run's `--out` folder ({files}{'' if plots else ', no plots: matplotlib was not installed'}; a local "
        f"folder, not in the repository), and `specframe bench --render <out>/bench.json --results-doc {path}` "
        "re-makes this page from them without generating anything. The GPU check (conformance suite and benchmark on "
        "CUDA) and its results: " + ("[gpu.md](gpu.md)." if in_docs else "docs/gpu.md in specframe's repository."),
        "",
    ]
    return "\n".join(head + [markdown(doc, plots=False)])


def write_outputs(doc: dict[str, Any], out: Path, results_doc: str | None) -> None:
    """The report's files in `out` (the plots where matplotlib is installed) and the results page; bench.json
    last and whole (written aside, then renamed in: `render` rewrites the bench.json it read)."""
    plots = plots_possible()
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text("# specframe bench\n\n" + markdown(doc, plots=plots))
    drawn = write_plots(doc, out) if plots else []
    for name in PLOT_FILES:  # (an earlier run's plots would read as this one's)
        if out / name not in drawn:
            (out / name).unlink(missing_ok=True)
    if results_doc:
        page = Path(results_doc)
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(results_page(doc, results_doc, plots))
    text = json.dumps(doc, indent=1)
    with tempfile.TemporaryDirectory(dir=out) as work:
        aside = Path(work) / "bench.json"
        aside.write_text(text)
        os.replace(aside, out / "bench.json")


class quiet_transformers:
    """Hush transformers' logging (generation advice per call) for the run; restore it after."""

    def __enter__(self) -> quiet_transformers:
        from transformers.utils import logging as hf_logging

        self.level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        return self

    def __exit__(self, *_: Any) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self.level)
