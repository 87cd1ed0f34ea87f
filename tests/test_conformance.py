"""The conformance suite over every registered proposer and both exact tree modes, and its power."""

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
from specframe.testing.suite import ProposerConformance, require_proposers
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
    for check in (conformance.check_greedy, conformance.check_rollback):
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


def test_greedy_check_allows_near_ties_only_in_16_bit_dtypes():
    from specframe.testing.tiny import tiny_llama

    for dtype, allowed in ((torch.float32, 0.0), (torch.bfloat16, 4 * 2**-7 * 5.0)):
        assert conformance.near_tie_tolerance(dtype, 5.0) == allowed
    model = tiny_llama(8, seed=0)
    out = conformance.reference_greedy(model, [1, 2, 3], 6)
    assert conformance.greedy_mismatch(model, [1, 2, 3], out) == (None, 0, "")
    logits = model(input_ids=torch.tensor([[1, 2, 3] + out[:2]])).logits[0, -1]
    wrong = int(logits.argsort(descending=True)[1])  # the runner-up at position 2: a real mismatch in float32
    bad, near, why = conformance.greedy_mismatch(model, [1, 2, 3], out[:2] + [wrong] + out[3:])
    assert (bad, near) == (2, 0) and f"token 2 is {wrong}" in why


def test_bad_conformance_dtype_or_device_is_named():
    from specframe.errors import BadInputError

    with pytest.raises(BadInputError, match="float8"):
        conformance.run_suite(TreeTestProposer, devices=["cpu"], dtypes=["float8"], quick=True)
    with pytest.raises(BadInputError, match="'gpu0' is not a device name"):
        conformance.run_suite(TreeTestProposer, devices=["gpu0"], quick=True)
    if not torch.cuda.is_available():
        with pytest.raises(BadInputError, match="CUDA is not available"):
            conformance.run_suite(TreeTestProposer, devices=["cuda"], quick=True)


@pytest.mark.slow
@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("case", [c[0] for c in conformance.power_cases()])
def test_broken_rules_are_caught(case, device):
    name, cls, config, acceptance, setting = next(c for c in conformance.power_cases() if c[0] == case)
    r = conformance.check_sampling(cls, device, setting, config=config, acceptance=acceptance)
    assert r.p_value < conformance.ALPHA, f"broken rule '{name}' was not caught: {r.detail} p={r.p_value}"


def test_chi_square_flags_impossible_outcome():
    probs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert conformance.chi_square(torch.tensor([50, 49, 1]), probs)[2] == 0.0
    assert conformance.chi_square(torch.tensor([50, 50, 0]), probs)[2] > 0.5


# The proposers' own weights in bfloat16 on a float32 target (what `dtype: auto` picks on CPUs with native bf16
# matmuls), whatever this machine's CPU: exactness must not depend on the drafter's precision.
class TestDraftBf16(ProposerConformance):
    proposer_class = DraftProposer
    proposer_config = DraftConfig(num_speculative_tokens=3, dtype="bfloat16")


class TestMedusaBf16(ProposerConformance):
    proposer_class = MedusaProposer
    proposer_config = MedusaConfig(dtype="bfloat16")


class TestEagleBf16(ProposerConformance):
    proposer_class = EagleProposer
    proposer_config = EagleConfig(depth=3, top_k=3, total_tokens=8, dtype="bfloat16")
