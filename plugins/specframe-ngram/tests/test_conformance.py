"""specframe's exactness conformance suite, run on `ngram` as any third-party plugin would run it."""

import pytest
from specframe_ngram import NgramConfig, NgramProposer

from specframe.testing.conformance import run_suite
from specframe.testing.suite import ProposerConformance


class TestNgramConformance(ProposerConformance):
    proposer_class = NgramProposer  # the defaults: a tree of up to 2 candidates (full suite, statistics included)


@pytest.mark.parametrize(
    "config",
    [
        NgramConfig(max_candidates=1),  # always a chain
        NgramConfig(max_ngram=2, min_ngram=1, num_speculative_tokens=3, max_candidates=4),  # wide, shallow trees
        NgramConfig(max_ngram=1, min_ngram=1, num_speculative_tokens=1, max_candidates=8),  # many siblings at depth 1
    ],
    ids=["chain", "wide", "flat"],
)
def test_other_shapes_greedy_and_rollback(config):
    report = run_suite(NgramProposer, devices=["cpu"], config=config, quick=True)
    assert report.passed, report.summary()
