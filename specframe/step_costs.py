"""How many draft tokens pay on this machine: a proposal shape chosen by timing the target where it runs.

On a GPU, verifying dozens of tokens costs what one does; on a CPU every token in the verification forward
costs something, and how much depends on the CPU (specframe/cpu_kernels.py): on this project's AMD EPYC
machines 2-4 tokens cost 1.06-1.12x (2026-12-03; 3 cost 1.29x before the few-row layout padded them to 4),
on its Intel Xeon ones 2-3 tokens cost 1.0-1.2x and 4 cost 1.4-1.6x (three benchmark loads of 2026-12-03).
So the shape that decodes fastest on one machine is not the fastest on another (EAGLE's shipped drafter: three
draft nodes per step on the AMD machine, a chain until 2026-12-04 and a two-level tree since; a chain of one or
two on the Intel one, whose timings put those two close).

A trained artifact that says so (`"shape_choice": "measured"` in its config) has its CPU shape chosen at load
from its candidate shapes: each one's speed relative to plain decoding is estimated as

    expected accepted length / (target forward over its verified tokens + its drafter forwards per step)

with the accepted length from the artifact's held-out statistics and both costs in units of a one-token target
forward, timed here (`measure_step_costs`, ~1.8 s for SmolLM2-135M, once per target, thread count and
machine: a CPU target's timings are kept on disk for later processes, `specframe.measurements`, so that a
shape chosen from them alone (Medusa's) stays the same from one process to the next (unless a one-token forward
timed now takes less than half the kept time: then they were timed on a busy machine, and are timed again);
`relative_cost` for a drafter's forward, ~0.2 s, in each process, against one-token target forwards timed in
turn with it (a busy moment then slows both alike), so EAGLE's choice can still move where two shapes are close).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specframe import measurements
from specframe.errors import ModelLoadError, is_number

CONTEXT = 128  # cached tokens before the timed forwards (a short prompt)
MAX_VERIFY_TOKENS = 4  # timed forwards cover 1..this many tokens (on a CPU, more never paid on either machine)
REPEATS = 5  # timed calls per token count, alternating between counts; the fastest counts (busy time only adds)
CHECKS = 3  # timed one-token forwards that check kept timings before they are used
KEPT_SLOWER_AT = 2.0  # kept timings this many times slower than a one-token forward now: timed again
SHAPE_CHOICES = ("saved", "measured")  # values of an artifact's `shape_choice`
_COSTS = "_specframe_step_costs"  # attribute of a timed model: {(threads, dtype, device, CPU kernels on): StepCosts}


@dataclass(frozen=True)
class StepCosts:
    """A target's forward times on this machine over a cached context."""

    one_token_s: float  # seconds of a one-token forward (a plain decoding step)
    relative: tuple[float, ...]  # relative[n - 1]: a forward over n tokens, in one-token forwards (relative[0] = 1)
    timed_on: str = ""  # where read from disk (`specframe.measurements`): the date (UTC) they were timed

    def describe(self) -> str:
        """The timings as a proposer reports them (the benchmark's method descriptions)."""
        costs = ", ".join(f"{c:.2f}" for c in self.relative)
        kept = f", kept from {self.timed_on}" if self.timed_on else ""
        return f"verifying 1-{len(self.relative)} tokens = {costs} one-token forwards{kept}"

    def verify(self, tokens: int) -> float:
        """A forward over `tokens` tokens, in one-token forwards."""
        if not 1 <= tokens <= len(self.relative):
            raise ValueError(f"forwards over 1..{len(self.relative)} tokens were timed, not {tokens}")
        return self.relative[tokens - 1]


@dataclass(frozen=True)
class ShapeCandidate:
    """One proposal shape a proposer could use, with what it is expected to gain and cost per step."""

    shape: Any  # the proposer's own description (a depth, a tree)
    accepted_length: float  # expected tokens per step (accepted drafts + the target's own), held-out statistics
    verify_tokens: int  # tokens in the verification forward: the drafted nodes + the root
    drafter_forwards: int = 0  # sequential drafter forwards per step (each timed by the proposer)
    # Expected accepted drafts at each depth (reach[k - 1]: the chance a step accepts a node at depth k, held-out
    # statistics; sum = accepted_length - 1); () for a step that drafts nothing. What OnlineShapeChoice scales.
    reach: tuple[float, ...] = ()

    def expected_length(self, scale: float = 1.0) -> float:
        """Expected tokens per step when each depth's chance of being accepted, given the one before it was, is
        `scale` times the held-out one: 1 + sum_k scale^k reach_k (the held-out accepted_length at scale 1)."""
        if not self.reach:  # (the plain step; a candidate without reach is not scaled)
            return self.accepted_length
        return 1 + sum(min(1.0, r * scale**k) for k, r in enumerate(self.reach, 1))  # (a chance is at most 1)


