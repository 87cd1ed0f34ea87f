"""The conformance suite over every registered proposer and both exact tree modes, and its power."""

import types

import pytest
import torch

from specframe import decoder as decoder_module
from specframe.kv_cache import keep_positions
from specframe.plugins import get_registry
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.medusa import MedusaConfig, MedusaProposer
from specframe.proposers.union import DEFAULT_MEMBERS
from specframe.testing import conformance
from specframe.testing.suite import VARIANT_SETTINGS, ProposerConformance, require_proposers
from specframe.testing.tiny import available_devices
from specframe.testing.tree_proposer import TreeConfig, TreeTestProposer

REGISTERED = get_registry().names()


def registered(name):
    if name == "union":
        require_proposers(*DEFAULT_MEMBERS)
    return get_registry().get(name).cls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("name", REGISTERED)
def test_registered_greedy_and_rollback(name, device, dtype):
    cls = registered(name)
    for check in (conformance.check_greedy, conformance.check_rollback, conformance.check_isolation):
        r = check(cls, device, dtype=dtype)
        assert r.passed, r.detail
        assert r.dtype == dtype


@pytest.mark.slow
@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("setting", list(conformance.SETTINGS))
@pytest.mark.parametrize("name", REGISTERED)
def test_registered_sampling(name, setting, device):
    r = conformance.check_sampling(registered(name), device, setting)
    assert r.passed, r.detail


class TestTreeDeterministic(ProposerConformance):
    proposer_class = TreeTestProposer
    proposer_config = TreeConfig(mode="deterministic", width=2, depth=2)


class TestTreeIID(ProposerConformance):
    proposer_class = TreeTestProposer
    proposer_config = TreeConfig(mode="iid", width=2, depth=2)


@pytest.mark.slow
@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("name", REGISTERED)
def test_registered_sampling_in_bfloat16(name, device):
    r = conformance.check_sampling(registered(name), device, "temperature=1", dtype="bfloat16")
    assert r.passed, r.detail


class PrivateRandomDraft(DraftProposer):
    """Draws from an unseeded generator of its own: the global ones untouched, one seed many outputs."""

    def draw(self, logits, state, q=None):
        from specframe.sampling import sampling_probs

        q = sampling_probs(logits, state.sampling) if q is None else q
        generator = torch.Generator(device=q.device)
        generator.seed()
        return torch.multinomial(q, 1, generator=generator), q


class NumpyPeekingDraft(DraftProposer):
    """Draws one number from NumPy's global generator per proposal and ignores it: the user's stream moves on."""

    def propose(self, state):
        import numpy

        numpy.random.random()
        return super().propose(state)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_isolation_catches_global_randomness_and_a_changed_target(dtype):
    from specframe.testing.broken import GlobalRandomDraft, RequestMemoryDraft, ReseedingDraft, TargetChangingDraft

    for cls in (GlobalRandomDraft, ReseedingDraft):  # (the second: one seed, one output; the user's RNG reset)
        r = conformance.check_isolation(cls, "cpu", dtype=dtype)
        assert not r.passed and "changed the global random generators" in r.detail, r.detail
    r = conformance.check_isolation(RequestMemoryDraft, "cpu", dtype=dtype)
    assert not r.passed and "keeps state from one request to the next" in r.detail, r.detail
    r = conformance.check_isolation(NumpyPeekingDraft, "cpu", dtype=dtype)  # (its draws change no output)
    assert not r.passed and "changed the global random generators" in r.detail, r.detail
    r = conformance.check_isolation(PrivateRandomDraft, "cpu", dtype=dtype)  # (not taken for kept state)
    assert not r.passed and "does not come from the engine's generator" in r.detail, r.detail
    r = conformance.check_isolation(TargetChangingDraft, "cpu", dtype=dtype)
    assert not r.passed and "changed the target's weights (lm_head.weight" in r.detail, r.detail
    # and the references are a fresh target's, so greedy output of the changed target is not taken for its own
    greedy = conformance.check_greedy(TargetChangingDraft, "cpu", dtype=dtype)
    assert not greedy.passed, greedy.detail


