import random
import re

import numpy as np
import pytest
import torch

from specframe import Proposal, Proposer, SamplingParams, SpeculativeDecoder
from specframe.decoder import Ends, target_info
from specframe.errors import BadInputError, ConfigError, ProposerError, SpecframeError
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.none import NoneConfig, NoneProposer
from specframe.testing.conformance import reference_greedy
from specframe.testing.replay import fresh_proposal, recorded_proposals
from specframe.testing.tiny import tiny_llama


def none_decoder(target):
    return SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)))


def self_draft_decoder(target, gamma=3):
    """The target drafting for itself: every draft is accepted under greedy decoding."""
    return SpeculativeDecoder(
        target, DraftProposer(DraftConfig(num_speculative_tokens=gamma), target_info(target), target)
    )


def test_none_is_plain_decoding_with_mean_accepted_length_one(target):
    res = none_decoder(target).generate([1, 2, 3], max_new_tokens=10)
    assert res.token_ids == reference_greedy(target, [1, 2, 3], 10)
    s = res.stats
    assert s["new_tokens"] == 10 and s["target_forwards"] == 10 and s["mean_accepted_length"] == 1.0
    assert s["proposed_tokens"] == 0 and s["acceptance_rate"] is None and s["finish_reason"] == "length"


def test_stats_definitions_with_a_perfect_draft(target):
    res = self_draft_decoder(target, gamma=3).generate([1, 2, 3], max_new_tokens=9)
    s = res.stats
    # prefill emits 1 token, then each step accepts 3 drafts + 1 bonus token: 1 + 4 + 4 = 9 tokens, 3 forwards
    assert s["target_forwards"] == 3 and s["new_tokens"] == 9 and s["mean_accepted_length"] == 3.0
    assert s["proposed_tokens"] == 6 and s["accepted_tokens"] == 6 and s["acceptance_rate"] == 1.0
    assert s["accepted_by_position"] == [2, 2, 2]
    assert s["wall_time_s"] > 0 and s["tokens_per_s"] == pytest.approx(9 / s["wall_time_s"])
    assert res.token_ids == reference_greedy(target, [1, 2, 3], 9)


def test_proposed_and_accepted_tokens_count_only_the_drafts_an_eos_leaves_in_the_output(target):
    greedy = reference_greedy(target, [1, 2, 3], 9)
    dec = self_draft_decoder(target, gamma=3)
    dec.eos_ids = {greedy[2]}  # the third token: the first step's block (drafts 2-4, bonus 5) is cut after draft 2
    cut = greedy.index(greedy[2]) + 1
    res = dec.generate([1, 2, 3], max_new_tokens=9)
    s = res.stats
    assert res.token_ids == greedy[:cut] and s["new_tokens"] == cut and s["target_forwards"] == 2
    # (the drafts past the EOS were accepted, but the output ended before them: neither proposed nor accepted, so
    # a perfect draft keeps its acceptance rate of 1 and no rejection is read into the cut)
    assert s["accepted_tokens"] == s["proposed_tokens"] == cut - 1 and s["acceptance_rate"] in (1.0, None)
    assert s["accepted_by_position"] == s["proposed_by_position"] == [1] * (cut - 1) and s["proposed_nodes"] == cut - 1


def test_an_eos_cutting_a_step_after_a_rejection_drops_the_depths_past_it():
    """A step proposes greedy[1..k] and a wrong token; greedy[k] is an EOS: the output ends at the last accepted
    draft, so the rejected depth after it is not counted as proposed (it says nothing of the proposer)."""
    target = tiny_llama(vocab_size=64, seed=3)
    greedy = reference_greedy(target, [1, 2, 3], 12)
    k = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])

    class RightThenWrong(Proposer):
        name = "right-then-wrong"

        def begin(self, prompt, hidden_states):
            pass

        def propose(self, state):
            return Proposal.chain(torch.tensor([*greedy[1 : k + 1], (greedy[k + 1] + 1) % 64]))

        def accepted(self, result):
            pass

    dec = SpeculativeDecoder(target, RightThenWrong(None, target_info(target)))
    dec.eos_ids = {greedy[k]}
    res = dec.generate([1, 2, 3], max_new_tokens=12)
    s = res.stats
    assert res.token_ids == greedy[: k + 1] and s["finish_reason"] == "eos" and s["target_forwards"] == 2
    assert s["proposed_tokens"] == s["accepted_tokens"] == s["proposed_nodes"] == k and s["acceptance_rate"] == 1.0
    assert s["proposed_by_position"] == s["accepted_by_position"] == [1] * k


def test_an_eos_among_the_accepted_drafts_ends_generation_at_that_step():
    # (with room for more: a check of the step's last token only ran on to 11 forwards and counted 27 accepted
    # tokens the output never held; with max_new_tokens=9 the budget ended it after 2 forwards either way)
    target = tiny_llama(vocab_size=64, seed=3)
    greedy = reference_greedy(target, [1, 2, 3], 40)
    dec = self_draft_decoder(target, gamma=3)
    dec.eos_ids = {greedy[2]}
    cut = greedy.index(greedy[2]) + 1
    assert greedy[4] != greedy[2]  # (the EOS inside the first step's block [1:5], not also at its end)
    res = dec.generate([1, 2, 3], max_new_tokens=40)
    assert res.token_ids == greedy[:cut] and res.stats["finish_reason"] == "eos"
    assert res.stats["target_forwards"] == 2 and res.stats["accepted_tokens"] == cut - 1


def test_max_new_tokens_cuts_an_accepted_run(target):
    res = self_draft_decoder(target, gamma=4).generate([1, 2, 3], max_new_tokens=3)
    assert len(res.token_ids) == 3 and res.token_ids == reference_greedy(target, [1, 2, 3], 3)


def test_draft_depth_never_exceeds_the_remaining_budget(target):
    seen = []
    dec = self_draft_decoder(target, gamma=4)
    inner = dec.proposer.propose
    dec.proposer.propose = lambda state: seen.append(state.max_depth) or inner(state)
    dec.generate([1, 2, 3], max_new_tokens=7)
    assert seen == [5, 0]  # 1 token from prefill; a step of 4 + 1 leaves 1 more, so nothing to draft


def test_draft_depth_never_exceeds_what_one_verification_takes(target, monkeypatch):
    """A chain as deep as the settings allow (num_speculative_tokens is not capped) is offered no more depth than
    MAX_PROPOSAL_NODES: it was refused mid-generation as a malformed proposal."""
    import specframe.decoder
    import specframe.proposer

    for module in (specframe.decoder, specframe.proposer):
        monkeypatch.setattr(module, "MAX_PROPOSAL_NODES", 3)
    seen = []
    dec = self_draft_decoder(target, gamma=6)
    inner = dec.proposer.propose
    dec.proposer.propose = lambda state: seen.append(state.max_depth) or inner(state)
    res = dec.generate([1, 2, 3], max_new_tokens=12)
    assert max(seen) == 3 and res.token_ids == reference_greedy(target, [1, 2, 3], 12)


def test_same_seed_same_output_under_sampling(target, info):
    dec = SpeculativeDecoder(target, DraftProposer.random(info, DraftConfig(num_speculative_tokens=2), seed=3))
    a = dec.generate([1, 2], max_new_tokens=20, temperature=1.0, seed=7).token_ids
    b = dec.generate([1, 2], max_new_tokens=20, temperature=1.0, seed=7).token_ids
    c = [dec.generate([1, 2], max_new_tokens=20, temperature=1.0, seed=s).token_ids for s in range(5)]
    assert a == b and any(x != a for x in c)


def test_no_seed_draws_fresh_samples_and_leaves_the_global_generator_alone(target, info):
    """seed=None (the default) seeds each call afresh: repeated calls differ (five identical 40-token samples
    would need a near-deterministic target, which the same calls with seeds 0-4 rule out) and torch's global
    generator is neither read nor advanced; a decoder-level seed makes every call repeat."""
    dec = SpeculativeDecoder(target, DraftProposer.random(info, DraftConfig(num_speculative_tokens=2), seed=3))
    seeded = {tuple(dec.generate([1, 2], max_new_tokens=40, temperature=1.0, seed=s).token_ids) for s in range(5)}
    assert len(seeded) > 1  # (the target is not near-deterministic at temperature 1)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    fresh = {tuple(dec.generate([1, 2], max_new_tokens=40, temperature=1.0).token_ids) for _ in range(5)}
    assert len(fresh) > 1 and torch.equal(torch.get_rng_state(), before)
    fixed = SpeculativeDecoder(dec.model, dec.proposer, seed=11)
    runs = {tuple(fixed.generate([1, 2], max_new_tokens=40, temperature=1.0).token_ids) for _ in range(3)}
    assert runs == {tuple(dec.generate([1, 2], max_new_tokens=40, temperature=1.0, seed=11).token_ids)}


def test_a_proposer_editing_the_engine_s_tokens_in_place_changes_nothing(target, info):
    """A proposer that writes into the prompt it is given and into state.tokens (a contract breach) edits its
    own copies: the target is still fed the real sequence (before, the edited last token was verified)."""

    class Scribbler(DraftProposer):
        def begin(self, prompt, hidden_states):
            super().begin(prompt, hidden_states)
            prompt[0] = (int(prompt[0]) + 1) % 8

        def propose(self, state):
            proposal = super().propose(state)
            state.tokens[-1] = (int(state.tokens[-1]) + 1) % 8
            return proposal

    dec = SpeculativeDecoder(target, Scribbler(DraftConfig(num_speculative_tokens=2), info, target))
    assert dec.generate([1, 2, 3], max_new_tokens=12).token_ids == reference_greedy(target, [1, 2, 3], 12)


