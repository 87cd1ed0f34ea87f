"""Unit tests of the n-gram index, the trie and the proposer's contract with the engine."""

import pytest
import torch
from specframe_ngram import NgramConfig, NgramIndex, NgramProposer, build_trie
from torch.overrides import TorchFunctionMode

from specframe import DecodeState, SamplingParams, SpeculativeDecoder
from specframe.decoder import target_info
from specframe.errors import ConfigError
from specframe.proposer import Acceptance, validate_proposal
from specframe.testing.replay import fresh_proposal, recorded_proposals
from specframe.testing.tiny import tiny_llama


def make_proposer(vocab_size: int = 50, **config) -> NgramProposer:
    return NgramProposer.random(target_info(tiny_llama(vocab_size)), NgramConfig(**config))


def state(tokens: list[int], max_depth: int = 100) -> DecodeState:
    return DecodeState(torch.tensor(tokens), 1, SamplingParams(), torch.Generator(), max_depth)


def propose(proposer: NgramProposer, tokens: list[int], max_depth: int = 100):
    proposer.begin(torch.tensor(tokens[:1]), {})
    p = proposer.propose(state(tokens, max_depth))
    validate_proposal(p, proposer.target.vocab_size, max_depth, "ngram")
    return p


def test_index_prefers_longest_match_then_most_recent():
    index = NgramIndex(1, 3)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 6, 1, 2, 3])
    # suffix (1, 2, 3) occurs at 0 (followed by 4); (2, 3) also at 5 and 9 (followed by 5, 6).
    assert index.continuations(2, 3, 16) == [[4, 9], [6, 1], [5, 7]]
    assert index.continuations(2, 1, 16) == [[4, 9]]


def test_index_looks_at_the_most_recent_max_positions_occurrences():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 9, 1, 2, 8, 1, 2])  # (1, 2) followed by 9, then by 8; the last one is the suffix itself
    assert index.continuations(1, 4, 1) == [[8]]  # (max_positions=1: the most recent occurrence only)
    assert index.continuations(1, 4, 2) == [[8], [9]] == index.continuations(1, 4, 3)


def test_index_skips_continuations_that_add_nothing():
    index = NgramIndex(1, 2)
    index.extend([5, 6, 7, 5, 6, 7, 5, 6])
    # (5, 6) at 0 and 3, both followed by 7, 5...; the later one is clipped by the sequence's end.
    assert index.continuations(3, 4, 16) == [[7, 5, 6]]


def test_trie_shares_prefixes_in_topological_order():
    tokens, parents = build_trie([[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]])
    assert tokens == [1, 2, 3, 4, 5]
    assert parents == [-1, 0, 1, 1, -1]


def test_propose_chain_tree_and_nothing():
    p = propose(make_proposer(max_candidates=1, num_speculative_tokens=3), [1, 2, 3, 4, 5, 9, 2, 3])
    assert p.tokens.tolist() == [4, 5, 9] and p.is_chain() and bool(p.deterministic.all())
    p = propose(make_proposer(max_candidates=2, num_speculative_tokens=2), [1, 2, 3, 1, 2, 4, 1, 2])
    assert p.tokens.tolist() == [4, 1, 3, 1] and p.parents.tolist() == [-1, 0, -1, 2]
    assert len(propose(make_proposer(), [1, 2, 3, 4])) == 0  # nothing repeats


def test_respects_max_depth_and_ngram_range():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert propose(make_proposer(), tokens, max_depth=2).tokens.tolist() == [4, 5]
    assert len(propose(make_proposer(), tokens, max_depth=0)) == 0
    # only 4-grams: (7, 1, 2, 3) never occurred before
    assert len(propose(make_proposer(min_ngram=4, max_ngram=4), tokens)) == 0


def test_index_follows_the_sequence_across_steps():
    proposer = make_proposer(min_ngram=1, max_candidates=1, num_speculative_tokens=2)
    proposer.begin(torch.tensor([1, 2, 3, 4]), {})
    assert proposer.propose(state([1, 2, 3, 4, 1])).tokens.tolist() == [2, 3]
    # two tokens emitted since; drafts are never indexed, so nothing to roll back
    assert proposer.propose(state([1, 2, 3, 4, 1, 2, 7, 3])).tokens.tolist() == [4, 1]
    # a shorter, unrelated sequence without begin(): start over rather than use a stale index
    assert proposer.propose(state([6, 6])).tokens.tolist() == [6]


class CountTolist(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))


