"""`proposer.confidence_threshold` for draft, eagle and medusa: drafts shrink where the proposer is unsure.

The thresholded proposal must be exactly the unthresholded one cut to the nodes whose cumulative draft
probability reaches the threshold (so the option changes sizes, never which tokens are tried first), decoding
stays exact (the conformance suite; its power checks include `keep_if_likely`, the threshold applied after
drawing a sampled token), and saved values and bad values behave.
"""

import copy
import math

import pytest
import torch

from specframe import SpeculativeDecoder
from specframe.decoder import target_info
from specframe.errors import ConfigError
from specframe.kv_cache import new_cache
from specframe.proposer import DecodeState
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.medusa import MedusaConfig, MedusaProposer
from specframe.sampling import SamplingParams
from specframe.testing import conformance
from specframe.testing.suite import VARIANT_SETTINGS, ProposerConformance
from specframe.testing.tiny import tiny_llama


class TestDraftSampledWithThreshold(ProposerConformance):
    proposer_class = DraftProposer
    proposer_config = DraftConfig(num_speculative_tokens=3, confidence_threshold=0.3)
    sampling_settings = VARIANT_SETTINGS


class TestDraftGreedyWithThreshold(ProposerConformance):
    proposer_class = DraftProposer
    proposer_config = DraftConfig(num_speculative_tokens=3, greedy=True, confidence_threshold=0.3)
    sampling_settings = VARIANT_SETTINGS


class TestEagleWithThreshold(ProposerConformance):
    proposer_class = EagleProposer
    proposer_config = EagleConfig(depth=4, top_k=3, total_tokens=10, confidence_threshold=0.05)
    sampling_settings = VARIANT_SETTINGS


class TestMedusaWithThreshold(ProposerConformance):
    proposer_class = MedusaProposer
    proposer_config = MedusaConfig(confidence_threshold=0.02)
    sampling_settings = VARIANT_SETTINGS


def target16():
    return tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)


def state_after(tokens, max_depth=100, temperature=0.0):
    return DecodeState(
        tokens, tokens.numel(), SamplingParams(temperature=temperature), torch.Generator(), max_depth=max_depth
    )


@torch.no_grad()
def begun(cls, target, config, seed, tokens):
    """A random-weight proposer begun on tokens[:-1] with the target's features."""
    p = cls.random(target_info(target), config, seed=seed)
    out = target(input_ids=tokens[None, :-1], output_hidden_states=True)
    p.begin(tokens[:-1], {-1: out.hidden_states[-1][0]})
    return p


def as_paths(proposal):
    """Each node as its path of tokens from the root (a tree's identity, whatever the node order)."""
    paths = []
    for i, parent in enumerate(proposal.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else ()) + (int(proposal.tokens[i]),))
    return paths


PROMPTS = [torch.tensor(t) for t in ([2, 7, 1, 8, 2, 8], [3, 1, 4, 1, 5], [9, 9, 0, 4], [5, 11, 13, 2, 6, 1])]


def test_eagle_threshold_cuts_the_full_tree_at_the_threshold():
    target = target16()
    mean_size = {}
    for threshold in (0.01, 0.05, 0.2, 0.6):
        mean_size[threshold] = eagle_cut_sizes(target, threshold) / len(PROMPTS)
    sizes = list(mean_size.values())
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] >= 1, mean_size


def eagle_cut_sizes(target, threshold):
    """Check the thresholded tree against the full one on every prompt; return the total thresholded size."""
    sizes = []
    for tokens in PROMPTS:
        full = begun(EagleProposer, target, EagleConfig(depth=4, top_k=3, total_tokens=30), 7, tokens)
        cut = begun(
            EagleProposer,
            target,
            EagleConfig(depth=4, top_k=3, total_tokens=30, confidence_threshold=threshold),
            7,
            tokens,
        )
        whole = full.propose(state_after(tokens))
        kept = cut.propose(state_after(tokens))
        scores = full.last_scores.tolist()
        # The best first token always; every other node when its cumulative probability reaches the threshold.
        expected = [
            p
            for i, (p, s) in enumerate(zip(as_paths(whole), scores, strict=True))
            if i == 0 or s >= math.log(threshold)
        ]
        assert as_paths(kept) == expected and len(kept) >= 1
        assert all(s >= math.log(threshold) for s in cut.last_scores.tolist()[1:])
        assert cut.cache.get_seq_length() == cut.committed  # drafted nodes cropped, empty or not
        sizes.append(len(kept))
    return sum(sizes)


def test_eagle_high_threshold_drafts_the_best_token_alone_and_stays_exact():
    target = target16()
    config = EagleConfig(depth=3, top_k=2, total_tokens=6, confidence_threshold=0.99)
    rec = []

    class Spy(EagleProposer):
        def propose(self, state):
            proposal = super().propose(state)
            rec.append(len(proposal))
            return proposal

    p = Spy.random(target_info(target), config, seed=1)
    res = SpeculativeDecoder(target, p).generate([1, 2, 3], max_new_tokens=20)
    assert res.token_ids == conformance.reference_greedy(target, [1, 2, 3], 20)
    assert set(rec) <= {0, 1} and 1 in rec  # 0 only where the engine's budget allows no draft