def test_isolation_puts_the_global_generators_back():
    import random

    torch.manual_seed(5)
    random.seed(5)
    before = torch.get_rng_state(), random.getstate()
    assert conformance.check_isolation(DraftProposer, "cpu").passed
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


def gather_the_first_rows(cache, start, keep, n_new):
    """A broken rollback: keeps the first len(keep) verified positions instead of the accepted tree path."""
    keep_positions(cache, start, list(range(len(keep))), n_new)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollback_check_catches_a_wrong_kept_cache(monkeypatch, dtype):
    # Wide deterministic trees accept paths that are not a prefix of the verified rows, so the wrong rows stay.
    # (Greedy output often survives such a cache on a tiny model: the rollback check is the one that must fail.)
    config = TreeConfig(mode="deterministic", width=3, depth=2)
    assert conformance.check_rollback(TreeTestProposer, "cpu", config, dtype).passed
    monkeypatch.setattr(decoder_module, "keep_positions", gather_the_first_rows)
    rollback = conformance.check_rollback(TreeTestProposer, "cpu", config, dtype)
    assert not rollback.passed, rollback.detail


class FixedLogits(torch.nn.Module):
    """A stand-in target whose logits at every position are one fixed row (greedy_mismatch's only input)."""

    def __init__(self, row, dtype):
        super().__init__()
        self.row, self.dtype, self.device = torch.tensor(row, dtype=dtype), dtype, torch.device("cpu")

    def forward(self, input_ids):
        return types.SimpleNamespace(logits=self.row.expand(*input_ids.shape, -1))

    def get_output_embeddings(self):
        return types.SimpleNamespace(weight=torch.zeros(self.row.numel(), 1))


def test_a_top_p_cut_that_rounding_can_move_is_moved_in_16_bit_dtypes_only():
    import math

    from specframe.sampling import SamplingParams, sampling_probs

    # the top token holds 0.9 of the mass: at top_p=0.9 whether the second is kept depends on the last bit
    row = [math.log(0.9), math.log(0.06), math.log(0.04)]
    case = conformance.SamplingCase(SamplingParams(1.0, 0, 0.9), prompt=(0,), lead=1)
    probs, unsettled = conformance.enumerate_continuations(FixedLogits(row, torch.bfloat16), [0], 4, case.params)
    assert unsettled == pytest.approx(4.0)  # every prefix of the 4 tokens: 1 per continuation per token
    one = sampling_probs(torch.tensor(row, dtype=torch.bfloat16).double(), case.params)  # every position's
    assert torch.allclose(probs, torch.einsum("a,b,c,d->abcd", one, one, one, one).reshape(-1))
    moved, at, nominal = conformance.settled_case(case, FixedLogits(row, torch.bfloat16))
    assert nominal == pytest.approx(4.0) and at <= conformance.UNSETTLED_MASS
    assert moved.params.top_p != 0.9 and moved.params.temperature == 1.0 and moved.prompt == case.prompt
    # float32 (rounding is then the decoder's exactness, not a tolerance) and a cut rounding cannot move: kept
    assert conformance.settled_case(case, FixedLogits(row, torch.float32)) == (case, 0.0, 0.0)
    far = conformance.SamplingCase(SamplingParams(1.0, 0, 0.5), prompt=(0,), lead=1)
    assert conformance.settled_case(far, FixedLogits(row, torch.bfloat16)) == (far, 0.0, 0.0)
    # top-k: a 2nd and 3rd token within rounding of each other
    tie = conformance.SamplingCase(SamplingParams(1.0, 2, 1.0), prompt=(0,), lead=1)
    moved, at, nominal = conformance.settled_case(tie, FixedLogits([2.0, 1.0, 0.99, -3.0], torch.bfloat16))
    assert nominal > conformance.UNSETTLED_MASS >= at and moved.params.top_k != 2
    # never to the whole vocabulary (no cut at all) nor to 1 (one continuation): top_k 3 of 4 may go to 2 only,
    # unsettled too here, so it stays
    close = conformance.SamplingCase(SamplingParams(1.0, 3, 1.0), prompt=(0,), lead=1)
    assert conformance.settled_case(close, FixedLogits([2.0, 1.0, 0.99, 0.98], torch.bfloat16))[:2] == (close, 4.0)
    # the last kept token dropped by a change within rounding: the top one up, it down (0.8995 + 0.0995 of 0.9)
    edge = conformance.SamplingCase(SamplingParams(1.0, 0, 0.9), prompt=(0,), lead=1)
    row = [math.log(0.8995), math.log(0.0995), math.log(0.001)]
    assert conformance.enumerate_continuations(FixedLogits(row, torch.bfloat16), [0], 2, edge.params)[1] > 0


