"""The proposal shape chosen by timing the target on the machine (specframe/step_costs.py)."""

import copy
import datetime

import pytest
import torch
import transformers

from specframe import cpu_kernels, lean_forward, measurements, step_costs
from specframe.bench import shape_choices
from specframe.cli import measured_shapes, shapes_said
from specframe.errors import ModelLoadError
from specframe.step_costs import (
    MAX_VERIFY_TOKENS,
    PLAIN_STEP,
    OnlineShapeChoice,
    ShapeCandidate,
    StepCosts,
    check_shape_choice,
    fastest_shape,
    measure_step_costs,
    relative_cost,
)
from specframe.testing.tiny import tiny_llama

# EAGLE's shipped drafter's chains (expected accepted lengths from its held-out top-1 per level), and timings of
# SmolLM2-135M's forwards over 1-4 tokens on the two kinds of machine (specframe/cpu_kernels.py's tables).
CHAINS = [ShapeCandidate(d, e, d + 1, d) for d, e in ((1, 1.509), (2, 1.736), (3, 1.829))]
INTEL = StepCosts(0.069, (1.0, 1.07, 1.10, 1.39))
AMD = StepCosts(0.034, (1.0, 0.91, 1.21, 1.18))


def test_the_fastest_shape_follows_the_machine():
    assert fastest_shape(CHAINS, INTEL, drafter_cost=0.07).shape == 2  # 1.736 / 1.24 > 1.509 / 1.14
    assert fastest_shape(CHAINS, AMD, drafter_cost=0.07).shape == 1  # 1.509 / 0.98 > 1.736 / 1.35
    assert fastest_shape(CHAINS, INTEL, drafter_cost=0.5).shape == 1  # a costly drafter: one token
    free = StepCosts(0.01, (1.0, 1.0, 1.0, 1.0))
    assert fastest_shape(CHAINS, free).shape == 3  # verification free, drafting free: the longest
    same = [ShapeCandidate("a", 1.5, 2), ShapeCandidate("b", 1.5, 2)]
    assert fastest_shape(same, free).shape == "a"  # equals: the first
    # A candidate verifying more tokens than were timed is never chosen; none fitting is an error.
    deep = ShapeCandidate("deep", 9.0, MAX_VERIFY_TOKENS + 1)
    assert fastest_shape([*CHAINS, deep], free).shape == 3
    with pytest.raises(ValueError, match="no candidate"):
        fastest_shape([deep], free)
    with pytest.raises(ValueError, match="not 5"):
        free.verify(5)


# The same chains with their per-depth reach (held-out top-1 per level 0.509, then 0.446 and 0.323 given the
# levels before), as measured_candidates makes them.
REACHED = [
    ShapeCandidate(d, 1 + sum(r[:d]), d + 1, d, reach=r[:d])
    for d, r in ((d, (0.509, 0.227, 0.0733)) for d in (1, 2, 3))
]


def whole_step(online: OnlineShapeChoice, accepted: int) -> None:
    """A step that drafted the shape chosen for it whole (`drafted`), then had `accepted` of its drafts accepted."""
    shape = online.choose()
    online.drafted(shape.verify_tokens - 1, len(shape.reach))
    online.observe(accepted)


def test_the_online_choice_starts_where_the_load_time_choice_does_and_follows_the_acceptance_seen():
    free = StepCosts(0.01, (1.0, 1.05, 1.1, 1.15))
    online = OnlineShapeChoice(REACHED, free, drafter_cost=0.05)
    assert online.choose() is fastest_shape(REACHED, free, 0.05) and online.scale == 1.0
    # Every draft accepted: the acceptance seen is twice the held-out one, and the deepest chain pays.
    for _ in range(30):
        whole_step(online, online.choose().shape or 0)
    assert online.choose().shape == 3 and online.scale == pytest.approx(online.most, abs=2e-3)
    # Nothing accepted in a new generation: within a few steps, the plain step, which costs least.
    online.reset()
    drafted = 0
    while online.choose() is not PLAIN_STEP:
        whole_step(online, 0)
        drafted += 1
    assert 3 < drafted < 20 and online.scale < 0.2, drafted
    # Plain steps say nothing of the drafts: what was seen fades and the held-out acceptance returns, so drafting
    # resumes now and then (a probe); while no draft is accepted, most steps stay plain.
    plain = 0
    for _ in range(200):
        plain += online.choose() is PLAIN_STEP
        whole_step(online, 0)
    assert 0.5 < plain / 200 < 0.95, plain  # (59% with these costs)
    online.reset()  # (a new generation: the load-time choice again)
    assert online.choose() is fastest_shape(REACHED, free, 0.05) and online.scale == 1.0