@pytest.mark.parametrize("tree", [None, [[1], [2], [1, 0], [2, 1], [1, 0, 0]]], ids=["default", "without-0"])
@pytest.mark.parametrize("threshold", [0.005, 0.02, 0.1])
def test_medusa_threshold_keeps_the_nodes_whose_path_probability_reaches_it(threshold, tree):
    target = target16()
    full = MedusaProposer.random(target_info(target), MedusaConfig(dtype="float32", tree=tree), seed=2)
    cut = MedusaProposer.random(
        target_info(target), MedusaConfig(dtype="float32", tree=tree, confidence_threshold=threshold), seed=2
    )
    for tokens in PROMPTS:
        feature = torch.randn(tokens.numel() - 1, 32, generator=torch.Generator().manual_seed(int(tokens.sum())))
        for p in (full, cut):
            p.begin(tokens[:-1], {-1: feature})
        whole = full.propose(state_after(tokens))
        kept = cut.propose(state_after(tokens))
        # The path probability of each node of the full tree, from the heads' own softmax.
        probs = []
        h = feature[-1]
        head_probs = [torch.softmax(full.heads.heads[k](h) @ full.lm_rows.T, -1) for k in range(full.used_heads)]
        for i, parent in enumerate(whole.parents.tolist()):
            depth = whole.depths()[i]
            token = int(whole.tokens[i])
            own = float(head_probs[depth - 1][token])
            probs.append(own * (probs[parent] if parent >= 0 else 1.0))
        expected = [
            path for i, (path, pr) in enumerate(zip(as_paths(whole), probs, strict=True)) if i == 0 or pr >= threshold
        ]  # node 0, the tree's first, always kept
        assert as_paths(kept) == expected and len(kept) >= 1
        assert all(-1 <= q < i for i, q in enumerate(kept.parents.tolist()))


@torch.no_grad()
def greedy_chain_with_confidence(p, tokens, gamma):
    """The draft's greedy chain and each prefix's cumulative probability, drafted one forward at a time."""
    p.cache, p.cached = new_cache(p.model), 0
    logits = p._next_logits(tokens)
    chain, conf, confs = [], 1.0, []
    for _ in range(gamma):
        x = int(logits.argmax())
        conf *= float(torch.softmax(logits, -1)[x])
        chain.append(x)
        confs.append(conf)
        logits = p._next_logits(torch.tensor([x]))
    return chain, confs


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.7])
def test_draft_greedy_chain_stops_where_its_confidence_falls_below_the_threshold(threshold):
    target = target16()
    info = target_info(target)
    lengths = []
    for tokens in PROMPTS:
        p = DraftProposer.random(info, DraftConfig(num_speculative_tokens=4, confidence_threshold=threshold), seed=4)
        p.begin(tokens[:-1], {})
        proposal = p.propose(state_after(tokens))
        ref = DraftProposer.random(info, DraftConfig(num_speculative_tokens=4), seed=4)
        chain, confs = greedy_chain_with_confidence(ref, tokens, 4)
        n = max(1, sum(1 for c in confs if c >= threshold))  # confidences only fall; the first token always
        assert proposal.tokens.tolist() == chain[:n]
        # Fed: every kept token but a full chain's last, or a first token already below the threshold.
        assert p.fed_drafts == (3 if n == 4 else n if confs[n - 1] >= threshold else n - 1)
        lengths.append(n)
    if threshold == 0.7:
        assert min(lengths) < 4


class CheckedDraft(DraftProposer):
    """Before each proposal, checks that its cache plus the uncached tokens gives a fresh draft's logits."""

    lengths: list

    def propose(self, state):
        fresh = new_cache(self.model)
        ref = self.model(input_ids=state.tokens[None], cache=fresh, use_cache=True).logits[0, -1]
        mine = self.model(
            input_ids=state.tokens[None, self.cached :], cache=copy.deepcopy(self.cache), use_cache=True
        ).logits[0, -1]
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
        proposal = super().propose(state)
        self.lengths.append((state.max_depth, len(proposal), self.fed_drafts))
        return proposal


@pytest.mark.parametrize("greedy, threshold", [(False, 0.05), (True, 0.1)], ids=["sampled", "greedy"])
def test_draft_cache_is_right_after_cut_and_full_chains(greedy, threshold):
    """Chains cut short and chains of full length both leave the draft's cache holding exactly the sequence."""
    target = target16()
    config = DraftConfig(num_speculative_tokens=3, greedy=greedy, confidence_threshold=threshold, dtype="float32")
    p = CheckedDraft.random(target_info(target), config, seed=5)
    p.lengths = []
    SpeculativeDecoder(target, p).generate([1, 2, 3], max_new_tokens=40, temperature=1.0, seed=3)
    full = [fed for depth, n, fed in p.lengths if depth >= 3 and n == 3]
    cut = [fed for depth, n, fed in p.lengths if depth >= 3 and n < 3]
    assert full and cut, p.lengths
    assert set(full) == {2}  # a full chain feeds all but its last token
    # A cut chain fed its last token unless its own confidence was already below the threshold.
    assert all(fed in (n - 1, n) for depth, n, fed in p.lengths if depth >= 3 and n < 3)