# The step that drafts nothing: plain decoding's one-token forward, one token per step. An online choice
# (OnlineShapeChoice) falls back to it where this generation's drafts are seldom accepted.
PLAIN_STEP = ShapeCandidate(None, 1.0, verify_tokens=1)


def _time_min(calls: dict[Any, Callable[[], Any]], timer: Callable[[], float], repeats: int = REPEATS) -> dict:
    """Fastest of `repeats` timed calls of each, the calls alternating, after one untimed warm-up call of each."""
    for call in calls.values():
        call()
    best = {k: float("inf") for k in calls}
    for _ in range(repeats):
        for k, call in calls.items():
            t0 = timer()
            call()
            best[k] = min(best[k], timer() - t0)
    return best


def measure_step_costs(model: torch.nn.Module, timer: Callable[[], float] = time.perf_counter) -> StepCosts:
    """Time `model` (a causal LM, as the decoder calls it) on forwards over 1..MAX_VERIFY_TOKENS tokens after
    CONTEXT cached ones; once per model and thread count (kept on the model, and for a CPU target on disk, checked
    by a few one-token forwards before use)."""
    from specframe.cpu_kernels import fast_kernels_on

    memo = model.__dict__.setdefault(_COSTS, {})
    threads, weight = torch.get_num_threads(), next(model.parameters())
    device = weight.device
    key = (threads, weight.dtype, device, fast_kernels_on(model))  # (a model moved or cast since is timed again)
    if key in memo:
        return memo[key]
    name = _kept_name(model, threads) if device.type == "cpu" else None
    kept = _costs_from(measurements.stored(STEP_COSTS_KEPT, _SOURCES).get(name)) if name else None
    # Kept timings are used while a one-token forward timed now is not much faster than they say: busy time only
    # adds, so kept ones more than KEPT_SLOWER_AT times slower were timed on a busy machine, and are timed again.
    if kept is not None and kept.one_token_s <= KEPT_SLOWER_AT * _forward_times(model, (1,), timer, CHECKS)[1]:
        memo[key] = kept
        return kept
    counts = range(1, MAX_VERIFY_TOKENS + 1)
    times = _forward_times(model, counts, timer, REPEATS)
    if not _plausible([times[n] / max(times[1], 1e-9) for n in counts]):  # (a busy spell: timed again, the
        again = _forward_times(model, counts, timer, REPEATS)  # fastest of both kept for each count)
        times = {n: min(times[n], again[n]) for n in counts}
    one = max(times[1], 1e-9)
    relative = [times[n] / one for n in counts]
    plausible = _plausible(relative)
    # (busy on both tries: each count capped at what it can cost, n one-token forwards, and not kept on disk)
    memo[key] = costs = StepCosts(one, tuple(min(cost, n) for n, cost in zip(counts, relative, strict=True)))
    if name and plausible:
        today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        kept = {"one_token_s": one, "relative": list(costs.relative), "timed_on": today}
        measurements.store(STEP_COSTS_KEPT, _SOURCES, name, kept)
    return costs


def _forward_times(model: torch.nn.Module, counts: Sequence[int], timer: Callable[[], float], repeats: int) -> dict:
    """Seconds of `model`'s forward over each of `counts` tokens after CONTEXT cached ones (`_time_min`)."""
    return _time_min(_forward_calls(model, counts), timer, repeats)


def _forward_calls(model: torch.nn.Module, counts: Sequence[int]) -> dict[int, Callable[[], None]]:
    """{n: a call of `model`'s forward over n tokens after CONTEXT cached ones (each call crops them again)}."""
    from specframe.kv_cache import new_cache
    from specframe.lean_forward import engine_forward

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (1, CONTEXT + max(counts)), generator=gen).to(device)
    cache = new_cache(model)
    run_model = engine_forward(model)  # (as the decoder runs it)
    with torch.no_grad():
        run_model(input_ids=ids[:, :CONTEXT], cache=cache, use_cache=True, logits_to_keep=1)

    def forward(n: int) -> Callable[[], None]:
        @torch.no_grad()
        def call() -> None:
            run_model(input_ids=ids[:, CONTEXT : CONTEXT + n], cache=cache, use_cache=True)
            cache.crop(-n)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return call

    return {n: forward(n) for n in counts}