def test_eos_ends_generation_and_is_kept(target):
    ref = reference_greedy(target, [1, 2, 3], 12)
    target.generation_config.eos_token_id = ref[4]
    try:
        res = self_draft_decoder(target).generate([1, 2, 3], max_new_tokens=12)
    finally:
        target.generation_config.eos_token_id = None
    assert res.token_ids == ref[: ref.index(ref[4]) + 1] and res.stats["finish_reason"] == "eos"


def penalised_greedy(target, prompt, n, repetition=1.0, presence=0.0, frequency=0.0):
    """Greedy decoding with the penalties, from scratch (no cache), by their definitions."""
    ids = list(prompt)
    for _ in range(n):
        row = target(input_ids=torch.tensor([ids])).logits[0, -1].double()
        output = ids[len(prompt) :]
        for t in set(ids):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t in set(output):
            row[t] -= presence + frequency * output.count(t)
        ids.append(int(row.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", ["none", "draft", "medusa", "eagle", "ngram", "union"])
def test_penalties_in_greedy_decoding_are_the_targets_for_every_proposer(name):
    # (each verified row penalised with its own history: the output so far and its node's tree path)
    from specframe.plugins import get_registry

    target = tiny_llama(vocab_size=32, seed=3)
    dec = SpeculativeDecoder(target, get_registry().get(name).cls.random(target_info(target), None, seed=1))
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]  # (repeats: n-gram drafts too)
    hf = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, repetition_penalty=1.3)
    res = dec.generate(prompt, 40, repetition_penalty=1.3)
    assert res.token_ids == hf[0, len(prompt) :].tolist() == penalised_greedy(target, prompt, 40, repetition=1.3)
    assert res.token_ids != dec.generate(prompt, 40).token_ids  # (the penalty changed the output)
    assert res.stats["accepted_tokens"] > 0 or name in ("none", "ngram")
    dec.presence_penalty, dec.frequency_penalty = 0.4, np.float32(0.7)  # (the decoder's own, for every call)
    assert dec.sampling.presence_penalty == 0.4 and dec.frequency_penalty == pytest.approx(0.7)
    want = penalised_greedy(target, prompt, 30, presence=0.4, frequency=0.7)
    assert dec.generate(prompt, 30).token_ids == want
    with pytest.raises(BadInputError, match=r"^frequency_penalty must be a number in \[-2, 2\] \(0 = off\), got 3"):
        dec.generate(prompt, 4, frequency_penalty=3)


@pytest.mark.parametrize(
    "penalties", [{"repetition": 3.0}, {"presence": 1.0, "frequency": 1.5}, {"presence": -1.0, "frequency": 2.0}]
)
def test_penalties_see_each_tree_node_s_own_path_and_not_its_siblings(penalties):
    # A proposer that knows the penalised greedy output proposes, at each depth, a wrong token and then the right
    # one (siblings): every right node is accepted only if its row was penalised with exactly its own path.
    target = tiny_llama(vocab_size=32, seed=3)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    want = penalised_greedy(target, prompt, 30, **penalties)
    names = {"repetition": "repetition_penalty", "presence": "presence_penalty", "frequency": "frequency_penalty"}

    class Oracle(Proposer):
        name = "oracle"

        def begin(self, prompt, hidden_states):
            pass

        def accepted(self, result):
            pass

        def propose(self, state):
            done = len(state.tokens) - state.prompt_length
            right = want[done : done + min(4, state.max_depth)]
            tokens, parents = [], []
            for depth, token in enumerate(right):
                parent = -1 if depth == 0 else 2 * depth - 1
                tokens += [(token + 7) % 32, token]
                parents += [parent, parent]
            n = len(tokens)
            return Proposal(torch.tensor(tokens), torch.tensor(parents), torch.ones(n, dtype=torch.bool))

    dec = SpeculativeDecoder(target, Oracle(None, target_info(target)))
    res = dec.generate(prompt, 30, **{names[k]: v for k, v in penalties.items()})
    assert res.token_ids == want and res.stats["target_forwards"] == 7  # (1 prefill + 6 steps of 4 drafts + 1)


@pytest.mark.parametrize("name", ["none", "draft", "medusa", "eagle", "ngram", "union"])
def test_logprobs_are_the_targets_own_for_each_new_token(name):
    # (each token's log-probability under the target's raw logits, as one forward over the whole sequence gives
    # it: whichever rows of which verifications predicted it, accepted drafts and bonus tokens alike)
    from specframe.plugins import get_registry
    from specframe.testing.conformance import make_decoder

    dec = make_decoder(get_registry().get(name).cls, "cpu", 8)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # (repeats: n-gram drafts too)
    for temperature, stop in ((0.0, None), (1.0, None), (1.0, [5])):
        res = dec.generate(prompt, 30, temperature, seed=1, stop_token_ids=stop, logprobs=True, top_k=4)
        full = dec.model(input_ids=torch.tensor([prompt + res.token_ids])).logits[0].log_softmax(-1)
        want = full[len(prompt) - 1 : -1].gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
        assert len(res.logprobs) == len(res.token_ids) and (res.stats["accepted_tokens"] > 0 or name == "none")
        torch.testing.assert_close(torch.tensor(res.logprobs), want, rtol=0, atol=1e-4)
        # the target's most likely tokens at each new token's position, most likely first, from the same rows
        top = dec.generate(prompt, 30, temperature, seed=1, stop_token_ids=stop, top_logprobs=3, top_k=4)
        assert top.token_ids == res.token_ids and top.logprobs == res.logprobs  # (top_logprobs turns logprobs on)
        values, ids = full[len(prompt) - 1 : -1].topk(3, -1)
        assert [list(t) for t in top.top_logprobs] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor([list(t.values()) for t in top.top_logprobs]), values, rtol=0, atol=1e-4
        )
    assert dec.generate(prompt, 4).logprobs is None and dec.generate(prompt, 4).top_logprobs is None  # (off by default)
    dec.logprobs = True
    res = dec.generate(prompt, 4)
    assert len(res.logprobs) == 4 and res.top_logprobs is None
    dec.logprobs, dec.top_logprobs = np.False_, 8  # (the whole vocabulary; NumPy's bool is a flag too)
    res = dec.generate(prompt, 4)
    assert len(res.logprobs) == 4 and all(len(t) == 8 for t in res.top_logprobs)
    assert sorted(res.top_logprobs[0].values(), reverse=True) == list(res.top_logprobs[0].values())
    assert torch.tensor(list(res.top_logprobs[0].values())).exp().sum().item() == pytest.approx(1, abs=1e-5)
    assert dec.generate(prompt, 4, top_logprobs=0).logprobs is None
    for bad, message in (
        ({"logprobs": "yes"}, "logprobs must be True or False, got 'yes'"),
        ({"top_logprobs": 9}, r"top_logprobs must be an integer in \[0, 8\] \(the vocabulary\), got 9"),
        ({"top_logprobs": -1}, r"top_logprobs must be an integer in \[0, 8\]"),
        ({"top_logprobs": True}, r"top_logprobs must be an integer in \[0, 8\] \(the vocabulary\), got True"),
        ({"top_logprobs": 2, "logprobs": False}, "top_logprobs=2 needs logprobs, and this call gives logprobs=False"),
    ):
        with pytest.raises(BadInputError, match=message):
            dec.generate(prompt, 4, **bad)
    with pytest.raises(
        BadInputError, match=r"top_logprobs=8 \(the decoder's: give top_logprobs=0 too\) needs logprobs"
    ):
        dec.generate(prompt, 4, logprobs=False)