def test_a_min_p_cut_that_rounding_can_move_is_moved_in_16_bit_dtypes_only():
    import math

    from specframe.sampling import SamplingParams

    # the second token is 0.2 times as likely as the top one: at min_p=0.2 whether it is kept depends on rounding
    row = [0.0, math.log(0.2), -3.0]
    case = conformance.SamplingCase(SamplingParams(1.0, 0, 1.0, 0.2), prompt=(0,), lead=1)
    moved, at, nominal = conformance.settled_case(case, FixedLogits(row, torch.bfloat16))
    assert nominal == pytest.approx(4.0) and at <= conformance.UNSETTLED_MASS
    assert moved.params == SamplingParams(1.0, 0, 1.0, moved.params.min_p) and moved.params.min_p != 0.2
    assert conformance.settled_case(case, FixedLogits(row, torch.float32)) == (case, 0.0, 0.0)
    far = conformance.SamplingCase(SamplingParams(1.0, 0, 1.0, 0.5), prompt=(0,), lead=1)
    assert conformance.settled_case(far, FixedLogits(row, torch.bfloat16)) == (far, 0.0, 0.0)


@pytest.mark.parametrize(
    ("draws", "confirm", "passed"),
    [("good", True, True), ("bad,good", True, True), ("bad,bad", True, False), ("bad", False, False)],
)
def test_a_sampling_check_below_alpha_is_sampled_again_on_fresh_seeds(monkeypatch, draws, confirm, passed):
    """A p-value below ALPHA is confirmed on fresh seeds (seeds from `samples` on): one unlucky draw of an exact
    proposer passes, two fail; unconfirmed (the power checks) one fails."""
    draws = draws.split(",")
    seeds = []

    def fake_counts(decoder, case, n, seed=0, drafts=None):
        seeds.append(seed)
        counts = torch.full((conformance.SAMPLING_VOCAB**conformance.CONTINUATION,), n // 512)
        if draws[len(seeds) - 1] == "bad":
            counts[0] += 400  # far too often
        return counts

    monkeypatch.setattr(conformance, "sample_counts", fake_counts)
    monkeypatch.setattr(conformance, "chi_square", lambda counts, probs: (0.0, 1, 1.0 if counts[0] < 100 else 1e-9))
    r = conformance.check_sampling(
        get_registry().get("none").cls, "cpu", "temperature=1", samples=1024, confirm=confirm
    )
    assert r.passed is passed, r.detail
    assert seeds == [0, 1024][: len(draws)]
    assert ("fresh seeds" in r.detail) == (len(draws) == 2)


def test_greedy_mismatch_allows_rounding_near_ties_only_in_16_bit_dtypes():
    # bfloat16 tolerance for a row of scale 4: 4 * 2^-7 * 4 = 0.125 per logit, so a gap up to 0.25 is a near-tie
    row = [4.0, 3.8, 3.5, -4.0]
    bf16 = FixedLogits(row, torch.bfloat16)
    assert conformance.rounding_tolerance(torch.bfloat16, bf16.row) == 0.125
    assert conformance.greedy_mismatch(bf16, [0], [0, 1, 0]) == (None, 1, "")  # gap 0.2: rounding
    bad, near, why = conformance.greedy_mismatch(bf16, [0], [0, 1, 2])  # gap 0.5: a wrong token
    assert (bad, near) == (2, 1) and "token 2 is 2, the target's argmax is 0" in why
    f32 = FixedLogits(row, torch.float32)
    assert conformance.greedy_mismatch(f32, [0], [0, 0]) == (None, 0, "")
    assert conformance.greedy_mismatch(f32, [0], [0, 1])[0] == 1  # float32: the argmax or nothing
    tie = FixedLogits([1.0, 1.0, 0.0], torch.float32)
    assert conformance.greedy_mismatch(tie, [0], [1])[0] == 0  # even an exact tie the argmax does not pick


def test_greedy_mismatch_on_a_real_tiny_target():
    from specframe.testing.tiny import tiny_llama

    model = tiny_llama(8, seed=0)
    out = conformance.reference_greedy(model, [1, 2, 3], 6)
    assert conformance.greedy_mismatch(model, [1, 2, 3], out) == (None, 0, "")
    logits = model(input_ids=torch.tensor([[1, 2, 3] + out[:2]])).logits[0, -1]
    wrong = int(logits.argsort(descending=True)[1])  # the runner-up at position 2
    bad, near, why = conformance.greedy_mismatch(model, [1, 2, 3], out[:2] + [wrong] + out[3:])
    assert (bad, near) == (2, 0) and f"token 2 is {wrong}" in why


def test_greedy_check_fails_on_too_many_near_ties_or_a_short_output(monkeypatch):
    monkeypatch.setattr(conformance, "greedy_mismatch", lambda model, prompt, out: (None, 3, ""))
    r = conformance.check_greedy(TreeTestProposer, "cpu", dtype="bfloat16")  # 9 of 96: allowed
    assert r.passed and "9 near-tie(s)" in r.detail
    monkeypatch.setattr(conformance, "greedy_mismatch", lambda model, prompt, out: (None, 4, ""))
    r = conformance.check_greedy(TreeTestProposer, "cpu", dtype="bfloat16")  # 12 of 96: too many
    assert not r.passed and "12 of 96 tokens were near-ties" in r.detail
    real_generate = decoder_module.SpeculativeDecoder.generate

    def one_short(self, *args, **kwargs):
        res = real_generate(self, *args, **kwargs)
        res.token_ids = res.token_ids[:-1]
        return res

    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "generate", one_short)
    r = conformance.check_greedy(TreeTestProposer, "cpu")
    assert not r.passed and "31 tokens, asked for 32" in r.detail