def test_a_generation_starts_with_the_load_time_choice_and_plain_steps_are_probed():
    # Held-out acceptance too low for any shape to pay: the load-time choice (among the drafting shapes) is still
    # where a generation starts, and it is what the stats line names; after PROBE_AFTER plain steps in a row one
    # step drafts, so plain steps alone never settle it (they say nothing of the drafts).
    low = [ShapeCandidate(g, 1 + 0.15**g, g + 1, g, reach=tuple(0.15**i for i in range(1, g + 1))) for g in (1, 2)]
    costs = StepCosts(0.01, (1.0, 1.04, 1.10, 1.26))
    online = OnlineShapeChoice(low, costs, drafter_cost=0.2)
    assert online.choose() is fastest_shape(low, costs, 0.2) and online.candidates[online.first] is online.choose()
    whole_step(online, 0)
    assert online.choose() is PLAIN_STEP
    drafted = []
    for _ in range(3 * (step_costs.PROBE_AFTER + 1)):
        drafted.append(online.choose() is not PLAIN_STEP)
        whole_step(online, 0)
    assert [i for i, d in enumerate(drafted) if d] == [16, 33, 50]
    online.current = online.first  # (a probe accepted: the estimate rises, drafting goes on)
    whole_step(online, 1)
    assert online.choose() is not PLAIN_STEP and online.scale > 1
    # A step cut short (by the token budget, a confidence threshold) is not counted: nothing accepted there lowers
    # the estimate only as a plain step's fading does, not as a counted rejection. Cut short: fewer nodes than the
    # shape's, or fewer levels (a tree cut to one level can hold as many nodes), or `drafted` not told at all.
    shape = online.choose()
    nodes, depth = shape.verify_tokens - 1, len(shape.reach)
    counted = copy.deepcopy(online)
    whole_step(counted, 0)
    assert counted.steps != [0.95 * n for n in online.steps]
    for told in ((nodes - 1, depth), (nodes, depth - 1), None):
        cut = copy.deepcopy(online)
        if told:
            cut.drafted(*told)
        cut.observe(0)
        assert cut.scale > counted.scale and cut.steps == [0.95 * n for n in online.steps], told
    # What `drafted` said counts for its own step only: the step after it is not counted unless told again.
    again = copy.deepcopy(counted)
    again.current = again.first
    again.observe(0)
    assert again.steps == [0.95 * n for n in counted.steps]


