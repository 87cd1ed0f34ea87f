"""The conformance suite over every registered proposer and both exact tree modes, and its power."""

import pytest

from specframe.plugins import get_registry
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.medusa import MedusaConfig, MedusaProposer
from specframe.testing import conformance
from specframe.testing.suite import ProposerConformance
from specframe.testing.tiny import available_devices
from specframe.testing.tree_proposer import TreeConfig, TreeTestProposer

REGISTERED = get_registry().names()


def registered(name):
    if name == "union" and "ngram" not in get_registry().proposers:
        pytest.skip("union's default members include the ngram plugin: pip install ./plugins/specframe-ngram")
    return get_registry().get(name).cls


@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("name", REGISTERED)
def test_registered_greedy_and_rollback(name, device):
    cls = registered(name)
    for check in (conformance.check_greedy, conformance.check_rollback):
        r = check(cls, device)
        assert r.passed, r.detail


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
@pytest.mark.parametrize("case", [c[0] for c in conformance.power_cases()])
def test_broken_rules_are_caught(case, device):
    name, cls, config, acceptance, setting = next(c for c in conformance.power_cases() if c[0] == case)
    r = conformance.check_sampling(cls, device, setting, config=config, acceptance=acceptance)
    assert r.p_value < conformance.ALPHA, f"broken rule '{name}' was not caught: {r.detail} p={r.p_value}"


def test_chi_square_flags_impossible_outcome():
    import torch

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
