"""The acceptance rule alone, with many draws: the emitted token must follow p exactly."""

import pytest
import torch

from specframe.acceptance import TreeAcceptance
from specframe.proposer import Proposal
from specframe.sampling import SamplingParams
from specframe.testing.broken import BROKEN_ACCEPTANCE
from specframe.testing.conformance import ALPHA, chi_square

V = 6
P_ROOT = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
Q_ROOT = torch.tensor([0.05, 0.1, 0.1, 0.5, 0.2, 0.05])


def first_token_counts(proposal: Proposal, n: int, rule=None, seed: int = 0) -> torch.Tensor:
    """Draw the first emitted token n times; the rows after the root are arbitrary (uniform) targets."""
    rule = rule or TreeAcceptance()
    logits = torch.zeros(len(proposal) + 1, V)
    logits[0] = P_ROOT.log()
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(n):
        path, nxt = rule(logits, proposal, SamplingParams(1.0), g)
        counts[proposal.tokens[path[0]] if path else nxt] += 1
    return counts


def det_children(tokens):
    t = torch.tensor(tokens)
    return Proposal(t, torch.full_like(t, -1), torch.ones(len(tokens), dtype=torch.bool))


def iid_children(n, seed=1):
    t = torch.multinomial(Q_ROOT, n, replacement=True, generator=torch.Generator().manual_seed(seed))
    return t


CASES = {
    "no proposal": Proposal.empty(),
    "deterministic chain": Proposal.chain(torch.tensor([3, 0])),
    "deterministic siblings": det_children([3, 0, 1]),
    "sibling repeats a rejected token": det_children([3, 3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deterministic_and_empty_proposals_emit_p(case):
    counts = first_token_counts(CASES[case], 6000)
    assert chi_square(counts, P_ROOT.double())[2] > ALPHA


def test_iid_siblings_emit_p():
    # Siblings must be fresh draws from q for every step; draw them here per call.
    g = torch.Generator().manual_seed(5)
    rule, counts = TreeAcceptance(), torch.zeros(V, dtype=torch.long)
    logits = torch.zeros(4, V)
    logits[0] = P_ROOT.log()
    for _ in range(6000):
        toks = torch.multinomial(Q_ROOT, 3, replacement=True, generator=g)
        prop = Proposal(toks, torch.full((3,), -1), torch.zeros(3, dtype=torch.bool), Q_ROOT.expand(3, V).clone())
        path, nxt = rule(logits, prop, SamplingParams(1.0), g)
        counts[toks[path[0]] if path else nxt] += 1
    assert chi_square(counts, P_ROOT.double())[2] > ALPHA


def test_broken_rules_are_biased_on_deterministic_siblings():
    for name in ("inverted_ratio", "residual_not_normalised"):
        counts = first_token_counts(det_children([3, 0]), 6000, rule=BROKEN_ACCEPTANCE[name]())
        assert chi_square(counts, P_ROOT.double())[2] < ALPHA, name


def test_zero_draft_probability_does_not_divide_by_zero():
    q = torch.zeros(1, V)
    q[0, 1] = 1.0
    # Token 0 "drawn" with q(0) = 0: u * 0 < p(0) accepts; nothing is NaN or out of range.
    prop = Proposal(torch.tensor([0]), torch.tensor([-1]), torch.tensor([False]), q)
    logits = torch.stack([P_ROOT.log(), torch.zeros(V)])
    path, nxt = TreeAcceptance()(logits, prop, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert path == [0] and 0 <= nxt < V


def test_residual_that_rounds_to_zero_keeps_r():
    r = torch.tensor([0.5, 0.5, 0.0])
    assert torch.equal(TreeAcceptance().residual(r, r.clone(), 0), r)


def test_greedy_follows_argmax_and_emits_it_at_the_first_mismatch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 0.0], [0.0, 0.0, 9.0], [0.0, 0.0, 0.0]])
    # root -> node0 (token 1, matches) -> node1 (token 1, target wants 0); node2 is a sibling of node0
    prop = Proposal(torch.tensor([1, 1, 2]), torch.tensor([-1, 0, -1]), torch.ones(3, dtype=torch.bool))
    path, nxt = TreeAcceptance()(logits, prop, SamplingParams(0.0), torch.Generator())
    assert path == [0] and nxt == 0


def test_bonus_token_after_a_fully_accepted_chain():
    logits = torch.tensor([[9.0, 0.0, 0.0], [0.0, 9.0, 0.0], [0.0, 0.0, 9.0]])
    path, nxt = TreeAcceptance()(logits, Proposal.chain(torch.tensor([0, 1])), SamplingParams(0.0), torch.Generator())
    assert path == [0, 1] and nxt == 2


@pytest.mark.parametrize("seed", range(5))
def test_sampled_bonus_token_comes_from_the_leafs_row(seed):
    # Rows peaked on tokens 0, 1 and 2: the chain [0, 1] is accepted, and the token after it is drawn from the
    # leaf's row (token 2), not from its parent's (token 1) or the root's.
    logits = torch.tensor([[30.0, 0.0, 0.0], [0.0, 30.0, 0.0], [0.0, 0.0, 30.0]])
    chain = Proposal.chain(torch.tensor([0, 1]), draft_probs=torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1]]))
    path, nxt = TreeAcceptance()(logits, chain, SamplingParams(1.0), torch.Generator().manual_seed(seed))
    assert path == [0, 1] and nxt == 2