def test_the_online_scale_is_fitted_to_the_steps_seen_and_the_prior():
    # One candidate, no memory (only the latest step counts): s p + P s p = a + P p, so s = (a + P p) / ((1 + P) p).
    chain = ShapeCandidate(1, 1.5, 2, 1, reach=(0.5,))
    costs = StepCosts(0.01, (1.0, 1.0, 1.0, 1.0))
    online = OnlineShapeChoice([chain], costs, prior_steps=3.0, memory=0.0)
    whole_step(online, 1)
    assert online.scale == pytest.approx((1 + 3 * 0.5) / (4 * 0.5), abs=1e-3)  # (capped at 1 / 0.5 = 2: 1.25)
    whole_step(online, 0)
    assert online.scale == pytest.approx((0 + 3 * 0.5) / (4 * 0.5), abs=1e-3)
    # Depth k's reach scales as s^k: a chain of 2's expected tokens at s = 0.5 is 1 + 0.5 * 0.5 + 0.25 * 0.25.
    assert REACHED[1].expected_length(0.5) == pytest.approx(1 + 0.509 * 0.5 + 0.227 * 0.25)
    assert REACHED[1].expected_length() == pytest.approx(REACHED[1].accepted_length)
    assert PLAIN_STEP.expected_length(0.3) == 1.0
    # No depth accepted more than always: each term is capped at 1, and the scale at 1 / the largest chance of a
    # depth given the one before it (here 0.8 / 0.5 at depth 2).
    assert ShapeCandidate(2, 2.3, 3, 2, reach=(0.5, 0.8)).expected_length(3.0) == 3.0
    capped = OnlineShapeChoice([ShapeCandidate(2, 2.3, 3, 2, reach=(0.5, 0.8))], costs)
    assert capped.most == pytest.approx(0.5 / 0.8)
    # Steps of two shapes: each is expected what its own shape expects at the scale.
    online = OnlineShapeChoice(REACHED, costs, prior_steps=1.0, memory=0.5)
    online.current = 1
    whole_step(online, 1)  # (chain of 1, one accepted)
    online.current = 2
    whole_step(online, 0)  # (chain of 2, none)
    s = online.scale
    seen = 0.5 * (REACHED[0].expected_length(s) - 1) + (REACHED[1].expected_length(s) - 1)
    assert seen + (REACHED[0].expected_length(s) - 1) == pytest.approx(0.5 * 1 + 0 + 0.509, abs=2e-3)