STEP_COSTS_KEPT = "step_costs"  # the kind of measurement kept on disk for later processes (CPU targets only)
_CODE = ("step_costs.py", "cpu_kernels.py", "block_weights.py", "block_weights.c", "lean_forward.py", "kv_cache.py")
_SOURCES = tuple(Path(__file__).with_name(name) for name in _CODE)  # the code a target's forwards run through


def _kept_name(model: torch.nn.Module, threads: int) -> str:
    """What a target's kept step costs are found by: its weights (fingerprint, an adapter merged included),
    dtype, thread count, attention, kernels, and the transformers version and whether the lean forward runs
    (which decides how much of a forward is module machinery)."""
    import transformers

    from specframe.block_weights import blocks_available
    from specframe.cpu_kernels import fast_kernels_on, layout_choice
    from specframe.fingerprint import target_fingerprint
    from specframe.lean_forward import engine_forward

    weights = target_fingerprint(model)
    adapter = weights.get("adapter_sha256", "")[:16]
    parts = [
        weights["weights_sha256"]["float32"][:16] + ("+" + adapter if adapter else ""),
        str(next(model.parameters()).dtype).removeprefix("torch."),
        f"threads={threads}",
        str(getattr(model.config, "_attn_implementation", None)),
        f"{layout_choice} blocks={blocks_available()}" if fast_kernels_on(model) else "stock",
        f"transformers={transformers.__version__}",
        f"lean={engine_forward(model) is not model}",
    ]
    return " ".join(parts)


def _plausible(relative: Sequence[float]) -> bool:
    """Whether forwards over 1..n tokens cost at most n one-token forwards each (`relative`): one over n tokens
    never costs more than n one-token forwards in turn do; a count timed dearer was timed in a busy spell (one
    machine kept 10.6 for 4 tokens, steering the shape choice until its timings were deleted; 1.1-1.3 again)."""
    return all(cost <= n for n, cost in enumerate(relative, 1))


def _costs_from(kept: Any) -> StepCosts | None:
    """StepCosts from their kept form; None unless it is a plausible one (a one-token forward of 1 us to 60 s;
    each count's cost finite, 0.05-100 one-token forwards and `_plausible`, 1 for one token)."""
    if not isinstance(kept, dict):
        return None
    one, relative = kept.get("one_token_s"), kept.get("relative")
    if not (_number(one, 1e-6, 60) and isinstance(relative, list)):
        return None
    if len(relative) != MAX_VERIFY_TOKENS or relative[0] != 1.0:
        return None
    if not all(_number(c, 0.05, 100) for c in relative) or not _plausible(relative):
        return None
    when = kept.get("timed_on")
    try:
        when = datetime.date.fromisoformat(when).isoformat()
    except (TypeError, ValueError):
        when = "an earlier process"
    return StepCosts(float(one), tuple(float(c) for c in relative), when)


def _number(value: Any, low: float, high: float) -> bool:
    """A real number (JSON's numbers; not a bool) in [low, high] (NaN is in no range; a JSON integer too large for
    a float compares without overflowing)."""
    return is_number(value) and low <= value <= high


def relative_cost(
    call: Callable[[], Any], model: torch.nn.Module, timer: Callable[[], float] = time.perf_counter
) -> float:
    """`call`'s time in one-token forwards of the target `model` (fastest of REPEATS after a warm-up, each),
    the forwards timed now, alternating with the calls, so that a busy moment slows both alike (against a kept
    one-token time, one would make a drafter step look several times dearer than it is)."""
    times = _time_min({"call": call, "target": _forward_calls(model, (1,))[1]}, timer)
    return times["call"] / max(times["target"], 1e-9)


def step_cost(candidate: ShapeCandidate, costs: StepCosts, drafter_cost: float = 0.0) -> float:
    """A step of `candidate`'s shape, in one-token target forwards: its verification forward and its drafter
    forwards (each `drafter_cost`)."""
    return costs.verify(candidate.verify_tokens) + candidate.drafter_forwards * drafter_cost


def fastest_shape(candidates: Sequence[ShapeCandidate], costs: StepCosts, drafter_cost: float = 0.0) -> ShapeCandidate:
    """The candidate with the most expected tokens per unit of time (the first of equals), given the target's
    `costs` and one drafter forward's cost in one-token target forwards."""
    usable = [c for c in candidates if c.verify_tokens <= len(costs.relative)]
    if not usable:
        raise ValueError("no candidate shape fits the timed forwards")

    # (max keeps the first of equal speeds)
    return max(usable, key=lambda c: c.accepted_length / step_cost(c, costs, drafter_cost))


