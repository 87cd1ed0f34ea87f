"""specframe's exactness conformance suite, run on `ngram` as any third-party plugin would run it."""

from specframe.testing.suite import ProposerConformance

from specframe_ngram import NgramConfig, NgramProposer


class TestNgramDefaults(ProposerConformance):
    proposer_class = NgramProposer  # the defaults: a tree of up to 2 candidates


class TestNgramWideTree(ProposerConformance):
    proposer_class = NgramProposer
    proposer_config = NgramConfig(max_ngram=2, min_ngram=1, num_speculative_tokens=3, max_candidates=4)


class TestNgramChain(ProposerConformance):
    proposer_class = NgramProposer
    proposer_config = NgramConfig(max_candidates=1)