def test_the_online_choice_refuses_what_it_cannot_use():
    costs = StepCosts(0.01, (1.0, 1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="candidates with held-out reach"):
        OnlineShapeChoice(CHAINS, costs)  # (no reach: nothing to scale)
    with pytest.raises(ValueError, match="candidates with held-out reach"):
        OnlineShapeChoice([ShapeCandidate(9, 5.0, MAX_VERIFY_TOKENS + 1, 9, reach=(0.5,) * 9)], costs)
    with pytest.raises(ValueError, match="memory in"):
        OnlineShapeChoice(REACHED, costs, memory=1.0)
    with pytest.raises(ValueError, match="prior_steps must be > 0"):
        OnlineShapeChoice(REACHED, costs, prior_steps=0.0)


class FakeClock:
    """A clock that a model's forward advances by a cost per input token count (and nothing else does)."""

    def __init__(self, model, seconds_per_forward):
        self.now = 0.0
        self.forwards = []

        def advance(module, args, kwargs):
            n = kwargs["input_ids"].shape[1]
            self.forwards.append(n)
            self.now += seconds_per_forward.get(n, 1.0)

        model.register_forward_pre_hook(advance, with_kwargs=True)

    def __call__(self):
        return self.now


def test_forward_costs_are_timed_once_per_model_and_thread_count():
    model = tiny_llama(vocab_size=32, seed=0)
    clock = FakeClock(model, {1: 0.02, 2: 0.021, 3: 0.03, 4: 0.05})
    costs = measure_step_costs(model, timer=clock)
    assert costs.one_token_s == pytest.approx(0.02)
    assert costs.relative == pytest.approx((1.0, 1.05, 1.5, 2.5))
    # The context once, then each count once untimed and REPEATS times timed, the counts alternating.
    counts = list(range(1, MAX_VERIFY_TOKENS + 1))
    assert clock.forwards == [step_costs.CONTEXT] + counts * (1 + step_costs.REPEATS)
    assert measure_step_costs(model, timer=clock) is costs and len(clock.forwards) == 1 + 4 * 6  # remembered
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert measure_step_costs(model, timer=clock) is not costs  # another thread count: timed again
    finally:
        torch.set_num_threads(threads)
    # Real timing of a real (tiny) forward: positive, one-token forwards as the unit.
    real = measure_step_costs(tiny_llama(vocab_size=32, seed=1))
    assert real.one_token_s > 0 and real.relative[0] == 1.0 and len(real.relative) == MAX_VERIFY_TOKENS


def kept_entry(name):
    return measurements.stored(step_costs.STEP_COSTS_KEPT, step_costs._SOURCES)[name]


def test_a_cpu_targets_costs_are_kept_for_later_processes(kept_timings):
    model = tiny_llama(vocab_size=32, seed=0)
    clock = FakeClock(model, {1: 0.02, 2: 0.021, 3: 0.03, 4: 0.05})
    costs = measure_step_costs(model, timer=clock)
    later = tiny_llama(vocab_size=32, seed=0)  # the same weights, in a later process
    later_clock = FakeClock(later, {1: 0.015})
    kept = measure_step_costs(later, timer=later_clock)
    # (checked by a few one-token forwards: 0.02 kept is not more than twice 0.015 now)
    assert later_clock.forwards == [step_costs.CONTEXT] + [1] * (1 + step_costs.CHECKS)
    assert (kept.one_token_s, kept.relative) == (costs.one_token_s, costs.relative)
    name = step_costs._kept_name(later, torch.get_num_threads())
    assert kept.timed_on == kept_entry(name)["timed_on"]
    datetime.date.fromisoformat(kept.timed_on)
    assert costs.describe() + f", kept from {kept.timed_on}" == kept.describe()  # (said where they are reported)
    other = tiny_llama(vocab_size=32, seed=1)  # other weights: timed
    other_clock = FakeClock(other, {})
    assert measure_step_costs(other, timer=other_clock).relative == (1.0,) * MAX_VERIFY_TOKENS
    assert other_clock.forwards
    # Kept timings much slower than a one-token forward now were timed on a busy machine: timed again, replaced.
    busy = {**kept_entry(name), "one_token_s": 1.0, "relative": [1.0, 1.0, 1.0, 1.0]}
    measurements.store(step_costs.STEP_COSTS_KEPT, step_costs._SOURCES, name, busy)
    idle = tiny_llama(vocab_size=32, seed=0)
    retimed = measure_step_costs(idle, timer=FakeClock(idle, {1: 0.02, 2: 0.021, 3: 0.03, 4: 0.05}))
    assert retimed.relative == pytest.approx(costs.relative) and retimed.timed_on == ""
    assert kept_entry(name)["one_token_s"] == pytest.approx(0.02)
    # A kept date that is not one is not reported as one.
    measurements.store(step_costs.STEP_COSTS_KEPT, step_costs._SOURCES, name, {**kept_entry(name), "timed_on": "x"})
    fresh = tiny_llama(vocab_size=32, seed=0)
    assert measure_step_costs(fresh, timer=FakeClock(fresh, {})).timed_on == "an earlier process"
    # A kept entry that is not valid step costs is timed again.
    bad_costs = (
        {"one_token_s": 0.02, "relative": [2.0, 1.0, 1.0, 1.0]},
        {"one_token_s": 0.02, "relative": [0.5, 1.0, 1.1, 1.2]},  # (one token is 1 by definition; else plausible)
        {"one_token_s": -1},
        {"one_token_s": 0.02, "relative": [True, True, True, True]},
        {"one_token_s": 1e300, "relative": [1.0, 1.1, 1.2, 1.3]},
        {"one_token_s": 0.02, "relative": [1.0, 1e-9, 1.2, 1.3]},
        {"one_token_s": 10**400, "relative": [1.0, 1.1, 1.2, 1.3]},  # (too large for a float)
        {"one_token_s": 0.02, "relative": [1.0, 0.9, 0.98, 10.59]},  # (4 tokens dearer than 4 forwards: busy)
        [1.0],
    )
    for bad in bad_costs:
        measurements.store(step_costs.STEP_COSTS_KEPT, step_costs._SOURCES, name, bad)
        again = tiny_llama(vocab_size=32, seed=0)
        again_clock = FakeClock(again, {1: 0.02, 2: 0.021, 3: 0.03, 4: 0.05})
        assert measure_step_costs(again, timer=again_clock) == costs and again_clock.forwards  # (timed now)


def test_kept_costs_belong_to_one_dtype_thread_count_attention_and_kernel_setting(monkeypatch):
    model = tiny_llama(vocab_size=32, seed=0)
    threads = torch.get_num_threads()
    names = {step_costs._kept_name(model, threads), step_costs._kept_name(model, threads + 1)}
    with monkeypatch.context() as m:
        m.setattr(model.config, "_attn_implementation", "eager")
        names.add(step_costs._kept_name(model, threads))
    with monkeypatch.context() as m:
        m.setattr(model, cpu_kernels._MARK, True, raising=False)  # (given specframe's CPU kernels)
        names.add(step_costs._kept_name(model, threads))
        m.setattr(cpu_kernels, "layout_choice", "stock")
        names.add(step_costs._kept_name(model, threads))
    with monkeypatch.context() as m:
        m.setattr(transformers, "__version__", "99.0")
        names.add(step_costs._kept_name(model, threads))
    with monkeypatch.context() as m:
        m.setattr(lean_forward, "engine_forward", lambda model: model)  # (transformers' forward, not the lean one)
        names.add(step_costs._kept_name(model, threads))
    names.add(step_costs._kept_name(model.to(torch.bfloat16), threads))
    assert len(names) == 8


def test_a_drafter_is_timed_against_target_forwards_timed_alongside_it():
    # A busy machine slows the drafter's step and the target's forward alike: timed in turn, their ratio holds
    # (against the kept, idle one-token time, a loaded moment made a drafter step look 6.9 forwards, not 0.1);
    # and one busy moment does not decide: the fastest of the timed calls counts.
    model = tiny_llama(vocab_size=8, seed=0)
    order, clock = [], [0.0]
    real = step_costs._forward_calls

    def forward_calls(m, counts):
        call = real(m, counts)[1]
        return {1: lambda: (order.append("target"), call(), clock.__setitem__(0, clock[0] + 1.0))}

    def step():
        order.append("step")
        clock[0] += 5.0 if order.count("step") == 2 else 0.25  # (the first timed step caught a busy moment)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(step_costs, "_forward_calls", forward_calls)
        assert relative_cost(step, model, timer=lambda: clock[0]) == pytest.approx(0.25)
    assert order[:4] == ["step", "target", "step", "target"]  # (warm-ups, then alternating)
    assert order.count("step") == 1 + step_costs.REPEATS  # a warm-up, then the timed calls


def test_shape_choice_values():
    assert check_shape_choice(None, "x.json") == "saved"
    assert check_shape_choice("measured", "x.json") == "measured"
    with pytest.raises(ModelLoadError, match="shape_choice in x.json must be one of saved, measured, got 'fast'"):
        check_shape_choice("fast", "x.json")


def test_the_benchmark_names_the_measured_shapes_of_a_proposer_and_its_members():
    class P:
        def __init__(self, name, how=None, members=None):
            self.name, self.shape_choice, self.members = name, how, members

    union = P("union", members=[P("eagle", "chain of 2 (measured)"), P("ngram")])
    assert shape_choices(union) == ["eagle: chain of 2 (measured)"]
    assert shape_choices(P("none")) == []
    # generate's stats line names the measured shapes only (a union's own CPU member options were not timed)
    union.shape_choice = "on this CPU, ngram: 6 tokens (union.CPU_MEMBER_OPTIONS)"
    union.members[0].measured_shape = "chain of 2"
    assert measured_shapes(union) == ["eagle: chain of 2"]
    assert shapes_said(measured_shapes(union)) == "; eagle: chain of 2, chosen at load from this CPU's timings"
    assert measured_shapes(P("none")) == [] and shapes_said([]) == ""


def test_a_count_timed_dearer_than_its_tokens_one_by_one_is_timed_again():
    """A forward over n tokens costs at most n one-token forwards; a timing above that (a busy spell: one machine
    kept 10.6 one-token forwards for 4 tokens) is timed again, the fastest of both kept."""
    model = tiny_llama(vocab_size=32, seed=0)
    clock = FakeClock(model, {1: 0.02, 2: 0.021, 3: 0.03, 4: 0.05})
    busy_calls = [0]

    def busy_at_first(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 4 and busy_calls[0] < 1 + step_costs.REPEATS:
            busy_calls[0] += 1
            clock.now += 0.5 - 0.05  # (ten times its cost, every call of the first timing)

    model.register_forward_pre_hook(busy_at_first, with_kwargs=True)
    costs = measure_step_costs(model, timer=clock)
    assert costs.relative == pytest.approx((1.0, 1.05, 1.5, 2.5))
    assert clock.forwards.count(4) == 2 * (1 + step_costs.REPEATS)  # (timed twice)


def test_a_count_still_too_dear_when_timed_again_is_capped_and_not_kept(kept_timings):
    # (busy on both tries: 10.6 one-token forwards for 4 tokens steered the shape choice in this process, and was
    # stored for later ones, which refused it and timed again every time)
    model = tiny_llama(vocab_size=32, seed=0)
    clock = FakeClock(model, {1: 0.02, 2: 0.021, 3: 0.03, 4: 0.05})

    def always_busy(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 4:
            clock.now += 0.5 - 0.05

    model.register_forward_pre_hook(always_busy, with_kwargs=True)
    costs = measure_step_costs(model, timer=clock)
    assert costs.relative == pytest.approx((1.0, 1.05, 1.5, 4.0))  # (at most 4 one-token forwards)
    assert measurements.stored(step_costs.STEP_COSTS_KEPT, step_costs._SOURCES) == {}


def test_a_model_cast_or_moved_since_its_timing_is_timed_again():
    model = tiny_llama(vocab_size=32, seed=0)
    clock = FakeClock(model, {1: 0.02, 2: 0.021, 3: 0.03, 4: 0.05})
    costs = measure_step_costs(model, timer=clock)
    model.to(torch.bfloat16)
    assert measure_step_costs(model, timer=clock) is not costs


# Shapes whose online choice the previous step alone decides (no memory, almost no prior): after a step that
# accepted nothing a plain step, after one that accepted its drafts the deepest shape.
SWITCHING_GAMMAS = [
    ShapeCandidate(g, 1 + sum(0.5**i for i in range(1, g + 1)), g + 1, g, reach=tuple(0.5**i for i in range(1, g + 1)))
    for g in (1, 2, 3)
]


def switching(name):
    """A random-weight `draft`, `eagle` or `medusa` proposer class whose shape is re-chosen every step from the step
    before."""
    from specframe.proposers.draft import DraftProposer
    from specframe.proposers.eagle import EagleProposer, EagleShape
    from specframe.proposers.medusa import MedusaProposer

    if name == "draft":
        base, candidates, costs = DraftProposer, SWITCHING_GAMMAS, StepCosts(0.01, (1.0, 1.05, 1.1, 1.15))
    elif name == "medusa":
        base, costs = MedusaProposer, StepCosts(0.01, (1.0, 1.1, 1.15, 1.2))
        candidates = [
            ShapeCandidate(((0,),), 1.5, 2, reach=(0.5,)),
            ShapeCandidate(((0,), (1,)), 1.7, 3, reach=(0.7,)),
            ShapeCandidate(((0,), (0, 0)), 1.8, 3, reach=(0.5, 0.3)),
        ]
    else:
        base, costs = EagleProposer, StepCosts(0.01, (1.0, 1.1, 1.15, 1.2))
        candidates = [
            ShapeCandidate(EagleShape(1, 1, 1), 1.5, 2, 1, reach=(0.5,)),
            ShapeCandidate(EagleShape(2, 1, 2), 1.8, 3, 2, reach=(0.5, 0.3)),
            ShapeCandidate(EagleShape(2, 3, 3), 1.95, 4, 2, reach=(0.6, 0.35)),
        ]

    class Switching(base):
        @classmethod
        def random(cls, target, config=None, seed=0):
            proposer = super().random(target, config, seed)
            proposer.online = OnlineShapeChoice(candidates, costs, 0.02, prior_steps=0.05, memory=0.0)
            return proposer

    return Switching


@pytest.mark.parametrize("name", ["draft", "eagle", "medusa"])
def test_a_proposer_with_its_shape_rechosen_every_step_decodes_exactly_with_plain_steps_among_its_steps(name):
    # Which shape a step drafts depends on earlier steps' acceptance only, so the output is the target's greedy
    # output whatever the shapes; here a step after a rejection drafts nothing, one after an acceptance the most.
    from specframe import SpeculativeDecoder
    from specframe.decoder import target_info
    from specframe.testing.conformance import reference_greedy

    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)
    proposer = switching(name).random(target_info(target), seed=1)
    online, chosen = proposer.online, []
    observe = online.observe
    online.observe = lambda *args: chosen.append(online.current) or observe(*args)
    dec = SpeculativeDecoder(target, proposer)
    plain = 0
    for prompt in ([1, 2, 3], [5, 4], [7, 7, 7, 2]):
        got = dec.generate(prompt, max_new_tokens=24)
        assert got.token_ids == reference_greedy(target, prompt, 24)
        plain += got.stats["target_forwards"] - 1 - (got.stats["proposed_by_position"] or [0])[0]
    # (a step with one token left drafts nothing whatever the shape: 3 such; the others are the online choice's)
    assert chosen.count(0) > 3 and plain >= chosen.count(0) and {1, 2, 3} & set(chosen), (chosen, plain)
    # Each generation starts afresh (`begin` resets the choice): the same prompt, the same choices.
    runs = []
    for _ in range(2):
        chosen.clear()
        dec.generate([5, 4], max_new_tokens=24)
        runs.append(list(chosen))
        online.current, online.scale = 0, 0.0  # (as a generation may end: plain steps chosen)
    assert runs[0] == runs[1] and runs[0][0] == online.first
    # The choice follows the step before it: a plain step after a rejection, the deepest after an acceptance.
    online.reset()
    whole_step(online, 0)
    assert online.choose().shape is None
    online.current = 1
    whole_step(online, 1)
    assert online.choose() is online.candidates[-1]
    if name == "draft":
        assert proposer.gamma != 0  # (the γ chosen at load is kept; a step's own γ is its online choice)


@pytest.mark.parametrize("name", ["draft", "eagle", "medusa"])
def test_a_step_cut_short_by_the_token_budget_is_not_counted_as_its_shape(name):
    # The deepest shape (a chain of 3; EAGLE's 3-node tree, two levels; a 2-node Medusa chain) with one draft level
    # left: it is cut, and `observe` must not count its acceptance as that shape's, even where the cut step has
    # as many nodes (EAGLE's tree: its three candidates all at level 1).
    from specframe.decoder import target_info
    from specframe.testing.replay import fresh_proposal

    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)
    proposer = switching(name).random(target_info(target), seed=1)
    proposer.online.first = len(proposer.online.candidates) - 1  # (where `begin` starts the choice)
    tokens = torch.tensor([1, 2, 3, 4])
    assert fresh_proposal(proposer, target, tokens).tokens.numel() == (2 if name == "medusa" else 3)
    assert proposer.online.whole
    cut = fresh_proposal(proposer, target, tokens, max_depth=1)
    assert cut.tokens.numel() == (3 if name == "eagle" else 1) and not proposer.online.whole


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, setting",
    [
        ("draft", "temperature=1"),
        ("eagle", "temperature=1"),
        ("eagle", "temperature=1,penalties"),
        ("medusa", "temperature=1"),
    ],
)
def test_a_proposer_with_its_shape_rechosen_every_step_keeps_sampling_exact(name, setting):
    # The conformance suite's chi-square check, on a proposer whose every step's shape the step before decides.
    from specframe.testing.conformance import check_sampling

    result = check_sampling(switching(name), "cpu", setting)
    assert result.passed and result.drafted > 0, result.detail