def test_emitted_tokens_come_from_accepted_not_from_the_device():
    proposer = make_proposer(min_ngram=1, max_candidates=1, num_speculative_tokens=2)
    proposer.begin(torch.tensor([1, 2, 3, 4]), {})
    proposer.propose(state([1, 2, 3, 4, 1]))  # (the first root: read from the sequence)
    proposer.accepted(Acceptance([0], [2], 7, {}))
    with CountTolist() as reads:
        p = proposer.propose(state([1, 2, 3, 4, 1, 2, 7]))
    assert reads.count == 0  # (on a GPU each read would wait for the queued kernels)
    assert proposer.index.seq == [1, 2, 3, 4, 1, 2, 7] and p.tokens.tolist() == []
    # tokens that do not add up with what accepted() said: read from the sequence after all
    proposer.accepted(Acceptance([], [], 3, {}))
    assert proposer.propose(state([1, 2, 3, 4, 1, 2, 7, 5, 3])).tokens.tolist() == [4, 1]
    assert proposer.index.seq == [1, 2, 3, 4, 1, 2, 7, 5, 3]


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"max_ngram": 0}, "proposer.max_ngram"),
        ({"num_speculative_tokens": -1}, "proposer.num_speculative_tokens"),
        ({"max_candidates": True}, "proposer.max_candidates"),
        ({"min_ngram": 4, "max_ngram": 3}, "proposer.min_ngram"),
    ],
)
def test_config_errors_name_the_full_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        NgramConfig(**overrides)


@pytest.mark.parametrize("max_candidates", [1, 4])
def test_speeds_up_repetitive_greedy_output(max_candidates):
    model = tiny_llama(8, seed=3)
    proposer = NgramProposer.random(target_info(model), NgramConfig(max_candidates=max_candidates))
    decoder = SpeculativeDecoder(model, proposer)
    res = decoder.generate([1, 2, 3], max_new_tokens=64, temperature=0.0)
    assert res.stats["accepted_tokens"] > 0 and res.stats["mean_accepted_length"] > 1.5


@pytest.mark.parametrize("max_candidates", [1, 4])
def test_after_steps_it_proposes_as_a_new_proposer_on_the_same_tokens(max_candidates):
    """The index kept across steps (the emitted tokens added at each) holds what one built from the whole
    sequence holds: each step's proposal is a new proposer's on the same tokens."""
    model = tiny_llama(8, seed=3)
    config = NgramConfig(max_candidates=max_candidates, max_ngram=3)
    proposer = NgramProposer.random(target_info(model), config)
    steps = recorded_proposals(proposer)
    res = SpeculativeDecoder(model, proposer).generate([1, 2, 3], max_new_tokens=64, temperature=0.0)
    assert res.stats["accepted_tokens"] > 0 and len(steps) > 10
    assert proposer.index.seq == [] and proposer.emitted == []  # (the request's index let go when it ended)
    for step in steps:
        again = fresh_proposal(NgramProposer.random(target_info(model), config), model, step.tokens, step.max_depth)
        assert (again.tokens.tolist(), again.parents.tolist()) == (
            step.proposal.tokens.tolist(),
            step.proposal.parents.tolist(),
        )


def test_a_continuation_that_is_a_prefix_of_one_found_takes_no_candidate():
    index = NgramIndex(1, 2)
    #            0  1  2  3  4  5  6  7  8  9 10
    index.extend([1, 2, 3, 1, 2, 4, 7, 2, 3, 1, 2])
    # (1, 2) at 3 gives 4 7 2 3, at 0 gives 3 1 2 4; (2,) at 7 gives 3 1 2, a prefix of the second: left out
    assert index.continuations(4, 3, 16) == [[4, 7, 2, 3], [3, 1, 2, 4]]


def test_a_match_cut_short_by_the_end_gives_way_to_an_older_one_that_extends_it():
    # (the most recent match in repeating text gave only the tokens left before the end: a chain of max_candidates
    # 1, union's on a CPU, drafted 2 tokens of 6 here)
    index = NgramIndex(1, 3)
    index.extend([1, 2, 1, 2, 1, 2, 1, 2])
    assert index.continuations(6, 1, 16) == [[1, 2, 1, 2, 1, 2]]
    assert index.continuations(6, 2, 16) == [[1, 2, 1, 2, 1, 2]]  # (one continuation: the others are its prefixes)
    once = NgramIndex(1, 3)  # (no older occurrence: the short one stays)
    once.extend([4, 9, 8, 7, 9, 8, 7])
    assert once.continuations(6, 1, 16) == [[9, 8, 7]]


def test_a_continuation_that_extends_one_found_replaces_it():
    index = NgramIndex(1, 2)
    index.extend([5, 6, 7, 5, 6, 7, 5, 6])
    # (5, 6) at 3 gives 7 5 6 (the sequence ends), at 0 gives 7 5 6 7, which holds it: one candidate
    assert index.continuations(4, 4, 16) == [[7, 5, 6, 7]]