@torch.no_grad()
def test_sampled_chain_with_a_threshold_is_a_prefix_of_the_same_seed_chain():
    target = target16()
    info = target_info(target)
    cut_somewhere = False
    for seed, tokens in enumerate(PROMPTS):
        chains = []
        for threshold in (0.0, 0.2):
            config = DraftConfig(num_speculative_tokens=4, confidence_threshold=threshold)
            p = DraftProposer.random(info, config, seed=6)
            p.begin(tokens[:-1], {})
            state = state_after(tokens, temperature=1.0)
            state.generator.manual_seed(seed)
            chains.append(p.propose(state).tokens.tolist())
        whole, cut = chains
        assert len(whole) == 4 and 1 <= len(cut) and cut == whole[: len(cut)]
        cut_somewhere |= len(cut) < 4
    assert cut_somewhere


@pytest.mark.parametrize("make", [DraftConfig, EagleConfig, MedusaConfig])
@pytest.mark.parametrize("value", [1.0, -0.1, "high", True])
def test_bad_thresholds_are_refused(make, value):
    with pytest.raises(ConfigError, match="proposer.confidence_threshold must be a number"):
        make(confidence_threshold=value)


@pytest.mark.parametrize("name", ["draft", "eagle", "medusa"])
def test_threshold_from_the_command_line(name):
    from specframe.config import load_config

    cfg = load_config(overrides=[f"proposer.name={name}", "proposer.confidence_threshold=0.4"])
    assert cfg.proposer.confidence_threshold == 0.4
    for bad, message in (("1.5", "must be a number in \\[0, 1\\), got 1.5"), ("high", "could not be converted")):
        with pytest.raises(ConfigError, match=f"proposer.confidence_threshold.*{message}"):
            load_config(overrides=[f"proposer.name={name}", f"proposer.confidence_threshold={bad}"])


def test_saved_thresholds_are_the_default_and_the_config_overrides_them(tmp_path):
    target = target16()
    info = target_info(target)
    # eagle: tree_shape.confidence_threshold; medusa: confidence_threshold in medusa_config.json
    eagle = EagleProposer.random(info, EagleConfig(), seed=0)
    saved = EagleProposer(EagleConfig(), info, eagle.drafter, eagle.vocab_ids, {"confidence_threshold": 0.25})
    assert saved.min_score == pytest.approx(math.log(0.25))
    off = EagleProposer(
        EagleConfig(confidence_threshold=0), info, eagle.drafter, eagle.vocab_ids, {"confidence_threshold": 0.25}
    )
    assert off.min_score == -math.inf
    with pytest.raises(ConfigError, match="the confidence_threshold saved with the drafter must be a number"):
        EagleProposer(EagleConfig(), info, eagle.drafter, eagle.vocab_ids, {"confidence_threshold": 2})
    medusa = MedusaProposer.random(info, MedusaConfig(), seed=0)
    tree = medusa.tree
    assert MedusaProposer(MedusaConfig(), info, medusa.heads, medusa.vocab_ids, tree, 0.1).threshold == 0.1
    assert (
        MedusaProposer(
            MedusaConfig(confidence_threshold=0.3), info, medusa.heads, medusa.vocab_ids, tree, 0.1
        ).threshold
        == 0.3
    )
    # draft: confidence_threshold in a shared draft's draft_config.json
    from specframe.shared_draft import saved_threshold

    assert saved_threshold({"confidence_threshold": 0.4}) == 0.4
    assert saved_threshold({}) is None
    draft = DraftProposer.random(info, DraftConfig(), seed=0)
    assert DraftProposer(DraftConfig(), info, draft.model, None, saved_threshold=0.4).threshold == 0.4
    assert (
        DraftProposer(DraftConfig(confidence_threshold=0.0), info, draft.model, None, saved_threshold=0.4).threshold
        == 0.0
    )
    with pytest.raises(ConfigError, match="the confidence_threshold saved with the draft must be a number"):
        DraftProposer(DraftConfig(), info, draft.model, None, saved_threshold="high")


def test_saved_medusa_threshold_is_loaded_and_a_bad_one_names_the_file(tmp_path):
    from specframe.proposers.medusa import save_heads

    target = target16()
    info = target_info(target)
    heads = MedusaProposer.random(info, MedusaConfig(dtype="float32"), seed=0)
    save_heads(heads.heads, heads.vocab_ids, target, tmp_path / "ok", heads.tree, {"confidence_threshold": 0.2})
    assert MedusaProposer.from_config(MedusaConfig(model=str(tmp_path / "ok")), info).threshold == 0.2
    save_heads(heads.heads, heads.vocab_ids, target, tmp_path / "bad", heads.tree, {"confidence_threshold": 1.5})
    with pytest.raises(ConfigError, match="confidence_threshold in .*bad/medusa_config.json must be a number"):
        MedusaProposer.from_config(MedusaConfig(model=str(tmp_path / "bad")), info)