def check_shape_choice(value: Any, where: str) -> str:
    """An artifact's `shape_choice` ("saved" when absent), or ModelLoadError naming `where`."""
    if value is None:
        return "saved"
    if value not in SHAPE_CHOICES:
        raise ModelLoadError(f"shape_choice in {where} must be one of {', '.join(SHAPE_CHOICES)}, got {value!r}")
    return value


# OnlineShapeChoice's settings, chosen on held-out training prompts (docs/architecture.md, "Shapes chosen while
# decoding"): how many steps of the held-out acceptance the estimate starts from, and how much of a step's
# observation is kept at the next step (0.95: the latest ~20 steps weigh most).
PRIOR_STEPS = 2.0
MEMORY = 0.95
# After this many plain steps in a row, one step drafts (a probe) whatever the estimate says: where the held-out
# acceptance itself says drafting does not pay, plain steps alone would never learn otherwise.
PROBE_AFTER = 16


class OnlineShapeChoice:
    """Each step's proposal shape, re-chosen from the acceptance this generation has had so far.

    A shape chosen at load (`fastest_shape`) expects the acceptance of the artifact's held-out data, but
    acceptance varies with the text: on Spec-Bench's translations EAGLE's drafter is accepted half as often as on
    held-out training prompts, and a repetition penalty lowers it too, so a shape that pays on average can make
    decoding slower than plain decoding. Here every depth's chance of acceptance is taken as `scale` times the
    held-out one (ShapeCandidate.reach), with `scale` fitted to the steps seen (accepted drafts against what
    each step's shape expected at that scale; the latest weighing most, MEMORY) and to PRIOR_STEPS steps of the
    held-out acceptance (scale 1), and each step drafts the candidate, PLAIN_STEP included, expected fastest
    at that scale with the costs timed at load. A generation starts with the load-time choice. When plain steps
    are chosen the observations fade and the estimate returns towards the held-out one, and after PROBE_AFTER
    plain steps in a row one step drafts anyway, so drafting resumes now and then and the choice can change back.

    A step is: `choose()`, the proposer drafting, `drafted(nodes, depth)` (what it drafted), then `observe(accepted)`
    after verification. Only a step that drafted its whole shape is counted (`drafted`): one cut short says
    nothing of the shape's acceptance.

    Which shape a step drafts depends only on earlier steps' outcomes, so exactness is untouched (the rule is
    exact for any proposal made before the step's target forward)."""

    def __init__(
        self,
        candidates: Sequence[ShapeCandidate],
        costs: StepCosts,
        drafter_cost: float = 0.0,
        prior_steps: float | None = None,
        memory: float | None = None,
    ) -> None:
        prior_steps = PRIOR_STEPS if prior_steps is None else prior_steps
        memory = MEMORY if memory is None else memory
        usable = [c for c in candidates if c.verify_tokens <= len(costs.relative) and c.reach]
        if not usable:
            raise ValueError("OnlineShapeChoice needs candidates with held-out reach that fit the timed forwards")
        if not (prior_steps > 0 and 0 <= memory < 1):
            raise ValueError(f"prior_steps must be > 0 and memory in [0, 1), got {prior_steps} and {memory}")
        self.candidates = [PLAIN_STEP, *usable]
        self.cost = [step_cost(c, costs, drafter_cost) for c in self.candidates]
        self.prior_steps, self.memory = prior_steps, memory
        self.reference = usable[0]  # (the prior: prior_steps steps of it, accepted as held out)
        # Where each generation starts: the load-time choice (`fastest_shape`, among the drafting shapes).
        self.first = self.candidates.index(fastest_shape(usable, costs, drafter_cost))
        # The largest scale at which no depth is accepted more often than always, given the one before it was.
        conditional = [
            r / before for c in usable for r, before in zip(c.reach, (1.0, *c.reach), strict=False) if before
        ]
        self.most = 1 / max(conditional) if any(conditional) else 1.0
        self.reset()

    def reset(self) -> None:
        """A new generation: forget the steps seen."""
        self.steps = [0.0] * len(self.candidates)  # decayed steps that drafted each candidate
        self.accepted = 0.0  # decayed accepted drafts over those steps
        self.scale = 1.0
        self.plain_run = 0  # plain steps in a row
        self.current = self.first
        self.whole = False  # whether the step being verified drafted all of its shape (`drafted`)

    def choose(self) -> ShapeCandidate:
        """The shape for the next step."""
        return self.candidates[self.current]

    def drafted(self, nodes: int, depth: int) -> None:
        """The proposal of the latest `choose()` holds `nodes` nodes, drafted to at most `depth` levels (the
        shape's own depth unless the generation's token budget cut it). It is that shape whole when both are the
        shape's (`verify_tokens - 1` nodes, `len(reach)` levels); a step cut short (by the token budget or a
        confidence threshold) is not counted by `observe`. A tree cut to one level can hold as many nodes as the
        whole shape, all at depth 1, which is why the depth is compared too. Not called: not counted."""
        shape = self.candidates[self.current]
        self.whole = nodes == shape.verify_tokens - 1 and depth == len(shape.reach)

    def observe(self, accepted: int) -> None:
        """The step drafted with the latest `choose()` accepted `accepted` of its drafts (0 for a plain step).
        Counted only where `drafted` said the step drafted its whole shape; the next step's shape is chosen."""
        m = self.memory
        self.steps = [n * m for n in self.steps]
        self.accepted *= m
        if self.current and self.whole:  # (a plain step says nothing of the drafts' acceptance)
            self.steps[self.current] += 1
            self.accepted += accepted
        self.whole = False
        self.plain_run = 0 if self.current else self.plain_run + 1
        self.scale = self._fitted_scale()
        self.current = self._fastest()
        if not self.current and self.plain_run >= PROBE_AFTER:  # (a probe: the best drafting shape, once)
            self.current = self._fastest(drafting=True)

    def _fitted_scale(self) -> float:
        """The scale at which the steps seen and the prior steps expect as many accepted drafts as were seen and
        as the prior holds (their expectation grows with the scale: found by bisection, to 1e-3)."""
        prior = self.prior_steps * (self.reference.expected_length() - 1)
        goal = self.accepted + prior

        def expected(scale: float) -> float:
            seen = sum(
                n * (c.expected_length(scale) - 1)
                for n, c in zip(self.steps, self.candidates, strict=True)
                if n and c.reach
            )
            return seen + self.prior_steps * (self.reference.expected_length(scale) - 1)

        low, high = 0.0, self.most
        if expected(high) <= goal:
            return high
        while high - low > 1e-3:
            mid = (low + high) / 2
            low, high = (mid, high) if expected(mid) < goal else (low, mid)
        return (low + high) / 2

    def _fastest(self, drafting: bool = False) -> int:
        """Index of the candidate (with `drafting`, of those that draft) with the most expected tokens per unit of
        time at the current scale (the first of equals; the plain step first)."""
        speeds = [c.expected_length(self.scale) / cost for c, cost in zip(self.candidates, self.cost, strict=True)]
        return max(range(1 if drafting else 0, len(speeds)), key=speeds.__getitem__)

    def describe(self) -> str:
        """The choice in words, for reports."""
        return (
            f"re-chosen every step from this generation's acceptance so far, a plain step among the shapes (prior: "
            f"{self.prior_steps:g} steps of the held-out acceptance; memory {self.memory:g} a step)"
        )