def test_bad_conformance_dtype_or_device_is_named():
    from specframe.errors import BadInputError

    with pytest.raises(BadInputError, match="unknown dtype 'float8'"):
        conformance.run_suite(TreeTestProposer, devices=["cpu"], dtypes=["float8"], quick=True)
    with pytest.raises(BadInputError, match="unknown device 'gpu0'"):
        conformance.run_suite(TreeTestProposer, devices=["gpu0"], quick=True)
    if not torch.cuda.is_available():
        with pytest.raises(BadInputError, match="CUDA is not available"):
            conformance.run_suite(TreeTestProposer, devices=["cuda"], quick=True)


def test_a_dtype_named_twice_runs_once():
    report = conformance.run_suite(TreeTestProposer, devices=["cpu"], dtypes=["float32", "float32"], quick=True)
    assert report.passed and len(report.results) == 3  # greedy, rollback, isolation: once


def test_one_device_or_dtype_may_be_given_as_a_string():
    # (not its letters: "bf16" as ["b", "f", "1", "6"] was refused as an unknown dtype 'b')
    assert conformance.suite_devices_and_dtypes("cpu", "bf16") == (["cpu"], ["bfloat16"])
    report = conformance.run_suite(TreeTestProposer, devices="cpu", dtypes="bfloat16", quick=True)
    assert report.passed and len(report.results) == 3


class RaisingDraft(DraftProposer):
    """Raises on its second proposal of a request."""

    def propose(self, state):
        if len(state.tokens) > 4:
            raise RuntimeError("boom\n  in propose")
        return super().propose(state)


class RaisingInRandom(DraftProposer):
    @classmethod
    def random(cls, target, config=None, seed=0):
        raise KeyError("boom in random()")