def test_stop_token_ids_end_generation_inside_an_accepted_block_and_ignore_eos_goes_past_eos():
    # (vLLM's stop_token_ids and ignore_eos): greedy[2] sits inside the first step's accepted block
    target = tiny_llama(vocab_size=64, seed=3)
    greedy = reference_greedy(target, [1, 2, 3], 40)
    cut = greedy.index(greedy[2]) + 1
    dec = self_draft_decoder(target, gamma=3)
    res = dec.generate([1, 2, 3], max_new_tokens=40, stop_token_ids=[greedy[2], 63])
    assert res.token_ids == greedy[:cut] and res.stats["finish_reason"] == "stop"
    assert res.stats["target_forwards"] == 2 and res.stats["accepted_tokens"] == cut - 1
    # the decoder's own setting holds for every call; one id is a list of one; the call's argument wins
    dec.stop_token_ids = greedy[2]
    assert dec.generate([1, 2, 3], max_new_tokens=40).token_ids == greedy[:cut]
    assert dec.generate([1, 2, 3], max_new_tokens=40, stop_token_ids=[]).token_ids == greedy
    # an EOS: "eos", unless ignored; ignored, generation runs on to max_new_tokens, or to a stop token id
    dec.stop_token_ids, dec.eos_ids = [], {greedy[2]}
    assert dec.generate([1, 2, 3], max_new_tokens=40).stats["finish_reason"] == "eos"
    past = dec.generate([1, 2, 3], max_new_tokens=40, ignore_eos=True)
    assert past.token_ids == greedy and past.stats["finish_reason"] == "length"
    both = dec.generate([1, 2, 3], max_new_tokens=40, ignore_eos=True, stop_token_ids=[greedy[2]])
    assert both.token_ids == greedy[:cut] and both.stats["finish_reason"] == "stop"
    dec.ignore_eos = True
    assert dec.generate([1, 2, 3], max_new_tokens=40).token_ids == greedy
    dec.ignore_eos = False  # NumPy's booleans are flags too (the config's checks take them)
    assert dec.generate([1, 2, 3], max_new_tokens=40, ignore_eos=np.True_).token_ids == greedy
    assert dec.generate([1, 2, 3], max_new_tokens=40, ignore_eos=np.False_).token_ids == greedy[:cut]
    for bad, message in (
        ({"stop_token_ids": [64]}, r"stop_token_ids holds 64: not a token id of this target \(vocabulary 64\)"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must hold token ids \(integers >= 0\), got -1"),
        ({"stop_token_ids": [True]}, r"stop_token_ids must hold token ids \(integers >= 0\), got True"),
        ({"stop_token_ids": "7"}, r"stop_token_ids must be a token id or a list of token ids, got '7'"),
        ({"ignore_eos": 1}, r"ignore_eos must be True or False, got 1"),
    ):
        with pytest.raises(BadInputError, match=message):
            dec.generate([1, 2, 3], max_new_tokens=4, **bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_targets_run(dtype):
    target = tiny_llama(vocab_size=8, seed=0, dtype=dtype)
    info = target_info(target)
    dec = SpeculativeDecoder(target, DraftProposer.random(info, DraftConfig(num_speculative_tokens=3), seed=1))
    for temperature in (0.0, 1.0):
        res = dec.generate([1, 2, 3], max_new_tokens=16, temperature=temperature, seed=0)
        assert len(res.token_ids) == 16 and all(0 <= t < 8 for t in res.token_ids)


def test_prompt_errors(target):
    dec = none_decoder(target)
    with pytest.raises(BadInputError, match="empty"):
        dec.generate([])
    with pytest.raises(BadInputError, match="context window"):
        dec.generate([1] * 256)
    with pytest.raises(BadInputError, match="out of range"):
        dec.generate([1, 99])
    with pytest.raises(BadInputError, match="no tokenizer"):
        dec.generate("hello")
    with pytest.raises(BadInputError, match="max_new_tokens"):
        dec.generate([1], max_new_tokens=0)
    with pytest.raises(BadInputError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"):
        dec.generate([1], seed=2**70)
    with pytest.raises(BadInputError, match="stop must be a string or a list of strings, got 5"):
        dec.generate([1], stop=5)
    with pytest.raises(BadInputError, match="seed must be an integer"):
        SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)), seed=1.5)


def test_generation_stops_at_the_context_window():
    target = tiny_llama(vocab_size=8, seed=0, max_position_embeddings=12)
    res = self_draft_decoder(target, gamma=4).generate([1, 2, 3], max_new_tokens=50)
    assert len(res.token_ids) == 9 and res.stats["finish_reason"] == "context"  # (said, not a silent cut)
    res = self_draft_decoder(target, gamma=4).generate([1, 2, 3], max_new_tokens=9)
    assert len(res.token_ids) == 9 and res.stats["finish_reason"] == "length"  # (the window is also full)


# A tiny longrope RoPE (Phi-3 style): short factors below position 16, long ones from it.
TINY_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 4,
    "long_factor": [8.0, 16.0, 32.0, 64.0],
    "original_max_position_embeddings": 16,
}


def test_a_longrope_target_is_never_verified_across_its_switch_to_the_long_factors():
    # transformers rotates every row of a forward with the long factors once the forward's largest position
    # reaches original_max_position_embeddings; a verification reaching it would rotate the rows before it
    # differently from plain decoding. So drafts stop short of it, and a perfect draft gives plain decoding's output.
    from specframe.architectures import longrope_switch

    target = tiny_llama(vocab_size=32, seed=0, max_position_embeddings=64, rope_parameters=TINY_LONGROPE)
    assert longrope_switch(target.config) == 16 and longrope_switch(tiny_llama().config) is None
    prompt = list(range(1, 11))
    plain = none_decoder(target).generate(prompt, max_new_tokens=30)
    fast = self_draft_decoder(target, gamma=4)
    spans = []
    verify = fast.acceptance
    fast.acceptance = lambda logits, proposal, *a: (
        spans.append((fast.cache.get_seq_length(), len(proposal))) or verify(logits, proposal, *a)
    )
    assert fast.generate(prompt, max_new_tokens=30).token_ids == plain.token_ids
    # (the cache holds the verified rows when the rule runs: the forward's rows were length - n - 1 .. length - 1)
    assert not any(length - n - 1 < 16 <= length - 1 for length, n in spans[1:]), spans
    # rows 10-14 (a root and 4 drafts), then row 15 alone (no room for a draft before 16), then drafts again
    assert spans[1:4] == [(15, 4), (16, 0), (21, 4)], spans


def test_a_phi3_target_recomputes_its_cache_at_the_switch_as_its_own_generation_does():
    # transformers' Phi-3 generation drops the cache and recomputes the whole sequence with the long factors when
    # it reaches original_max_position_embeddings + 1 tokens; the engine does the same, so every proposer's
    # output is transformers' greedy output, before and after the switch.
    from transformers import Phi3Config, Phi3ForCausalLM

    from specframe.proposer import seeded

    cfg = Phi3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        rope_parameters=TINY_LONGROPE,
        sliding_window=None,
    )
    with seeded(0):
        target = Phi3ForCausalLM(cfg).eval()
    target.generation_config.eos_token_id = None
    for prompt in (list(range(1, 11)), list(range(1, 17)), list(range(1, 18))):  # below, at and past the switch
        want = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt) :]
        assert none_decoder(target).generate(prompt, max_new_tokens=30).token_ids == want.tolist(), prompt
        assert self_draft_decoder(target, gamma=4).generate(prompt, max_new_tokens=30).token_ids == want.tolist()


@pytest.mark.parametrize(
    "config, switch",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, None),
        ({"rope_parameters": {"rope_type": "longrope", "original_max_position_embeddings": 16}}, 16),
        ({"rope_scaling": {"type": "su"}, "original_max_position_embeddings": 4096}, 4096),  # (older configs)
        ({"rope_parameters": {"full": {"rope_type": "longrope", "original_max_position_embeddings": 8}}}, 8),
        ({"rope_parameters": None}, None),
    ],
)
def test_the_longrope_switch_is_read_from_every_config_form(config, switch):
    import types

    from specframe.architectures import longrope_switch

    assert longrope_switch(types.SimpleNamespace(**config)) == switch


def test_a_draft_with_a_shorter_window_stops_drafting_at_its_end():
    # A GPT-2 draft (learned positions, 16 of them) for a target with 256: past its window it proposes nothing
    # and the target decodes alone (before: IndexError inside the draft's position embedding).
    import transformers as T

    target = tiny_llama(vocab_size=8, seed=0)
    config = T.GPT2Config(vocab_size=8, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=None)
    config.eos_token_id = None
    torch.manual_seed(0)
    draft = T.GPT2LMHeadModel(config).eval()
    drafted = []
    proposer = DraftProposer(DraftConfig(num_speculative_tokens=3), target_info(target), draft)
    propose = proposer.propose
    proposer.propose = lambda state: drafted.append((len(state.tokens), len(p := propose(state)))) or p
    res = SpeculativeDecoder(target, proposer).generate([1, 2, 3], max_new_tokens=30)
    assert res.token_ids == reference_greedy(target, [1, 2, 3], 30)
    assert all(n <= max(16 - length + 1, 0) for length, n in drafted) and drafted[-1][1] == 0
    assert any(length + n == 17 for length, n in drafted if n)  # it drafts right up to its last position


def test_hidden_states_of_kept_positions_reach_the_proposer(target, info):
    got = []

    class Spy(DraftProposer):
        hidden_state_layers = (-1, 1)

        def begin(self, prompt, hidden_states):
            got.append(("begin", prompt.clone(), hidden_states))
            super().begin(prompt, hidden_states)

        def accepted(self, result):
            got.append(("step", result, result.hidden_states))
            super().accepted(result)

    dec = SpeculativeDecoder(target, Spy(DraftConfig(num_speculative_tokens=3), info, target))
    res = dec.generate([1, 2, 3], max_new_tokens=12)
    full = torch.tensor([1, 2, 3] + res.token_ids)
    with torch.no_grad():
        ref = target(input_ids=full[None], output_hidden_states=True).hidden_states
    assert torch.allclose(got[0][2][-1], ref[-1][0, :3], atol=1e-4)
    pos = 3  # the first root (the token from prefill) sits at position 3
    for _, result, hidden in got[1:]:
        k = len(result.accepted_nodes) + 1
        for layer in (-1, 1):
            assert hidden[layer].shape == (k, target.config.hidden_size)
            assert torch.allclose(hidden[layer], ref[layer][0, pos : pos + k], atol=1e-4)
        pos += k


@pytest.mark.parametrize(
    "layers, message",
    [
        ((99,), "asks for hidden state 99; the target has 3 (indices 0 to 2)"),
        ((-4,), "asks for hidden state -4; the target has 3"),
        (("1",), "asks for hidden_state_layers '1': not a layer index"),
    ],
)
def test_hidden_state_layers_the_target_lacks_are_named_when_the_decoder_is_built(target, info, layers, message):
    import re

    proposer = NoneProposer(NoneConfig(), info)
    proposer.hidden_state_layers = layers
    with pytest.raises(ProposerError, match=re.escape(f"proposer 'none' (plugin 'p') {message}")):
        SpeculativeDecoder(target, proposer, plugin="p")
    proposer.hidden_state_layers = (-3, torch.tensor(2))  # the embeddings and the last layer's output
    SpeculativeDecoder(target, proposer, plugin="p")