@dataclass(frozen=True)
class MeasuredChoice:
    """A proposer's shape chosen at load from this machine's timings (`choose_measured`)."""

    best: ShapeCandidate  # the candidate expected fastest: where every generation starts
    online: OnlineShapeChoice | None  # the shape re-chosen every step (a proposer's `adapt_shape`), or None
    measured_shape: str  # the shape in a few words ("chain of 2"), for the stats line
    shape_choice: str  # that, and how it was chosen, for the benchmark's method description


def choose_measured(
    candidates: Sequence[ShapeCandidate],
    costs: StepCosts,
    drafter_cost: float,
    adapt: bool,
    words: Callable[[Any], str],
    searched: str,
    drafter: str,
) -> MeasuredChoice:
    """The fastest of `candidates` with the target's `costs` and a drafter forward of `drafter_cost` (`fastest_shape`)
    and, with `adapt`, an OnlineShapeChoice starting there; `words` says a shape in a few words, `searched` what the
    candidates were ("γ of 1-3") and `drafter` what was timed with the target ("a draft step")."""
    online = OnlineShapeChoice(candidates, costs, drafter_cost) if adapt else None
    best = online.choose() if online else fastest_shape(candidates, costs, drafter_cost)  # (the same one)
    shape = words(best.shape)
    how = f"{shape} (measured: {searched}, {costs.describe()}, {drafter} {drafter_cost:.2f})"
    if online is None:
        return MeasuredChoice(best, None, shape, how)
    return MeasuredChoice(
        best,
        online,
        f"{shape} at first (re-chosen each step by the acceptance so far)",
        f"{how} at first; then {online.describe()}",
    )