def test_a_proposer_that_raises_fails_its_checks_and_the_suite_goes_on():
    report = conformance.run_suite(RaisingDraft, devices=["cpu"], quick=True, power=False)
    assert [(r.check, r.passed) for r in report.results] == [(c, False) for c in ("greedy", "rollback", "isolation")]
    assert report.results[0].detail == "raised ProposerError: proposer 'draft' raised RuntimeError: boom in propose"
    report = conformance.run_suite(RaisingInRandom, devices=["cpu"], quick=True, power=False)
    assert not report.passed and len(report.results) == 3
    assert "proposer 'draft' failed to build its random-weight instance: KeyError: 'boom in random()'" in (
        report.results[0].detail
    )


class NeverDrafts(DraftProposer):
    def propose(self, state):
        from specframe import Proposal

        return Proposal.empty()


def test_a_proposer_that_drafts_nothing_fails_a_drafts_line_and_none_does_not():
    # (before: every check passed, having verified nothing the proposer proposes)
    report = conformance.run_suite(NeverDrafts, devices=["cpu"], quick=True, power=False)
    assert [(r.check, r.passed) for r in report.results] == [
        ("greedy", True), ("rollback", True), ("isolation", True), ("drafts", False)
    ]  # fmt: skip
    assert "drafted no token in greedy" in report.results[-1].detail and not report.passed
    assert "quick: sampling exactness NOT checked" in report.totals()
    from specframe.proposers.none import NoneProposer

    assert conformance.run_suite(NoneProposer, devices=["cpu"], quick=True, power=False).passed
    with pytest.raises(AssertionError, match="drafted no token"):
        ProposerConformance.test_greedy_identical_to_target(types.SimpleNamespace(
            proposer_class=NeverDrafts, proposer_config=None, target_arch="llama"), "cpu")  # fmt: skip


def test_debug_gives_the_traceback_of_what_a_check_raised():
    lines = []
    conformance.run_suite(RaisingDraft, devices=["cpu"], quick=True, power=False, log=lines.append, debug=True)
    trace = lines[1]
    assert trace.startswith("Traceback (most recent call last):") and "in propose\n    raise RuntimeError" in trace


def test_a_registered_plugin_s_failure_names_the_plugin():
    from specframe.plugins import get_registry

    entry = get_registry().get("draft")
    assert conformance.plugin_of(entry.cls) == "builtin" and conformance.plugin_of(RaisingDraft) == ""
    decoder = conformance.make_decoder(entry.cls, "cpu", conformance.SAMPLING_VOCAB)
    assert decoder.who == "proposer 'draft' (plugin 'builtin')"


def test_a_bad_option_still_stops_the_suite():
    from specframe.errors import ConfigError

    with pytest.raises(ConfigError, match="proposer.tree_nodes"):
        conformance.run_suite(MedusaProposer, devices=["cpu"], config=MedusaConfig(tree_nodes=4), quick=True)