class Malformed(NoneProposer):
    name = "malformed"

    def __init__(self, info, make):
        super().__init__(NoneConfig(), info)
        self.make = make

    def propose(self, state):
        return self.make(state)


L = torch.long


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda s: Proposal.chain(torch.tensor([99])), "node 0's token id 99 is out of range [0, 8)"),
        (lambda s: Proposal.chain(torch.tensor([1.7, 2.0])), "tokens must be an integer tensor, got torch.float32"),
        (lambda s: Proposal(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.ones(2, dtype=torch.bool)), "parent"),
        (lambda s: Proposal(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.ones(2, dtype=torch.bool)), "parent"),
        (lambda s: Proposal(torch.tensor([1, 2]), torch.tensor([-1]), torch.ones(2, dtype=torch.bool)), "shape"),
        (
            lambda s: Proposal(torch.tensor([1]), torch.tensor([-1]), torch.zeros(1, dtype=torch.bool)),
            "draft_probs must be a [1, 8] tensor for sampled nodes, got None",
        ),
        (  # (was "got None" too)
            lambda s: Proposal(torch.tensor([1]), torch.tensor([-1]), torch.zeros(1, dtype=torch.bool), [[1.0] * 8]),
            "draft_probs must be a [1, 8] tensor for sampled nodes, got a list",
        ),
        (
            lambda s: Proposal(torch.tensor([1]), torch.tensor([-1]), torch.zeros(1, dtype=torch.bool), torch.ones(8)),
            "draft_probs must be a [1, 8] tensor for sampled nodes, got shape (8,)",
        ),
        (
            lambda s: Proposal(
                torch.tensor([1]), torch.tensor([-1]), torch.zeros(1, dtype=torch.bool), torch.full((1, 8), 0.5)
            ),
            "rows do not sum to 1 (node 0's sums to 4)",
        ),
        (
            lambda s: Proposal(
                torch.tensor([1]),
                torch.tensor([-1]),
                torch.zeros(1, dtype=torch.bool),
                torch.tensor([[0.5, 0.0, 0.5] + [0.0] * 5]),
            ),
            "node 0's token 1 has draft probability 0",
        ),
        (
            lambda s: Proposal(
                torch.tensor([1]),
                torch.tensor([-1]),
                torch.zeros(1, dtype=torch.bool),
                torch.empty(1, 8, device="meta"),
            ),
            "draft_probs is on meta, the target's logits on cpu",
        ),
        (  # (a row of a deterministic node is not read; the sampled node's row is, and is named by its index)
            lambda s: Proposal(
                torch.tensor([1, 2]),
                torch.tensor([-1, 0]),
                torch.tensor([True, False]),
                torch.stack([torch.full((8,), float("nan")), torch.full((8,), 0.5)]),
            ),
            "rows do not sum to 1 (node 1's sums to 4)",
        ),
        (lambda s: Proposal.chain(torch.ones(s.max_depth + 1, dtype=L)), "depth"),
        (  # (a runaway tree of depth 1: refused before its attention is built)
            lambda s: Proposal(torch.ones(8193, dtype=L), torch.full((8193,), -1), torch.ones(8193, dtype=torch.bool)),
            "8193 nodes, more than the 8192 one verification forward takes",
        ),
        (  # (one the checks cannot read: named as the proposer's, not a bare NotImplementedError)
            lambda s: Proposal.chain(torch.tensor([1], device="meta")),
            "returned a malformed proposal: NotImplementedError",
        ),
        (lambda s: [1, 2], "expected a Proposal"),
        (lambda s: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_malformed_proposals_are_stopped_naming_the_proposer(target, info, make, message):
    dec = SpeculativeDecoder(target, Malformed(info, make), plugin="acme-plugin")
    named = f"(?s)proposer 'malformed' \\(plugin 'acme-plugin'\\).*{re.escape(message)}"
    with pytest.raises(ProposerError, match=named):
        dec.generate([1, 2, 3], max_new_tokens=5)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), MemoryError()])
@pytest.mark.parametrize("where", ["propose", "validation"])
def test_running_out_of_memory_stays_itself(target, info, monkeypatch, error, where):
    # (what a server catches to retry smaller; not reported as the proposer's fault or a malformed proposal)
    def raise_it(*args):
        raise error

    if where == "propose":
        dec = SpeculativeDecoder(target, Malformed(info, raise_it))
    else:
        monkeypatch.setattr("specframe.proposer._checked_structure", raise_it)
        dec = SpeculativeDecoder(target, Malformed(info, lambda s: Proposal.chain(torch.tensor([1]))))
    with pytest.raises(type(error)) as caught:
        dec.generate([1, 2, 3], max_new_tokens=5)
    assert caught.value is error


def test_only_sampled_nodes_rows_are_read(target, info):
    # (a deterministic node's row of draft_probs is never read: NaN there is no error)
    rows = torch.stack([torch.full((8,), float("nan")), torch.nn.functional.one_hot(torch.tensor(2), 8).float()])
    proposal = Proposal(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([True, False]), rows)
    dec = SpeculativeDecoder(target, Malformed(info, lambda s: proposal if s.max_depth >= 2 else Proposal.empty()))
    assert len(dec.generate([1, 2, 3], max_new_tokens=5, temperature=1.0, seed=0).token_ids) == 5


def test_a_batch_of_chains_is_not_taken_for_one_chain():
    with pytest.raises(ValueError, match=r"one chain, \[n\], \[1, n\] or \[n, 1\], got shape \(2, 2\)"):
        Proposal.chain(torch.tensor([[1, 2], [3, 4]]))
    assert Proposal.chain(torch.tensor([[1, 2]])).tokens.tolist() == [1, 2]
    assert Proposal.chain(torch.tensor([[1], [2]])).tokens.tolist() == [1, 2]  # (multinomial(q, 1), row by row)


def test_draft_vocabulary_mismatch_is_refused(info):
    other = tiny_llama(vocab_size=16, seed=1)
    with pytest.raises(BadInputError, match="vocabulary mismatch"):
        DraftProposer(DraftConfig(), info, other)


def test_stop_string_cuts_text_and_tokens(tiny_dirs):
    from specframe.models import load_model

    loaded = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True)
    dec = SpeculativeDecoder(loaded.model, NoneProposer(NoneConfig(), target_info(loaded.model)), loaded.tokenizer)
    full = dec.generate("a b", max_new_tokens=12, raw=True)
    words = full.text.split()  # one word per token with this tokenizer
    j = next(i for i in range(1, len(words)) if words[i] not in words[:i])
    cut = dec.generate("a b", max_new_tokens=12, raw=True, stop=[words[j]])
    # Like vLLM: the text stops before the stop string; the token ids keep the tokens that produced it.
    assert cut.text == " ".join(words[:j]) + " "
    assert cut.token_ids == full.token_ids[: j + 1] and cut.stats["finish_reason"] == "stop"


class LetterTokenizer:
    """Token id i decodes to the i-th letter, so stop strings can be placed exactly in a tiny target's text."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class ByteTokenizer:
    """Token i is the byte i, decoded as byte-level BPE decodes: a character cut at the start of a tail is one or
    more replacement characters there."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class PieceTokenizer:
    """Token i decodes to PIECES[i]: a letter, several, a space, or nothing (as a skipped special token does)."""

    PIECES = ["a", "b", "c", "", "de", "fgh", " ", "ij", "", "k", "lmnopq"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


def stop_prefix_of_whole_texts(tokenizer, ids, stop):
    """Where decoding one token at a time stops: the first prefix whose whole text (as it reads after other text:
    decoded after an "a", then cut off) holds a stop string."""
    a = tokenizer.encode("a", add_special_tokens=False) if hasattr(tokenizer, "encode") else []

    def whole(prefix: list[int]) -> str:
        after = tokenizer.decode(a + prefix, skip_special_tokens=True)
        return after[1:] if a and after.startswith("a") else tokenizer.decode(prefix, skip_special_tokens=True)

    texts = (whole(ids[:n]) for n in range(1, len(ids) + 1))
    return next((n for n, text in enumerate(texts, 1) if any(s in text for s in stop)), None)


def stops_found_as_the_whole_text_finds_them(tokenizer, draw_id, rng, trials):
    """`_stop_prefix` (which decodes a tail of each prefix) against the whole texts, on random token sequences
    (ids from `draw_id(rng)`) and stop strings cut from their text."""
    checker = object.__new__(SpeculativeDecoder)  # (the stop check reads the tokenizer only)
    checker.tokenizer = tokenizer
    for _ in range(trials):
        ids = [draw_id(rng) for _ in range(rng.randrange(1, 150))]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stop = []
        for _ in range(rng.randrange(1, 3)):
            i, k = rng.randrange(len(text) + 1), rng.randrange(1, 25)
            stop.append(text[i : i + k] or "zz")
        got = checker._stop_prefix(ids, stop, 1)
        assert got == stop_prefix_of_whole_texts(tokenizer, ids, stop), (ids, stop)


def test_stop_strings_found_from_a_tail_where_the_whole_text_finds_them():
    # (the check decodes a tail of each prefix, not the whole of it, whose cost grew with the output)
    pieces = len(PieceTokenizer.PIECES)
    stops_found_as_the_whole_text_finds_them(PieceTokenizer(), lambda rng: rng.randrange(pieces), random.Random(0), 400)
    # mostly tokens without text: a tail of tokens too short to reach back past a stop string
    mostly_empty = lambda rng: 3 if rng.random() < 0.9 else rng.randrange(pieces)  # noqa: E731
    stops_found_as_the_whole_text_finds_them(PieceTokenizer(), mostly_empty, random.Random(1), 400)
    # bytes of multi-byte characters: a tail that starts inside one decodes it as replacement characters
    text_bytes = list("ok 你好! é ü 🐻 a".encode())
    stops_found_as_the_whole_text_finds_them(ByteTokenizer(), lambda rng: rng.choice(text_bytes), random.Random(2), 400)
    checker = object.__new__(SpeculativeDecoder)
    checker.tokenizer = ByteTokenizer()
    ids = list("ok 你!".encode())  # (found at its last byte, 7: a tail with no margin never found it)
    assert checker._stop_prefix(ids, ["你!"], 1) == 7 == stop_prefix_of_whole_texts(ByteTokenizer(), ids, ["你!"])


@pytest.mark.slow
def test_stop_strings_found_from_a_tail_with_the_default_targets_tokenizer():
    # Byte-level BPE: random ids make partial characters and text that a tail decodes differently at its start;
    # the tokens of a text with accents, an emoji, CJK and quotes, in random orders, the clean-ups of real text
    from transformers import AutoTokenizer

    from specframe.models import pull_default_model

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model(quiet=True))
    stops_found_as_the_whole_text_finds_them(
        tokenizer, lambda rng: rng.randrange(len(tokenizer)), random.Random(1), 300
    )
    words = tokenizer.encode("Ein Bär 🐻 sagte: «你好», l'été's café — naïve 'quotes' and s ' spaces ...\n\tend")
    stops_found_as_the_whole_text_finds_them(tokenizer, lambda rng: rng.choice(words), random.Random(2), 300)