def test_each_row_walked_is_transformed_once():
    # (the leaf's row was transformed twice, once for nothing: with top-p a sort of the whole vocabulary, paid by
    # every step of plain decoding)
    seen: list[int] = []

    class Counting(TreeAcceptance):
        def target_probs(self, logits, row, params):
            seen.append(row)
            return super().target_probs(logits, row, params)

    logits = torch.tensor([[30.0, 0.0, 0.0], [0.0, 30.0, 0.0], [0.0, 0.0, 30.0]])
    chain = Proposal.chain(torch.tensor([0, 1]), draft_probs=torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1]]))
    Counting()(logits, chain, SamplingParams(1.0, top_p=0.9), torch.Generator().manual_seed(0))
    assert seen == [0, 1, 2]
    seen.clear()
    Counting()(logits, Proposal.chain(torch.tensor([], dtype=torch.long)), SamplingParams(1.0), torch.Generator())
    assert seen == [0]


def test_draft_rows_are_used_as_the_distribution_they_were_drawn_from():
    # torch.multinomial draws from a row over its sum, and validation lets a row's sum be off by rounding: the rule
    # reads q the same way, so a scaled row decides exactly as the normalised one (it compared u * q(x) < r(x)
    # with the raw row, biased by the scale).
    logits = torch.zeros(3, V)
    logits[0] = P_ROOT.log()
    toks = torch.tensor([3, 4])
    for scale in (0.5, 0.999):
        for seed in range(300):
            decided = []
            for q in (Q_ROOT, Q_ROOT * scale):
                prop = Proposal(toks, torch.tensor([-1, -1]), torch.zeros(2, dtype=torch.bool), q.expand(2, V).clone())
                decided.append(TreeAcceptance()(logits, prop, SamplingParams(1.0), torch.Generator().manual_seed(seed)))
            assert decided[0] == decided[1], (scale, seed)


def test_siblings_drawn_from_different_qs_each_use_their_own():
    """Two sampled siblings at one root, drawn from two different q's (as two sampled union members propose):
    each is judged by the q it was drawn from (a rule that used the first sibling's q for both was caught only
    by the slow union statistics)."""
    q_other = torch.tensor([0.4, 0.05, 0.05, 0.05, 0.05, 0.4])
    g = torch.Generator().manual_seed(3)
    rule, counts = TreeAcceptance(), torch.zeros(V, dtype=torch.long)
    logits = torch.zeros(3, V)
    logits[0] = P_ROOT.log()
    for _ in range(6000):
        toks = torch.cat([torch.multinomial(q, 1, generator=g) for q in (Q_ROOT, q_other)])
        prop = Proposal(toks, torch.tensor([-1, -1]), torch.zeros(2, dtype=torch.bool), torch.stack([Q_ROOT, q_other]))
        path, nxt = rule(logits, prop, SamplingParams(1.0), g)
        counts[toks[path[0]] if path else nxt] += 1
    assert chi_square(counts, P_ROOT.double())[2] > ALPHA


def test_a_rare_deterministic_child_is_accepted_as_rarely_as_p_says():
    """p(x) = 1e-4 at the root and a deterministic child proposing x: accepted with probability 1e-4, about 2 in
    20,000 (the uniform draw in bfloat16 is 0 one time in ~500 and accepted it 40 times)."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.0999, 0.0, 1e-4])
    logits = torch.stack([(p / p.sum()).log(), torch.zeros(V)])
    g, rule = torch.Generator().manual_seed(0), TreeAcceptance()
    accepted = sum(
        bool(rule(logits, Proposal.chain(torch.tensor([5])), SamplingParams(1.0), g)[0]) for _ in range(20000)
    )
    assert accepted <= 12  # (Poisson(2): more than 12 has probability below 1e-6)


def test_a_sampled_child_with_a_tiny_q_is_accepted_with_probability_r_over_q():
    """q(x) = 1e-9 and r(x) = 5e-10: accepted half the time (a q rounded to float16 is 0 there: always)."""
    q = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 1e-9])
    p = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 5e-10])
    logits = torch.stack([p.log(), torch.zeros(V)])
    prop = Proposal(torch.tensor([5]), torch.tensor([-1]), torch.tensor([False]), q[None].clone())
    g, rule = torch.Generator().manual_seed(0), TreeAcceptance()
    rate = sum(bool(rule(logits, prop, SamplingParams(1.0), g)[0]) for _ in range(4000)) / 4000
    assert 0.45 <= rate <= 0.55  # (binomial sd 0.008)


def test_greedy_reads_each_nodes_own_parents_row():
    # A root child listed after a deeper node: its row is the root's (row 0), not its index's. Row 2 (node 1's)
    # wants token 2, the root wants 1: node 2 (token 1, a root child) is accepted, then row 3 (node 2's) says 0.
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]])
    prop = Proposal(torch.tensor([2, 2, 1]), torch.tensor([-1, 0, -1]), torch.ones(3, dtype=torch.bool))
    path, nxt = TreeAcceptance()(logits, prop, SamplingParams(0.0), torch.Generator())
    assert path == [2] and nxt == 0