def test_device_auto_runs_on_the_device_it_resolves_to(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = conformance.run_suite(TreeTestProposer, devices=["auto", "cpu"], quick=True, power=False)
    assert report.passed and {r.device for r in report.results} == {"cpu"}


@pytest.mark.slow
@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("case", [c[0] for c in conformance.power_cases()])
def test_broken_rules_are_caught(case, device):
    name, cls, config, acceptance, setting = next(c for c in conformance.power_cases() if c[0] == case)
    # (unconfirmed, as in check_power: one sample must catch a broken rule)
    r = conformance.check_sampling(cls, device, setting, config=config, acceptance=acceptance, confirm=False)
    assert r.p_value < conformance.ALPHA, f"broken rule '{name}' was not caught: {r.detail} p={r.p_value}"


def test_sampling_check_drafts_two_deep():
    """The counted continuation follows a lead token, so the first speculative step may draft two deep."""
    decoder = conformance.make_decoder(
        DraftProposer, "cpu", conformance.SAMPLING_VOCAB, config=DraftConfig(num_speculative_tokens=3)
    )
    seen = []
    propose = decoder.proposer.propose

    def spy(state):
        proposal = propose(state)
        seen.append((state.max_depth, len(proposal)))
        return proposal

    decoder.proposer.propose = spy
    counts = conformance.sample_counts(decoder, conformance.SETTINGS["temperature=1"], 20)
    assert int(counts.sum()) == 20 and counts.numel() == conformance.SAMPLING_VOCAB**conformance.CONTINUATION
    assert (2, 2) in seen and max(depth for depth, _ in seen) == 2


def test_chi_square_flags_impossible_outcome():
    probs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert conformance.chi_square(torch.tensor([50, 49, 1]), probs)[2] == 0.0
    assert conformance.chi_square(torch.tensor([50, 50, 0]), probs)[2] > 0.5


# The proposers' own weights in bfloat16 on a float32 target (what `dtype: auto` picks on CPUs with native bf16
# matmuls for a target off specframe's CPU kernels), whatever this machine's CPU: exactness must not depend on
# the drafter's precision.
class TestDraftBf16(ProposerConformance):
    proposer_class = DraftProposer
    proposer_config = DraftConfig(num_speculative_tokens=3, dtype="bfloat16")
    sampling_settings = VARIANT_SETTINGS


class TestMedusaBf16(ProposerConformance):
    proposer_class = MedusaProposer
    proposer_config = MedusaConfig(dtype="bfloat16")
    sampling_settings = VARIANT_SETTINGS


class TestEagleBf16(ProposerConformance):
    proposer_class = EagleProposer
    proposer_config = EagleConfig(depth=3, top_k=3, total_tokens=8, dtype="bfloat16")
    sampling_settings = VARIANT_SETTINGS


@pytest.mark.slow  # (two pytest subprocesses: about 20 s)
def test_the_pytest_plugin_gives_plugin_authors_the_marker_and_the_fixture(tmp_path):
    # A plugin author's test folder, outside this project (no pyproject: nothing configured but the plugin).
    import subprocess
    import sys

    (tmp_path / "test_mine.py").write_text(
        "from specframe.testing.suite import ProposerConformance\n"
        "from specframe.testing.tree_proposer import TreeTestProposer\n\n\n"
        "def test_exact(specframe_conformance):\n"
        "    assert specframe_conformance(TreeTestProposer, quick=True, devices=['cpu']).passed\n\n\n"
        "class TestTree(ProposerConformance):\n"
        "    proposer_class = TreeTestProposer\n"
    )
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--strict-markers", "-m", "not slow"]
    run = subprocess.run([*base, "-q", "test_mine.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout + run.stderr  # ("slow" is a known marker)
    plan = subprocess.run([*base, "--setup-plan", "test_mine.py"], cwd=tmp_path, capture_output=True, text=True)
    assert "_one_thread" in plan.stdout  # the suite's fixture reaches a subclass in another module


class _Metafunc:  # what ProposerConformance.pytest_generate_tests uses of pytest's Metafunc
    fixturenames = ("device", "setting")

    def parametrize(self, name, values):
        self.parametrized = (name, list(values))


def test_sampling_settings_choose_which_sampling_tests_a_class_runs():
    metafunc = _Metafunc()
    TestTreeIID().pytest_generate_tests(metafunc)  # the default: every setting
    assert metafunc.parametrized == ("setting", list(conformance.SETTINGS))
    TestDraftBf16().pytest_generate_tests(metafunc)
    assert metafunc.parametrized == ("setting", list(VARIANT_SETTINGS))
    assert set(VARIANT_SETTINGS) < set(conformance.SETTINGS)

    class Misspelt(ProposerConformance):
        proposer_class = TreeTestProposer
        sampling_settings = ("temperature=1", "temprature=0.7")

    with pytest.raises(ValueError, match=r"Misspelt.sampling_settings must name some of .*'temprature=0.7'"):
        Misspelt().pytest_generate_tests(metafunc)


class ReducedVocabularyDraft(DraftProposer):
    """The shipped draft's kind: a shared draft (the target's first layer, its embeddings) whose head scores only
    some of the target's tokens (`vocab_ids`), so q = 0 for the others, which only the residual can give."""

    @classmethod
    def random(cls, target, config=None, seed=0):
        from specframe.shared_draft import build_shared_draft

        vocab_ids = torch.tensor([0, 2, 3, 5, 7])  # 5 of the 8 tokens
        draft = build_shared_draft(target.model, 1, vocab_ids).eval()
        return cls(config or DraftConfig(num_speculative_tokens=3), target, draft, vocab_ids=vocab_ids)


def test_a_reduced_vocabulary_draft_proposes_only_its_tokens_with_q_zero_elsewhere():
    # (a head that gave tokens outside its vocabulary a logit of 0 rather than -inf stayed exact, so no check of
    # the output saw it: it proposed tokens it was never trained on)
    decoder = conformance.make_decoder(ReducedVocabularyDraft, "cpu", conformance.SAMPLING_VOCAB)
    inner, seen = decoder.proposer, []
    propose = inner.propose
    inner.propose = lambda state: seen.append(propose(state)) or seen[-1]
    for seed in range(5):
        decoder.generate([1, 2, 3], max_new_tokens=20, temperature=1.0, seed=seed)
    outside = torch.ones(conformance.SAMPLING_VOCAB, dtype=torch.bool)
    outside[inner.vocab_ids] = False
    assert sum(len(p) for p in seen) > 10
    for p in (p for p in seen if len(p)):  # (an empty proposal at the end of the budget has no rows)
        assert not outside[p.tokens].any() and p.draft_probs is not None
        assert torch.equal(p.draft_probs[:, outside], torch.zeros_like(p.draft_probs[:, outside]))


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["temperature=1", "temperature=1.5,top_k=5,top_p=0.8"])
def test_a_reduced_vocabulary_draft_samples_the_target_s_distribution(setting):
    decoder = conformance.make_decoder(ReducedVocabularyDraft, "cpu", conformance.SAMPLING_VOCAB)
    out = decoder.generate([1, 2, 3], max_new_tokens=40, temperature=1.0, seed=0)
    drafted = decoder.proposer.vocab_ids.tolist()
    assert out.stats["accepted_tokens"] > 0 and set(out.token_ids) - set(drafted)  # (both kinds of token occur)
    r = conformance.check_sampling(ReducedVocabularyDraft, "cpu", setting)
    assert r.passed, r.detail


# (tests from a mutation review of the conformance suite itself, 2026-12-06: each fails on the mutation it names)


def test_chi_square_gives_the_textbook_statistic_degrees_of_freedom_and_p():
    # 60/40 against a fair coin: chi2 = 4, 1 degree of freedom, p = 0.0455 (inflated degrees of freedom passed)
    stat, df, p = conformance.chi_square(torch.tensor([60, 40]), torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert stat == pytest.approx(4.0) and df == 1 and p == pytest.approx(0.0455, abs=1e-4)


def test_the_power_check_passes_a_broken_variant_only_when_its_sample_catches_it(monkeypatch):
    # (`specframe check` prints these lines; a constant `caught` passed every test)
    for p_value, caught in ((0.5, False), (1e-9, True)):
        result = conformance.CheckResult("sampling", "cpu", p_value >= conformance.ALPHA, "chi2=...", p_value)
        monkeypatch.setattr(conformance, "check_sampling", lambda *a, result=result, **k: result)
        results = conformance.check_power("cpu", samples=10)
        assert len(results) == len(conformance.power_cases())
        assert all(r.passed is caught and r.detail.startswith("caught" if caught else "NOT caught") for r in results)


def test_a_broken_variant_that_raises_is_a_failed_power_line_not_the_end_of_the_suite(monkeypatch):
    def raising(*a, **k):
        raise RuntimeError("the broken rule crashed")

    monkeypatch.setattr(conformance, "check_sampling", raising)
    results = conformance.check_power("cpu", samples=10)
    assert len(results) == len(conformance.power_cases()) and not any(r.passed for r in results)
    assert all("NOT caught: raised RuntimeError: the broken rule crashed" in r.detail for r in results)


def test_an_exact_proposer_fits_the_enumerated_continuations_with_the_lead_summed_out():
    # (the distribution summed over the continuations instead of the lead tokens passed the fast tests; 400
    # samples on fixed seeds, so the result is the same on every run)
    r = conformance.check_sampling(DraftProposer, "cpu", "temperature=1", samples=400, confirm=False)
    assert r.passed and r.p_value > 0.01, r.detail


def add_to_kept_keys(cache, start, keep, n_new):
    """A rollback that keeps the right positions but nudges the last kept key by 1e-2."""
    keep_positions(cache, start, keep, n_new)
    layer = cache.layers[0]
    layer.keys[..., start + len(keep) - 1, :] += 1e-2


def test_the_float32_rollback_check_sees_a_kept_cache_off_by_a_little(monkeypatch):
    # (a float32 tolerance of 1 logit instead of 1e-4 passed the test of whole wrong rows, which differ by more)
    config = TreeConfig(mode="deterministic", width=3, depth=2)
    monkeypatch.setattr(decoder_module, "keep_positions", add_to_kept_keys)
    rollback = conformance.check_rollback(TreeTestProposer, "cpu", config, "float32")
    assert not rollback.passed and "max |logit diff| " in rollback.detail, rollback.detail


class GlobalStatePeekingDraft(DraftProposer):
    """Reads the global torch generator's state (without drawing from it or changing it) to seed its own draws:
    one seed gives another output for each global state, and the global state is left as it was."""

    def draw(self, logits, state, q=None):
        from specframe.sampling import sampling_probs

        q = sampling_probs(logits, state.sampling) if q is None else q
        generator = torch.Generator(device=q.device).manual_seed(int(torch.get_rng_state()[:64].sum()))
        return torch.multinomial(q, 1, generator=generator), q


def test_isolation_runs_from_different_global_states():
    # (every run started from the same global state passed every broken proposer's test all the same)
    r = conformance.check_isolation(GlobalStatePeekingDraft, "cpu")
    assert not r.passed and "does not come from the engine's generator" in r.detail, r.detail


def test_the_exact_distribution_is_taken_at_the_cut_the_samples_were_drawn_at(monkeypatch):
    # (in a 16-bit dtype a cut that rounding can move is moved, `settled_case`; the reference taken at the nominal
    # cut while the samples came from the moved one passed every test: none samples in bfloat16 with a cut)
    import dataclasses

    from specframe.sampling import SamplingParams

    setting = "temperature=0.7,top_p=0.9"
    moved = dataclasses.replace(conformance.SETTINGS[setting], params=SamplingParams(0.7, 0, 0.85))
    monkeypatch.setattr(conformance, "settled_case", lambda case, model: (moved, 0.01, 0.2))
    drawn_at, taken_at = [], []
    real_exact = conformance.exact_distribution
    monkeypatch.setattr(
        conformance,
        "exact_distribution",
        lambda model, prompt, length, params: taken_at.append(params) or real_exact(model, prompt, length, params),
    )

    def counts(decoder, case, n, seed=0, drafts=None):
        drawn_at.append(case.params)
        return torch.ones(conformance.SAMPLING_VOCAB**conformance.CONTINUATION, dtype=torch.long)

    monkeypatch.setattr(conformance, "sample_counts", counts)
    r = conformance.check_sampling(DraftProposer, "cpu", setting, samples=10, confirm=False)
    assert drawn_at == taken_at == [moved.params] and "at top_p=0.85" in r.detail, r.detail


@pytest.mark.slow
def test_the_penalties_setting_catches_rows_penalised_with_the_roots_history(monkeypatch):
    # (a tree node's logits are penalised with its path's tokens: the root's history for every row moves p)
    real = decoder_module.path_entries
    monkeypatch.setattr(decoder_module, "path_entries", lambda structure, device: real(None, device))
    r = conformance.check_sampling(EagleProposer, "cpu", "temperature=1,penalties", confirm=False)
    assert not r.passed and r.p_value < 1e-20, r.detail