def plain_and_self_drafting(target, tokenizer):
    """Plain decoding, and the target drafting 8 tokens for itself (whole steps of 9 tokens under greedy)."""
    plain = SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)), tokenizer)
    fast = SpeculativeDecoder(
        target, DraftProposer(DraftConfig(num_speculative_tokens=8), target_info(target), target), tokenizer
    )
    return plain, fast


def test_a_step_completing_two_stop_strings_stops_where_plain_decoding_does(target):
    # Stop string `late` starts before `early` in the text but is completed one token after it. Plain decoding
    # stops at the token completing `early`; a step that accepts many tokens at once completes both and must
    # give the same tokens and text (not cut before `late`, the stop string that starts first).
    tok = LetterTokenizer()
    for prompt in ([1, 2, 3], [4, 5], [6, 1, 7], [2, 9]):
        text = tok.decode(reference_greedy(target, prompt, 12))
        for i in range(2, 7):
            early, late = text[i : i + 2], text[i - 2 : i + 3]
            if early not in text[: i + 1] and late not in text[: i + 2]:
                break
        else:
            continue
        break
    else:
        pytest.fail("no text with two such stop strings")
    plain, fast = plain_and_self_drafting(target, tok)
    want = plain.generate(prompt, max_new_tokens=12, stop=[late, early])
    got = fast.generate(prompt, max_new_tokens=12, stop=[late, early])
    assert want.token_ids == reference_greedy(target, prompt, 12)[: i + 2] and want.text == text[:i]
    assert got.stats["target_forwards"] < len(got.token_ids)  # (several tokens were accepted in one step)
    assert (got.token_ids, got.text) == (want.token_ids, want.text)


class CleanupTokenizer(LetterTokenizer):
    """LetterTokenizer with a clean-up rule, like `clean_up_tokenization_spaces`: `pair` decodes as one capital
    letter, so appending a token can change text already decoded ("..ab" then "..aB")."""

    def __init__(self, pair):
        self.pair = pair

    def decode(self, ids, skip_special_tokens=True):
        return super().decode(ids).replace(self.pair, self.pair[0].upper())


def test_a_step_passing_a_stop_string_that_its_last_token_unmakes_stops_where_plain_decoding_does(target):
    # Plain decoding stops at token i, whose text completes the stop string; with token i+1 the clean-up rule
    # rewrites it away. A step that accepts both at once must still stop at token i (it once went on to the end).
    for prompt, i in ((p, i) for p in ([1, 2, 3], [4, 5], [6, 1, 7], [2, 9], [3, 3]) for i in range(1, 8)):
        ref = reference_greedy(target, prompt, 12)
        letters = LetterTokenizer().decode(ref)
        tok, stop = CleanupTokenizer(letters[i : i + 2]), letters[i - 1 : i + 1]
        texts = [tok.decode(ref[:k]) for k in range(13)]
        if [k for k in range(13) if stop in texts[k]] == [i + 1]:
            break
    else:
        pytest.fail("no text with such a stop string")
    plain, fast = plain_and_self_drafting(target, tok)
    want = plain.generate(prompt, max_new_tokens=12, stop=stop)
    got = fast.generate(prompt, max_new_tokens=12, stop=stop)
    assert want.token_ids == ref[: i + 1] and want.text == texts[i + 1][: texts[i + 1].index(stop)]
    assert got.stats["target_forwards"] == 2  # (the prefill's token, then one step of 9: tokens 2-10)
    assert (got.token_ids, got.text) == (want.token_ids, want.text)


def test_numpy_integers_are_integers_and_stop_strings_need_a_tokenizer(target):
    np = pytest.importorskip("numpy")
    dec = none_decoder(target)
    want = dec.generate([1, 2, 3], max_new_tokens=4, temperature=1.0, top_k=2, seed=5).token_ids
    got = dec.generate(list(np.array([1, 2, 3])), max_new_tokens=np.int64(4), temperature=1.0, top_k=np.int64(2),
                       seed=np.int64(5)).token_ids  # fmt: skip
    assert got == want
    # 0-d integer tensors too, as 0-d float tensors are numbers (before: "must be an integer ..., got tensor(2)")
    assert dec.generate([1, 2, 3], max_new_tokens=torch.tensor(4), temperature=1.0, top_k=torch.tensor(2),
                        seed=torch.tensor(5)).token_ids == want  # fmt: skip
    with pytest.raises(BadInputError, match=r"top_k must be an integer"):
        dec.generate([1, 2, 3], max_new_tokens=4, temperature=1.0, top_k=torch.tensor(2.0))
    with pytest.raises(BadInputError, match=r"stop strings \['x'\] need the target's tokenizer"):
        dec.generate([1, 2, 3], max_new_tokens=4, stop="x")
    with pytest.raises(BadInputError, match=r"^top_k must be an integer >= 1, or 0 or -1 for off, got -2"):
        dec.generate([1, 2, 3], max_new_tokens=4, top_k=-2)  # (the argument named, not the config key)
    # -1 is vLLM's spelling of top-k off: the same draws as 0.
    off = dec.generate([1, 2, 3], max_new_tokens=6, temperature=1.0, top_k=0, seed=7).token_ids
    assert dec.generate([1, 2, 3], max_new_tokens=6, temperature=1.0, top_k=-1, seed=7).token_ids == off
    # Floats of other libraries are numbers; text and bools are not (True was sampling at temperature 1).
    want = dec.generate([1, 2, 3], max_new_tokens=4, temperature=0.5, top_p=0.9, seed=5).token_ids
    assert dec.generate([1, 2, 3], max_new_tokens=4, temperature=torch.tensor(0.5), top_p=np.float32(0.9),
                        seed=5).token_ids == want  # fmt: skip
    with pytest.raises(BadInputError, match=r"^min_p must be a number in \[0, 1\] \(0 = off\), got -0.5"):
        dec.generate([1, 2, 3], max_new_tokens=4, min_p=-0.5)
    for bad in ({"temperature": "0.5"}, {"temperature": True}, {"top_p": "0.9"}, {"top_p": True}, {"min_p": "0.1"}):
        ((key, value),) = bad.items()
        with pytest.raises(BadInputError, match=rf"^{key} must be a .*number.*, got {value!r}"):
            dec.generate([1, 2, 3], max_new_tokens=4, **bad)


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [3]])
def test_empty_or_non_text_stop_strings_are_refused(target, stop):
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)), LetterTokenizer())
    with pytest.raises(BadInputError, match="stop must hold non-empty strings"):
        dec.generate([1, 2, 3], max_new_tokens=4, stop=stop)


def test_one_stop_string_is_not_split_into_characters(target):
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)), LetterTokenizer())
    text = dec.generate([4, 5], max_new_tokens=16).text
    # A stop string first completed at j + 3, while one of its letters occurs before j.
    j = next(j for j in range(1, 12) if text[j : j + 3] not in text[: j + 2] and set(text[j : j + 3]) & set(text[:j]))
    stop = text[j : j + 3]
    assert dec.generate([4, 5], max_new_tokens=16, stop=stop).text == text[:j]
    dec.stop = stop  # (set on the decoder, as the README sets dec.seed: for every call after)
    assert dec.generate([4, 5], max_new_tokens=16).text == text[:j]


