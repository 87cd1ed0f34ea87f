"""Proposers draft under the target's penalties (repetition, presence, frequency): `DecodeState.penalised`."""

import pytest
import torch

from specframe import SamplingParams, SpeculativeDecoder
from specframe.decoder import ProposalStructure, path_entries, target_info
from specframe.proposer import DecodeState
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.medusa import MedusaConfig, MedusaProposer
from specframe.sampling import History
from specframe.testing.tiny import tiny_llama

PENALTIES = SamplingParams(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.9)


def test_a_drafts_penalties_are_the_targets_rows_own():
    # DecodeState.penalised(row, drafted=path to node i) equals the engine's penalised row of node i
    torch.manual_seed(0)
    vocab, prompt_length = 16, 5
    tokens = torch.tensor([1, 2, 3, 3, 9, 4, 4, 7, 2])  # prompt 5 tokens, output 4 (the root, 2, the last)
    parents = [-1, -1, 0, 0, 2, 4]
    drafted = [4, 7, 7, 11, 4, 2]
    structure = ProposalStructure(drafted, parents, [True] * 6, [1, 1, 2, 2, 3, 4])
    logits = torch.randn(7, vocab) * 3
    history = History(tokens[:prompt_length], vocab, tokens[prompt_length:])
    want = history.penalised(logits, PENALTIES, *path_entries(structure, torch.device("cpu")))
    # (a state made by hand, which counts the tokens itself, and one with the engine's history, as the engine's have)
    for state in (
        DecodeState(tokens, prompt_length, PENALTIES, torch.Generator(), 8),
        DecodeState(tokens, prompt_length, PENALTIES, torch.Generator(), 8, history),
    ):
        torch.testing.assert_close(state.penalised(logits[0]), want[0], rtol=0, atol=0)
        for node in range(6):
            path, at = [], node
            while at >= 0:
                path.insert(0, drafted[at])
                at = parents[at]
            got = state.penalised(logits[node + 1], torch.tensor(path))
            torch.testing.assert_close(got, want[node + 1], rtol=0, atol=0)
            # rows of one depth at once (a path a row, or one for all), and a reduced vocabulary's columns (ids
            # outside them never count)
            two = state.penalised(logits[[node + 1, node + 1]], torch.tensor([path, path]))
            torch.testing.assert_close(two, want[[node + 1, node + 1]], rtol=0, atol=0)
            shared = state.penalised(logits[[node + 1, node + 1]], torch.tensor(path))
            torch.testing.assert_close(shared, want[[node + 1, node + 1]], rtol=0, atol=0)
            for columns in (torch.tensor([0, 2, 3, 7]), torch.tensor([11, 4, 0, 15, 2])):
                reduced = state.penalised(logits[node + 1, columns], torch.tensor(path), columns)
                torch.testing.assert_close(reduced, want[node + 1, columns], rtol=0, atol=0)
                rows = state.penalised(
                    logits[[node + 1, 0]][:, columns], torch.tensor([path, [4] * len(path)]), columns
                )
                torch.testing.assert_close(rows[0], want[node + 1, columns], rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"drafted must be \[d\] .* or \[R, d\] .* with R = 2, the logits' rows"):
            state.penalised(logits[:2], torch.tensor([[4, 7], [7, 4], [2, 2]]))
    assert not torch.equal(want[1], history.penalised(logits[1:2], PENALTIES)[0])  # (the path counts)
    plain = DecodeState(tokens, prompt_length, SamplingParams(), torch.Generator(), 8)
    assert plain.penalised(logits) is logits  # (no penalty: the logits themselves, nothing computed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_target_drafting_for_itself_under_penalties_is_always_accepted(temperature):
    # q is then p exactly, penalties included: every draft is accepted (drafting without them, few are)
    target = tiny_llama(vocab_size=32, seed=3)
    dec = SpeculativeDecoder(target, DraftProposer(DraftConfig(num_speculative_tokens=3), target_info(target), target))
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    res = dec.generate(prompt, 33, temperature, seed=0, repetition_penalty=1.5, frequency_penalty=0.8)
    assert res.stats["acceptance_rate"] == 1.0 and res.stats["target_forwards"] == 9, res.stats  # (1 + 8 x 4)


def test_eagle_scores_each_node_s_children_with_its_own_path():
    # Drafter logits that do not depend on the feature: A > B > C by less than the presence penalty. Each level's
    # best child is the one its path has not used yet: a chain A, B, C (the root's history alone: A, A, A).
    target = tiny_llama(vocab_size=32, seed=3)
    info = target_info(target)
    proposer = EagleProposer.random(info, EagleConfig(tree=False, depth=3), seed=1)
    ids = proposer.vocab_ids.tolist()
    a, b, c = ids[3], ids[5], ids[7]
    fixed = torch.zeros(len(ids))
    fixed[[3, 5, 7]] = torch.tensor([3.0, 2.5, 2.0])
    proposer.drafter.logits = lambda feats: fixed.expand(*feats.shape[:-1], -1)
    proposals = []
    real = proposer.propose
    proposer.propose = lambda state: proposals.append((state.tokens.tolist(), real(state))) or proposals[-1][1]
    dec = SpeculativeDecoder(target, proposer)
    prompt = [a, b, c, 1, 2]  # (in the prompt: presence counts only the output)
    dec.generate(prompt, 8, presence_penalty=2.0)
    for tokens, proposal in proposals:
        output = set(tokens[len(prompt) :])
        want, path = [], []
        for _ in range(3):
            scores = {t: float(fixed[ids.index(t)]) - 2.0 * (t in output or t in path) for t in (a, b, c)}
            path.append(max(scores, key=scores.get))
            want.append(path[-1])
        assert proposal.tokens.tolist() == want[: len(proposal)], (tokens, proposal.tokens.tolist())
    assert any(len(set(p.tokens.tolist())) == 3 for _, p in proposals)
    proposals.clear()
    dec.generate(prompt, 8)
    assert all(p.tokens.tolist() == [a] * len(p) for _, p in proposals) and len(proposals[0][1]) == 3


def test_medusa_ranks_its_candidates_on_penalised_logits(monkeypatch):
    target = tiny_llama(vocab_size=32, seed=3)
    proposer = MedusaProposer.random(target_info(target), MedusaConfig(tree=[[0], [0, 0]]), seed=1)
    seen = []
    real = DecodeState.penalised

    def recorded(self, logits, drafted=None, columns=None):
        out = real(self, logits, drafted, columns)
        seen.append((logits, out, columns))
        return out

    monkeypatch.setattr(DecodeState, "penalised", recorded)
    proposals = []
    real_propose = proposer.propose
    proposer.propose = lambda state: proposals.append(real_propose(state)) or proposals[-1]
    dec = SpeculativeDecoder(target, proposer)
    dec.generate([1, 2, 3, 4, 5, 1, 2, 3], 12, presence_penalty=2.0, frequency_penalty=2.0)
    proposals = [p for p in proposals if len(p)]  # (the last, with no budget left, drafts nothing)
    assert len(seen) == len(proposals) > 0
    changed = 0
    for (logits, out, columns), proposal in zip(seen, proposals, strict=True):
        assert logits.shape[0] == len(proposal)  # (a row per head used: both, but where the budget cuts)
        tops = columns[out.argmax(-1)]
        assert proposal.tokens.tolist() == tops.tolist()  # head 1's best, then head 2's
        changed += not torch.equal(columns[logits.argmax(-1)], tops)
    assert changed > 0  # (the penalties moved some candidates)