def sentencepiece_like_tokenizer(chat_template: str | None = None):
    """Words marked by "▁" whose decoding drops the space before a text's first word, as SentencePiece's (Llama 2,
    Mistral) does: the tiny 8-token target's ids 2-7."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "▁of", "▁France", "▁is", "▁a", "▁The", "▁Paris"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = chat_template
    return fast


def test_a_stop_string_with_the_space_before_the_first_new_word_stops_there(target):
    # (before: the new tokens' text was decoded alone, which drops that space, so " The" was first found at the
    # third token; vLLM, which decodes after the prompt, and transformers' stop strings stop at the first)
    tokenizer = sentencepiece_like_tokenizer()
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)), tokenizer)
    plain = dec.generate("of a", max_new_tokens=6, raw=True)
    assert plain.token_ids[:3] == [6, 3, 6] and plain.text.startswith("The France The")  # (no leading space)
    first = dec.generate("of a", max_new_tokens=6, raw=True, stop=[" The"])
    assert (first.token_ids, first.text, first.stats["finish_reason"]) == ([6], "", "stop")
    second = dec.generate("of a", max_new_tokens=6, raw=True, stop=[" France"])
    assert (second.token_ids, second.text) == ([6, 3], "The")  # (the text cut where the stop string starts)
    assert dec.generate("of a", max_new_tokens=6, raw=True, stop=["he Fr"]).text == "T"


def test_a_stop_string_cut_where_a_clean_up_joins_text_across_the_anchor_cuts_no_more_than_it():
    # With clean_up_tokenization_spaces, the text after the anchor ("a' s France" cleaned up to "a's France") is
    # not the result's text with a leading space more; places in one were used in the other, cutting too much.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "▁'", "▁s", "▁France", "▁a"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    checker = object.__new__(SpeculativeDecoder)  # (the cut reads the tokenizer and EOS ids only)
    checker.tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", clean_up_tokenization_spaces=True
    )
    checker.eos_ids = set()  # (and `Ends`, the call's ending ids: none)
    assert checker._decode([2, 3, 4]) == "' s France" and checker._in_context([2, 3, 4]) == "'s France"
    for stop, text in ((" France", "' s"), ("France", "' s "), ("s Fr", "' ")):
        assert checker._truncate([2, 3, 4], 9, 9, [stop], 3, Ends(frozenset(), frozenset())) == (
            [2, 3, 4],
            text,
            "stop",
        ), stop


def test_a_last_assistant_message_is_continued(target):
    # (before: the template closed it and opened a new assistant turn, so the model began its answer again;
    # transformers' text-generation pipeline continues a last assistant message, as this does)
    template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{% if not loop.last %} of {% endif %}{% endfor %}"
        "{% if add_generation_prompt %} of Paris{% endif %}"
    )
    tokenizer = sentencepiece_like_tokenizer(template)
    seen: list[list[int]] = []
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)), tokenizer)
    encode = dec.encode
    dec.encode = lambda prompt, raw=False: seen.append(encode(prompt, raw).tolist()) or encode(prompt, raw)
    answer = [{"role": "The", "content": "France"}]
    dec.generate(answer, max_new_tokens=2)
    assert seen[-1] == tokenizer.encode("The France of Paris", add_special_tokens=False)  # a new turn
    dec.generate([*answer, {"role": "assistant", "content": "is a"}], max_new_tokens=2)
    assert seen[-1] == tokenizer.encode("The France of assistant is a", add_special_tokens=False)  # continued


def test_openai_style_content_parts_are_joined_text(target):
    # (as vLLM's chat API takes them: a message's text parts, joined with newlines for a string-content template)
    tokenizer = sentencepiece_like_tokenizer("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{% endfor %}")
    seen: list[list[int]] = []
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), target_info(target)), tokenizer)
    encode = dec.encode
    dec.encode = lambda prompt, raw=False: seen.append(encode(prompt, raw).tolist()) or encode(prompt, raw)
    parts = [{"type": "text", "text": "France"}, {"type": "text", "text": "Paris"}]
    message = {"role": "The", "content": parts}
    dec.generate([message], max_new_tokens=2)
    dec.generate([{"role": "The", "content": "France\nParis"}], max_new_tokens=2)
    assert seen[0] == seen[1] and message["content"] is parts  # (the caller's message is left as it was)


def test_sampling_set_on_the_decoder_applies_to_its_calls(target, info):
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), info))
    dec.temperature, dec.top_k, dec.top_p = torch.tensor(0.7, dtype=torch.float64), np.int64(3), 0.9  # (any kind)
    assert dec.sampling == SamplingParams(0.7, 3, 0.9) and (dec.temperature, dec.top_k, dec.top_p) == (0.7, 3, 0.9)
    fresh = SpeculativeDecoder(target, NoneProposer(NoneConfig(), info), sampling=SamplingParams(0.7, 3, 0.9))
    assert dec.generate([1, 2], max_new_tokens=8, seed=3).token_ids == fresh.generate([1, 2], 8, seed=3).token_ids
    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0"):
        dec.temperature = -1
    # min_p 1 keeps only the top token: sampling then follows greedy decoding
    greedy = SpeculativeDecoder(target, NoneProposer(NoneConfig(), info)).generate([1, 2], 8).token_ids
    dec.temperature, dec.top_k, dec.top_p, dec.min_p = 2.0, 0, 1.0, np.float32(1.0)
    assert dec.sampling == SamplingParams(2.0, 0, 1.0, 1.0) and dec.min_p == 1.0
    assert dec.generate([1, 2], max_new_tokens=8, seed=3).token_ids == greedy
    assert dec.generate([1, 2], max_new_tokens=8, seed=3, min_p=0.0).token_ids != greedy  # (the call's own wins)


def test_a_proposer_built_for_another_target_is_refused_where_its_drafts_depend_on_it(target):
    from specframe.proposers.eagle import EagleProposer
    from specframe.proposers.medusa import MedusaProposer

    wider = target_info(tiny_llama(vocab_size=8, seed=1, hidden_size=32, num_layers=3))
    for proposer in (EagleProposer.random(wider), MedusaProposer.random(wider)):  # (they read its features)
        with pytest.raises(ProposerError, match=r"was built for another target: hidden_size 32 \(this target's: 16"):
            SpeculativeDecoder(target, proposer)
    for proposer in (DraftProposer.random(wider), NoneProposer(NoneConfig(), wider)):  # (only the vocabulary counts)
        assert len(SpeculativeDecoder(target, proposer).generate([1, 2], max_new_tokens=4).token_ids) == 4
    with pytest.raises(ProposerError, match=r"proposer 'draft' was built for another target: vocab_size 16 \(this"):
        SpeculativeDecoder(target, DraftProposer.random(target_info(tiny_llama(vocab_size=16, seed=1))))


def test_one_proposer_runs_one_call_at_a_time_across_decoders(target, info):
    # (two decoders given one proposer, used at once, would mix two sequences' state in it: refused by name)
    shared = DraftProposer.random(info)
    first, second = SpeculativeDecoder(target, shared), SpeculativeDecoder(target, shared)
    want = second.generate([1, 2], max_new_tokens=6).token_ids
    propose = shared.propose

    def propose_while_another_call_runs(state):
        second.generate([3], max_new_tokens=2)
        return propose(state)

    shared.propose = propose_while_another_call_runs
    with pytest.raises(ProposerError, match="proposer 'draft' is already running a generate call of another decoder"):
        first.generate([1, 2], max_new_tokens=6)
    shared.propose = propose  # (and after that failure, the proposer is free again)
    assert first.generate([1, 2], max_new_tokens=6).token_ids == want


def test_a_union_member_in_use_by_another_decoder_is_refused_and_marks_go_with_an_interrupt(target, info):
    from specframe.decoder import _PROPOSERS_IN_USE
    from specframe.proposers.union import UnionConfig, UnionProposer

    union = UnionProposer.random(info, UnionConfig(members=["none", "draft"]))
    alone = SpeculativeDecoder(target, union.members[1])
    propose = union.members[1].propose

    def propose_while_another_call_runs(state):
        alone.generate([3], max_new_tokens=2)
        return propose(state)

    union.members[1].propose = propose_while_another_call_runs
    with pytest.raises(ProposerError, match="union member 'draft': proposer 'draft' is already running"):
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=6)

    def propose_while_the_union_runs(state):  # (the other way round: the union is refused, naming its member)
        SpeculativeDecoder(target, union).generate([3], max_new_tokens=2)
        return propose(state)

    union.members[1].propose = propose_while_the_union_runs
    with pytest.raises(ProposerError, match="proposer 'union' \\(its member 'draft'\\) is already running"):
        alone.generate([1, 2], max_new_tokens=6)

    def interrupted(state):
        raise KeyboardInterrupt

    union.members[1].propose = interrupted
    with pytest.raises(KeyboardInterrupt):
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=6)
    assert not _PROPOSERS_IN_USE  # (no mark left behind: the proposer and its members are free)
    union.members[1].propose = propose
    assert len(alone.generate([3], max_new_tokens=2).token_ids) == 2


def test_a_tree_needs_an_attention_that_applies_its_mask(target, info):
    # An attention that takes no arbitrary 4-D mask (flash attention, or this causal-only one) would verify a
    # tree attending across its branches: refused. A chain uses the model's causal mask, so it still runs.
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def causal_only(module, query, key, value, attention_mask, scaling=None, **kwargs):
        n, past = query.shape[2], key.shape[2] - query.shape[2]  # (the mask it was given is ignored)
        allowed = torch.ones(n, n + past, dtype=torch.bool).tril(past)
        groups = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), allowed, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("causal_only_test", causal_only)
    AttentionMaskInterface.register("causal_only_test", sdpa_mask)
    target.set_attn_implementation("causal_only_test")
    try:
        want = reference_greedy(target, [1, 2, 3], 6)
        assert self_draft_decoder(target).generate([1, 2, 3], max_new_tokens=6).token_ids == want
        siblings = Proposal(torch.tensor([1, 2]), torch.tensor([-1, -1]), torch.ones(2, dtype=torch.bool))
        tree = SpeculativeDecoder(target, Malformed(info, lambda s: siblings))
        with pytest.raises(BadInputError, match="implementation 'causal_only_test' cannot apply a token tree's"):
            tree.generate([1, 2, 3], max_new_tokens=6)
    finally:
        target.set_attn_implementation("sdpa")


def slot_position_models():
    """Tiny targets that read positions from cache slots: ALiBi (Bloom, MPT, Falcon with alibi) and GPT-Neo's
    local attention; and their relatives that do not (Falcon with rotary embeddings, GPT-Neo all global)."""
    import transformers as T

    small = {"vocab_size": 16, "bos_token_id": None, "eos_token_id": None}
    configs = {
        "bloom": T.BloomConfig(hidden_size=16, n_layer=2, n_head=2, **small),
        "mpt": T.MptConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=64, **small),
        "falcon-alibi": T.FalconConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, alibi=True, **small),
        "gpt_neo-local": T.GPTNeoConfig(
            hidden_size=16,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
            **small,
        ),
        "falcon-rope": T.FalconConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, alibi=False, **small),
        "gpt_neo-global": T.GPTNeoConfig(
            hidden_size=16,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global"], 2]],
            max_position_embeddings=64,
            **small,
        ),
    }
    models = {}
    for name, config in configs.items():
        config.initializer_range = 0.5  # (peaked logits: no near-ties in the greedy comparisons)
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        model.generation_config.eos_token_id = None
        models[name] = model
    return models


def test_mpt_is_taken_as_alibi_whatever_its_config_says():
    import transformers as T

    from specframe.architectures import slot_positions

    # (transformers' MptModel builds ALiBi biases without reading attn_config.alibi)
    assert slot_positions(T.MptConfig(attn_config={"alibi": False})) == "adds ALiBi attention biases by cache slot"
    assert slot_positions(T.LlamaConfig()) is None


def test_targets_that_read_positions_from_cache_slots_verify_chains_but_refuse_trees():
    # Tree nodes sit side by side in the cache: ALiBi biases or a local window computed from slots would score a
    # node behind its siblings at the wrong distance (before: GPT-Neo's greedy output differed, MPT's logits
    # were off by 1e-2, Bloom and Falcon crashed with a bare ValueError).
    prompt = [(3 * j * j + 1) % 16 for j in range(9)]  # longer than GPT-Neo's window of 4
    for name, model in slot_position_models().items():
        info = target_info(model)
        want = reference_greedy(model, prompt, 12)
        assert self_draft_decoder(model).generate(prompt, max_new_tokens=12).token_ids == want, name
        siblings = Proposal(
            torch.tensor([want[1], want[1] ^ 1]), torch.tensor([-1, -1]), torch.ones(2, dtype=torch.bool)
        )
        tree = SpeculativeDecoder(
            model, Malformed(info, lambda s, p=siblings: p if s.max_depth >= 1 else Proposal.empty(s.tokens.device))
        )
        if name in ("falcon-rope", "gpt_neo-global"):
            assert tree.generate(prompt, max_new_tokens=12).token_ids == want, name
        else:
            with pytest.raises(BadInputError, match="by cache slot, so the nodes of a token tree"):
                tree.generate(prompt, max_new_tokens=12)


def test_tree_stats_count_depth_as_proposed_tokens_and_nodes_apart(target, info):
    # Each step proposes two siblings (depth 1, 2 nodes), one of them the target's greedy token: every step
    # accepts 1 of 1 proposed level. (DESIGN: acceptance_rate = accepted / tree depth proposed.)
    prompt, n = [1, 2, 3], 9
    want = reference_greedy(target, prompt, n)

    def siblings(state):
        if state.max_depth < 1:
            return Proposal.empty(state.tokens.device)
        right = want[len(state.tokens) - len(prompt)]
        return Proposal(torch.tensor([(right + 1) % 8, right]), torch.tensor([-1, -1]), torch.ones(2, dtype=torch.bool))

    res = SpeculativeDecoder(target, Malformed(info, siblings)).generate(prompt, max_new_tokens=n)
    assert res.token_ids == want
    s, steps = res.stats, 4  # prefill emits 1 token, then 4 steps of 2 tokens
    assert s["target_forwards"] == 1 + steps and s["mean_accepted_length"] == n / (1 + steps)
    assert s["proposed_tokens"] == steps and s["proposed_nodes"] == 2 * steps
    assert s["accepted_tokens"] == steps and s["acceptance_rate"] == 1.0 and s["accepted_by_position"] == [steps]


class CharTokenizer(LetterTokenizer):
    """Text to ids by character, no chat template: enough to reach the prompt checks for text and messages."""

    def __call__(self, text):
        return {"input_ids": [ord(c) % 8 for c in text]}


@pytest.mark.parametrize(
    "prompt, message",
    [
        (torch.tensor([[1, 2], [3, 4]]), r"a tensor prompt must be a 1-D tensor of token ids \(or \[1, N\]: one"),
        (torch.tensor([1.0, 2.0]), "a tensor prompt must hold integer token ids, got dtype torch.float32"),
        ([{"role": "user", "content": "ab"}], "a list of messages needs the tokenizer's chat template, and this"),
        ([1, {"role": "user", "content": "ab"}], "a list prompt must hold token ids .int. or messages"),
        ([{"role": "user"}], "a list prompt must hold token ids .int. or messages"),
        (["Hi", "Yo"], "generate takes one prompt per call, got a list of 2 strings .batches are not supported"),
        ([True, 2], r"a prompt of token ids must hold integers only: item 0 is True \(bool\)"),
        ([1, 2.0], r"a prompt of token ids must hold integers only: item 1 is 2.0 \(float\)"),
        ([{"role": "user", "content": 5}], "a message's content must be text, got int"),
        ([{"role": "user", "content": None}], r"message 0 has no content \(None\): give it text"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"message 0's content part 0 is of type 'image_url': only text parts",
        ),
        ([{"role": "user", "content": ["ab"]}], "message 0's content part 0 is a str: only text parts"),
        ([{"role": "user", "content": [{"type": "text"}]}], "content part 0 is of type 'text' but has no text"),
        ({"role": "user", "content": "ab"}, "unsupported prompt type dict"),
        ("", "the prompt is empty"),
        ("a\udcffb", "the prompt is not valid UTF-8 text"),
    ],
)
def test_malformed_prompts_are_named(target, info, prompt, message):
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), info), CharTokenizer())
    with pytest.raises(BadInputError, match=message):
        dec.generate(prompt, max_new_tokens=2)
    assert dec.generate("ab", max_new_tokens=2).token_ids  # (a good one runs)
    assert dec.generate(" \n", max_new_tokens=2).token_ids  # (white space is text)
    assert dec.generate(torch.tensor([1, 2], dtype=torch.int16), max_new_tokens=2).token_ids
    one = dec.generate(torch.tensor([1, 2]), max_new_tokens=2).token_ids  # (a tokenizer's [1, N] is one prompt)
    assert dec.generate(torch.tensor([[1, 2]]), max_new_tokens=2).token_ids == one


class WideTokenizer(CharTokenizer):
    """A tokenizer of 100 tokens, from another model than the 8-token target."""

    def __len__(self):
        return 100

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_a_tokenizer_wider_than_the_model_is_named(target, info):
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), info), WideTokenizer())
    with pytest.raises(BadInputError, match=r"id 98 out of range \[0, 8\): the tokenizer has 100 tokens, more than"):
        dec.generate("b", max_new_tokens=2)
    with pytest.raises(BadInputError, match=r"prompt token id 98 out of range \[0, 8\)$"):  # (ids: no tokenizer said)
        dec.generate([98], max_new_tokens=2)


class StrictChatTokenizer(CharTokenizer):
    """A chat template that refuses two user turns in a row, as many real ones do (`raise_exception`)."""

    chat_template = "strict"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        from jinja2 import Environment
        from jinja2.exceptions import TemplateError

        def raise_exception(text):
            raise TemplateError(text)

        template = (
            "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
            "{{ m['content'] }}{% endfor %}"
        )
        text = Environment().from_string(template).render(messages=messages, raise_exception=raise_exception)
        return self(text)["input_ids"]


def test_messages_a_chat_template_refuses_are_named(target, info):
    dec = SpeculativeDecoder(target, NoneProposer(NoneConfig(), info), StrictChatTokenizer())
    twice = [{"role": "user", "content": "ab"}, {"role": "user", "content": "cd"}]
    with pytest.raises(BadInputError, match="the tokenizer's chat template refused these messages: .*must alternate"):
        dec.generate(twice, max_new_tokens=2)
    for roleless in ([{"content": "ab"}], [{"role": " ", "content": "ab"}]):  # (the template reads roles)
        with pytest.raises(BadInputError, match="a message needs a 'role' .user, assistant...., got"):
            dec.generate(roleless, max_new_tokens=2)
        with pytest.raises(BadInputError, match="a list of messages needs the tokenizer's chat template, and raw"):
            dec.generate(roleless, max_new_tokens=2, raw=True)  # (joining the contents would lose the turns)
    assert dec.generate(twice[:1], max_new_tokens=2).token_ids  # (a good one runs)
    # (a tokenizer whose apply_chat_template cannot continue a last assistant message: said, not a TypeError)
    answered = [*twice[:1], {"role": "assistant", "content": "cd"}]
    with pytest.raises(BadInputError, match="the last .assistant. message cannot be continued: .*continue_final"):
        dec.generate(answered, max_new_tokens=2)


def test_a_draft_as_wide_as_the_target_passes_even_when_the_tokenizer_lists_more_tokens(info):
    # A GGUF's tokenizer can list a token (an added end-of-text) past both models' logits: the same file as
    # target and draft was refused ("logit widths 64 and 64 do not cover the tokenizer's 65 tokens").
    from dataclasses import replace

    from specframe.proposers.draft import check_same_vocabulary

    class Tokenizer:
        def __init__(self, n):
            self.n = n

        def get_vocab(self):
            return {f"t{i}": i for i in range(self.n)}

        def __len__(self):
            return self.n

    target = replace(info, tokenizer=Tokenizer(info.vocab_size + 1))
    check_same_vocabulary(tiny_llama(vocab_size=info.vocab_size, seed=1), Tokenizer(info.vocab_size + 1), target)
    with pytest.raises(BadInputError, match=rf"the draft's 7 logit rows do not cover the {info.vocab_size} tokens"):
        check_same_vocabulary(tiny_llama(vocab_size=7, seed=1), Tokenizer(info.vocab_size + 1), target)


def run_in_threads(n: int, work) -> list:
    """`work(i)` in n threads started together; their results in order (an exception is re-raised)."""
    import threading

    barrier, results = threading.Barrier(n), [None] * n

    def run(i):
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as e:  # (re-raised in the calling thread)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_one_decoder_called_from_two_threads_takes_the_calls_in_turn():
    """A server's thread pool may share one decoder: each call then keeps the target's cache and the proposer's
    state to itself, and a seed gives the output it gives alone (the calls overlapped and failed before)."""
    target = tiny_llama(vocab_size=16, hidden_size=32)
    dec = SpeculativeDecoder(target, DraftProposer.random(target_info(target), DraftConfig(num_speculative_tokens=3)))
    requests = [([1 + i % 5, 2, 3], 40, i) for i in range(12)]
    alone = [dec.generate(p, max_new_tokens=n, temperature=1.0, seed=s).token_ids for p, n, s in requests]
    together = run_in_threads(2, lambda t: [dec.generate(p, max_new_tokens=n, temperature=1.0, seed=s).token_ids
                                            for p, n, s in requests])  # fmt: skip
    assert together == [alone, alone]
    assert dec.cache is None  # (no call's cache is held between calls)


def test_no_proposer_state_of_a_call_is_held_after_it():
    # (a draft model's or a drafter's KV cache, sized by the request, stayed in memory until the next call)
    from specframe.proposers.eagle import EagleProposer
    from specframe.proposers.union import UnionConfig, UnionProposer

    target = tiny_llama(vocab_size=16, hidden_size=32)
    info = target_info(target)
    draft, eagle = DraftProposer.random(info), EagleProposer.random(info)
    union = UnionProposer.random(info, UnionConfig(members=["draft", "eagle"]))
    for proposer in (draft, eagle, union):
        SpeculativeDecoder(target, proposer).generate([1, 2, 3], max_new_tokens=12)
    held = [(p.cache, getattr(p, "pending_feats", None)) for p in (draft, eagle, *union.members)]
    assert held == [(None, None)] * 4

    class FailsLater(DraftProposer):
        def propose(self, state):
            raise RuntimeError("no draft today")

    failing = FailsLater.random(info)  # (a call that fails after the proposer began lets go too)
    with pytest.raises(ProposerError, match="no draft today"):
        SpeculativeDecoder(target, failing).generate([1, 2, 3], max_new_tokens=12)
    assert failing.cache is None


def test_an_end_that_calls_generate_on_its_decoder_is_refused_not_a_hang():
    import threading

    class Calling(NoneProposer):
        def end(self):
            self.decoder.generate([1, 2], max_new_tokens=2)

    target = tiny_llama(vocab_size=16, hidden_size=32)
    proposer = Calling(NoneConfig(), target_info(target))
    proposer.decoder = SpeculativeDecoder(target, proposer)
    raised = []

    def call():
        try:
            proposer.decoder.generate([1, 2, 3], max_new_tokens=4)
        except ProposerError as e:
            raised.append(str(e))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate waited forever on its own lock"
    assert raised and "was called from inside a generate call of the same decoder" in raised[0]


def test_a_proposer_whose_end_fails_is_named():
    class Failing(NoneProposer):
        def end(self):
            raise RuntimeError("cannot let go")

    target = tiny_llama(vocab_size=16, hidden_size=32)
    dec = SpeculativeDecoder(target, Failing(NoneConfig(), target_info(target)))
    with pytest.raises(ProposerError, match="proposer 'none' raised RuntimeError: cannot let go"):
        dec.generate([1, 2, 3], max_new_tokens=4)


def test_a_generate_call_from_inside_the_same_decoders_call_is_refused():
    target = tiny_llama(vocab_size=16)

    class Reentrant(NoneProposer):
        calls = 1

        def propose(self, state):
            if self.calls:
                self.calls -= 1
                self.decoder.generate([1, 2], max_new_tokens=2)
            return super().propose(state)

    proposer = Reentrant(NoneConfig(), target_info(target))
    proposer.decoder = dec = SpeculativeDecoder(target, proposer)
    with pytest.raises(SpecframeError, match="called from inside a generate call of the same decoder"):
        dec.generate([1, 2, 3], max_new_tokens=4)
    assert dec.generate([1, 2, 3], max_new_tokens=4, temperature=0.0).token_ids == reference_greedy(
        target, [1, 2, 3], 4
    )


def test_random_weights_built_in_parallel_threads_are_each_seeds_own():
    """PyTorch's initialisers draw from the global generator: seeded builds in two threads at once mixed their
    draws (tiny targets and the random draft, Medusa and EAGLE builds of the conformance suite)."""
    from specframe.proposers.eagle import EagleProposer
    from specframe.proposers.medusa import MedusaProposer

    info = target_info(tiny_llama(vocab_size=16, hidden_size=32))

    def weights(build, seed):
        return torch.cat([p.detach().flatten().float() for p in build(seed)])

    builds = {
        "tiny_llama": lambda s: tiny_llama(vocab_size=16, hidden_size=32, seed=s).parameters(),
        "draft": lambda s: DraftProposer.random(info, seed=s).model.parameters(),
        "medusa": lambda s: MedusaProposer.random(info, seed=s).heads.parameters(),
        "eagle": lambda s: EagleProposer.random(info, seed=s).drafter.parameters(),
    }
    for name, build in builds.items():
        alone = [weights(build, s) for s in (0, 1)]
        for _ in range(4):
            together = run_in_threads(2, lambda s, build=build: weights(build, s))
            assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), name


def test_a_seeded_build_may_call_another():
    """A plugin's random() may build a tiny model (itself seeded) inside its own seeded block."""
    import threading

    from specframe.proposer import seeded

    built = []

    def nested():
        with seeded(5):
            built.append(tiny_llama(vocab_size=16, seed=1))

    thread = threading.Thread(target=nested, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert built, "a seeded block inside another one (same thread) did not finish"
    alone = tiny_llama(vocab_size=16, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(built[0].parameters(), alone.parameters(), strict=True))


def test_a_seeded_build_leaves_the_gpu_generators_alone(monkeypatch):
    # (random weights are drawn on the CPU; torch.manual_seed also reseeded every CUDA generator, which the block
    # does not put back: a user's seeded GPU draws changed)
    from specframe.proposer import seeded

    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    with seeded(3):
        drawn = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(2)) and reseeded == [3]  # (only the last: the test's own)


def test_a_copied_decoder_has_its_own_lock():
    import copy

    target = tiny_llama(vocab_size=16)
    dec = SpeculativeDecoder(target, DraftProposer.random(target_info(target)))
    twin = copy.deepcopy(dec)
    assert twin._one_call is not dec._one_call and copy.copy(dec)._one_call is not dec._one_call
    assert twin.generate([1, 2, 3], max_new_tokens=8).token_ids == dec.generate([1, 2, 3], max_new_tokens=8).token_ids


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_after_steps_drafts_as_a_fresh_draft_on_the_same_tokens(target, info, temperature):
    """The draft's own cache after partial acceptance holds exactly the accepted tokens: its next proposal is
    a fresh draft's on the same tokens (a rollback left one position off was caught only by crashes elsewhere)."""
    draft = DraftProposer.random(info, DraftConfig(num_speculative_tokens=3), seed=6)  # (accepts 6 of 63 greedy)
    steps = recorded_proposals(draft)
    out = SpeculativeDecoder(target, draft).generate([1, 2, 3], max_new_tokens=30, temperature=temperature, seed=0)
    rejected = out.stats["proposed_tokens"] - out.stats["accepted_tokens"]
    assert out.stats["accepted_tokens"] > 0 and rejected > 0  # (partial acceptance: rolled back)
    assert len(steps) == out.stats["target_forwards"] - 1  # (a proposal before every verification)
    for step in steps:
        fresh = DraftProposer.random(info, DraftConfig(num_speculative_tokens=3), seed=6)
        again = fresh_proposal(fresh, target, step.tokens, step.max_depth, SamplingParams(temperature))
        if temperature == 0:
            assert again.tokens.tolist() == step.proposal.tokens.tolist()
        else:  # (sampled tokens differ by the draws; the q of the first one is the draft's next distribution)
            torch.testing.assert_close(again.draft_probs[:1], step.proposal.draft_probs[:1], rtol=1e-5, atol=1e-6)


def test_a_target_that_keeps_no_kv_cache_is_refused_not_served_wrong():
    # (GPT-1's forward ignores past_key_values: each step saw its one token alone, and the output was wrong)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("openai-gpt", vocab_size=8, n_embd=16, n_layer=2, n_head=2, n_positions=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    dec = SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
    with pytest.raises(BadInputError, match=r"the target \(OpenAIGPTLMHeadModel\) did not fill the KV cache"):
        dec.generate([1, 2, 3], max_new_tokens=4)
