"""`union`: merging members' trees, telling each member what it needs, config errors, and exactness."""

import re

import pytest
import torch

from specframe import Proposal, SpeculativeDecoder, load_config
from specframe.errors import ConfigError, ProposerError
from specframe.plugins import get_registry
from specframe.proposer import Acceptance, DecodeState
from specframe.proposers.draft import DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.union import UnionConfig, UnionProposer, merge_proposals
from specframe.sampling import SamplingParams
from specframe.testing import conformance
from specframe.testing.conformance import reference_greedy
from specframe.testing.suite import VARIANT_SETTINGS, ProposerConformance


def det(tokens, parents):
    n = len(tokens)
    return Proposal(torch.tensor(tokens), torch.tensor(parents), torch.ones(n, dtype=torch.bool))


def sampled(tokens, parents, q):
    n = len(tokens)
    return Proposal(torch.tensor(tokens), torch.tensor(parents), torch.zeros(n, dtype=torch.bool), q)


def test_deterministic_nodes_with_the_same_parent_and_token_are_shared():
    a = det([5, 6, 7], [-1, 0, 1])  # chain 5 6 7
    b = det([5, 6, 2, 3], [-1, 0, 1, -1])  # chain 5 6 2, and 3 at the root
    m = merge_proposals([a, b], vocab_size=8, device="cpu")
    p = m.proposal
    assert p.tokens.tolist() == [5, 6, 7, 2, 3]
    assert p.parents.tolist() == [-1, 0, 1, 1, -1]
    assert p.deterministic.all() and p.draft_probs is None
    assert m.owners == [{0: 0, 1: 0}, {0: 1, 1: 1}, {0: 2}, {1: 2}, {1: 3}]


def test_sampled_nodes_are_never_merged_and_keep_their_q():
    qa = torch.full((2, 8), 1 / 8)
    qb = torch.eye(8)[[5]] * 0.5 + 0.5 / 8
    a = sampled([5, 1], [-1, 0], qa)
    b = sampled([5], [-1], qb)
    c = det([5, 4], [-1, 0])
    m = merge_proposals([a, b, c], vocab_size=8, device="cpu")
    p = m.proposal
    assert p.tokens.tolist() == [5, 1, 5, 5, 4]  # two sampled 5s and one deterministic 5 under the root
    assert p.parents.tolist() == [-1, 0, -1, -1, 3]
    assert p.deterministic.tolist() == [False, False, False, True, True]
    assert torch.equal(p.draft_probs[0], qa[0]) and torch.equal(p.draft_probs[1], qa[1])
    assert torch.equal(p.draft_probs[2], qb[0])
    assert m.owners[3] == {2: 0} and m.owners[4] == {2: 1}


def test_a_members_own_duplicate_siblings_are_not_merged():
    a = det([5, 5, 1], [-1, -1, 1])  # two 5s at the root (a member may propose that), 1 under the second
    b = det([5, 2], [-1, 0])
    m = merge_proposals([a, b], vocab_size=8, device="cpu")
    assert m.proposal.tokens.tolist() == [5, 5, 1, 2]
    assert m.proposal.parents.tolist() == [-1, -1, 1, 0]
    assert m.owners == [{0: 0, 1: 0}, {0: 1}, {0: 2}, {1: 1}]  # b's 5 joins a's first 5 only


def test_a_union_built_by_hand_must_have_the_members_its_config_names(info):
    # (before: UnionConfig(members=["ngram"]) with no member proposers decoded, proposing nothing, without a word)
    draft = DraftProposer.random(info)
    with pytest.raises(ConfigError, match=r"^union: members \[\] were given for proposer.members \['ngram'\]"):
        UnionProposer(UnionConfig(members=["ngram"]), info, [])
    with pytest.raises(ConfigError, match=r"members \['draft'\] were given for proposer.members \['eagle', 'draft'\]"):
        UnionProposer(UnionConfig(members=["eagle", "draft"]), info, [draft])
    assert UnionProposer(UnionConfig(members=["draft"]), info, [draft]).members == [draft]


def test_empty_members_give_an_empty_proposal():
    m = merge_proposals([Proposal.empty(), Proposal.empty()], vocab_size=8, device="cpu")
    assert len(m.proposal) == 0


class Recorder(DraftProposer):
    """A random draft that records what it is told after each step."""

    name = "recorder"
    seen: list

    def accepted(self, result: Acceptance) -> None:
        self.seen.append((list(result.accepted_nodes), list(result.accepted_tokens), result.next_token))
        super().accepted(result)


def test_each_member_learns_its_own_nodes_and_every_accepted_token(info):
    config = UnionConfig(members=["draft", "draft"])
    union = UnionProposer.random(info, config)
    union.members = [Recorder.random(info, cfg, seed=i + 1) for i, cfg in enumerate(config.member_configs)]
    for member in union.members:
        member.seen = []
    union.begin(torch.tensor([1, 2]), {})
    state = DecodeState(torch.tensor([1, 2, 3]), 2, SamplingParams(0.0, 0, 1.0), torch.Generator(), 8)
    merged = union.propose(state)
    owners = union.merged.owners
    # Say the target accepted member 1's whole chain; member 0's part of the path ends where the chains differ.
    path = [n for n in range(len(merged)) if 1 in owners[n]]
    tokens = merged.tokens[path].tolist()
    shared = next((i for i, n in enumerate(path) if 0 not in owners[n]), len(path))
    assert shared < len(path), "the test needs two chains that differ"
    union.accepted(Acceptance(path, tokens, 0, {}))
    assert union.members[1].seen == [([owners[n][1] for n in path], tokens, 0)]
    assert union.members[0].seen == [([owners[n][0] for n in path[:shared]], tokens, 0)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_members_left_by_the_path_roll_back_only_their_rejected_drafts(target, info, temperature):
    """Two different drafts: the path often leaves a member's chain; each KV cache must still be exact."""
    config = UnionConfig(members=["draft", "draft"], options={"draft": {"num_speculative_tokens": 3}})
    union = UnionProposer.random(info, config)
    left, kept = [], {}
    for draft in union.members:
        inner = draft.accepted
        draft.accepted = lambda r, inner=inner: left.append(len(r.accepted_nodes) < len(r.accepted_tokens)) or inner(r)
        draft.end = lambda draft=draft: kept.update({id(draft): draft.cache})  # (the cache as the call left it)
    out = SpeculativeDecoder(target, union).generate([1, 2, 3], max_new_tokens=40, temperature=temperature, seed=0)
    if temperature == 0.0:
        assert out.token_ids == reference_greedy(target, [1, 2, 3], 40)
    assert any(left), "the test needs a step whose path left a member's chain"
    # Each member's cache holds exactly the emitted sequence: its next logits equal a fresh forward's.
    seq = torch.tensor([1, 2, 3, *out.token_ids])
    for draft in union.members:
        draft.cache = kept[id(draft)]
        cached = draft._next_logits(seq[draft.cached :])
        fresh = draft.model(input_ids=seq[None]).logits[0, -1].float()
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


def test_eagle_member_drafts_as_it_would_alone(target, info):
    """eagle + a draft: eagle must be fed every accepted token and feature, the draft's included. Wherever the
    union and eagle alone reach the same sequence, eagle proposes the same tree."""
    eagle_options = {"depth": 2, "top_k": 2, "total_tokens": 4}
    config = UnionConfig(members=["draft", "eagle"], options={"eagle": eagle_options})
    union = UnionProposer.random(info, config)
    alone = EagleProposer.random(info, EagleConfig(**eagle_options), seed=1)  # member 1 of the union: seed 0 + 1
    trees = {}
    for key, eagle in (("union", union.members[1]), ("alone", alone)):
        inner = eagle.propose

        def record(state, inner=inner, key=key):
            p = inner(state)
            trees[(key, tuple(state.tokens.tolist()))] = (p.tokens.tolist(), p.parents.tolist())
            return p

        eagle.propose = record
    prompt = [1, 2, 3]
    out = SpeculativeDecoder(target, union).generate(prompt, max_new_tokens=40)
    assert out.token_ids == reference_greedy(target, prompt, 40)
    SpeculativeDecoder(target, alone).generate(prompt, max_new_tokens=40)
    common = [k for (who, k) in trees if who == "union" and ("alone", k) in trees and len(k) > len(prompt) + 1]
    assert len(common) >= 3, f"the test needs sequences both runs reached, got {len(common)}"
    for k in common:
        assert trees[("union", k)] == trees[("alone", k)], k
    assert union.hidden_state_layers == (-1,)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="proposer.members must be a non-empty list"):
        UnionConfig(members=[])
    with pytest.raises(ConfigError, match="unknown proposer 'nope'"):
        UnionConfig(members=["nope"])
    with pytest.raises(ConfigError, match="cannot have a union as a member"):
        UnionConfig(members=["union"])
    with pytest.raises(ConfigError, match="proposer.options.draft must be a mapping of draft's options, got 3"):
        UnionConfig(members=["draft"], options={"draft": 3})
    with pytest.raises(ConfigError, match="proposer.options.medusa: 'medusa' is not a member"):
        UnionConfig(members=["draft"], options={"medusa": {}})
    with pytest.raises(ConfigError, match="proposer.options.draft.num_speculative_tokens"):
        UnionConfig(members=["draft"], options={"draft": {"num_speculative_tokens": 0}})
    with pytest.raises(ConfigError, match=r"^proposer\.options\.draft\.no_such_key: Key 'no_such_key' not in"):
        UnionConfig(members=["draft"], options={"draft": {"no_such_key": 1}})
    with pytest.raises(ConfigError, match=r"^proposer\.options\.draft\.num_speculative_tokens must be >= 1"):
        UnionConfig(members=["draft"], options={"draft": {"num_speculative_tokens": 0}})
    # A member's options given on the union itself are pointed to where they go; other unknown keys are not.
    from specframe.config import load_config

    with pytest.raises(
        ConfigError,
        match=r"^proposer\.eagle: .*go under proposer\.options\.eagle: proposer\.options\.eagle\.OPTION=VALUE\)$",
    ):
        load_config(overrides=["proposer.name=union", "proposer.eagle.model=x"])
    with pytest.raises(
        ConfigError, match=r"^proposer\.membrs: Key 'membrs' not in 'UnionConfig'. Did you mean: 'members'\?$"
    ):
        load_config(overrides=["proposer.name=union", "proposer.membrs=[eagle]"])
    for given in ("[1]", "3"):  # (OmegaConf's own words were "Cannot merge incompatible container types")
        example = r"\(e\.g\. proposer\.options\.ngram\.num_speculative_tokens=6\)"
        with pytest.raises(
            ConfigError, match=rf"^proposer\.options must be a mapping {example}, got {re.escape(given)}$"
        ):
            load_config(overrides=["proposer.name=union", f"proposer.options={given}"])
    for given in ("[1]", "3"):  # a member's options, through the config loader (was "'ListConfig' is incompatible")
        words = r"^proposer\.options\.ngram must be a mapping of ngram's options, got "
        with pytest.raises(ConfigError, match=words + re.escape(given)):
            load_config(overrides=["proposer.name=union", f"proposer.options.ngram={given}"])
    # `KEY=` gives a member no options of its own; a list over the file's mapping names the key (it was a TypeError,
    # "Cannot merge incompatible container types", naming none)
    assert load_config(overrides=["proposer.name=union", "proposer.options.ngram="]).proposer.options["ngram"] == {}
    with pytest.raises(ConfigError, match=r"^override 'proposer\.options=\[1\]': proposer\.options is a mapping; "):
        load_config("union.yaml", ["proposer.options=[1]"])


def test_a_member_that_is_installed_but_not_usable_is_named_so(monkeypatch):
    from specframe import plugins

    # Autoloading off: the plugin may well be installed, so no "pip install" hint.
    monkeypatch.setattr(plugins, "_registry", plugins.build_registry(autoload=False))
    with pytest.raises(ConfigError, match="plugins are not loaded: SPECFRAME_DISABLE_PLUGIN_AUTOLOAD") as e:
        UnionConfig(members=["eagle", "ngram"])
    assert "pip install" not in str(e.value)
    # Two plugins register the name: neither is used, and the union says so.
    registry = plugins.build_registry(autoload=False)
    registry.contested["ngram"] = "plugin 'ngram' (specframe-ngram) and plugin 'other' (other)"
    monkeypatch.setattr(plugins, "_registry", registry)
    with pytest.raises(ConfigError, match="proposer.members: proposer 'ngram' is registered by two plugins"):
        UnionConfig(members=["ngram"])
    # Not installed at all: the hint.
    registry = plugins.build_registry(autoload=False)
    registry.autoload = True
    monkeypatch.setattr(plugins, "_registry", registry)
    with pytest.raises(
        ConfigError,
        match=r"unknown proposer 'ngram'; installed: .* \('ngram' comes from the specframe-ngram plugin, "
        r"plugins/specframe-ngram in specframe's repository: pip install \./plugins/specframe-ngram\)",
    ):
        UnionConfig(members=["ngram"])


def test_a_member_that_cannot_be_built_is_named_with_its_own_keys(info):
    # No drafter ships for a tiny random target: eagle's "proposer.model is required" names the union's key.
    with pytest.raises(ConfigError, match=r"union member 'eagle': proposer\.options\.eagle\.model is required"):
        UnionProposer.from_config(UnionConfig(members=["none", "eagle"]), info)


def test_on_a_cpu_the_ngram_member_drafts_shorter_unless_told(info):
    # (CPU_MEMBER_OPTIONS: each key the user leaves unset; on another device the member's own defaults)
    import dataclasses

    from specframe.testing.suite import require_proposers

    require_proposers("ngram")
    union = UnionProposer.from_config(UnionConfig(members=["none", "ngram"]), info)
    ngram = union.members[1].config
    assert (ngram.num_speculative_tokens, ngram.max_candidates) == (6, 1)
    assert (
        union.shape_choice == "on this CPU, ngram num_speculative_tokens=6, max_candidates=1 (union.CPU_MEMBER_OPTIONS)"
    )
    told = UnionConfig(members=["none", "ngram"], options={"ngram": {"num_speculative_tokens": 3}})
    ngram = UnionProposer.from_config(told, info).members[1].config
    assert (ngram.num_speculative_tokens, ngram.max_candidates) == (3, 1)
    elsewhere = UnionProposer.from_config(
        UnionConfig(members=["none", "ngram"]), dataclasses.replace(info, device="meta")
    )
    alone = get_registry().get("ngram").cls.config_class()
    assert elsewhere.members[1].config == alone and not hasattr(elsewhere, "shape_choice")
    # `specframe check` builds the union with random weights: the members it checks are the ones that run there.
    checked = UnionProposer.random(info, UnionConfig(members=["none", "ngram"]))
    assert (checked.members[1].config.num_speculative_tokens, checked.members[1].config.max_candidates) == (6, 1)
    checked = UnionProposer.random(dataclasses.replace(info, device="meta"), UnionConfig(members=["none", "ngram"]))
    assert checked.members[1].config == alone


def test_config_from_yaml_and_overrides():
    cfg = load_config(
        "union.yaml" if "ngram" in get_registry().proposers else None,
        overrides=["proposer.name=union", "proposer.members=[draft,eagle]", "proposer.options.eagle.depth=2"],
    )
    assert cfg.proposer.members == ["draft", "eagle"]
    assert cfg.proposer.member_configs[1].depth == 2
    with pytest.raises(ConfigError, match="set a list field whole"):
        load_config(overrides=["proposer.name=union", "proposer.members.1=draft"])


def test_a_failing_member_is_named(target, info):
    union = UnionProposer.random(info, UnionConfig(members=["none", "draft"]))

    def boom(state):
        raise RuntimeError("kaput")

    union.members[1].propose = boom
    with pytest.raises(ProposerError, match="union member 'draft' raised RuntimeError: kaput"):
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=5)
    twice = UnionProposer.random(info, UnionConfig(members=["draft", "draft"]))  # which copy: its position
    twice.members[1].propose = boom
    with pytest.raises(ProposerError, match="union member 2 'draft' raised RuntimeError: kaput"):
        SpeculativeDecoder(target, twice).generate([1, 2], max_new_tokens=5)

    def own_account(state):  # (a proposer's own ProposerError: its words once, after the member's name)
        raise ProposerError("the lookup table is stale")

    union.members[1].propose = own_account
    with pytest.raises(ProposerError, match=r"^union member 'draft': the lookup table is stale$"):
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=5)


def test_members_proposing_more_nodes_together_than_one_verification_takes_are_named(target, info, monkeypatch):
    import specframe.proposers.union

    monkeypatch.setattr(specframe.proposers.union, "MAX_PROPOSAL_NODES", 5)
    union = UnionProposer.random(info, UnionConfig(members=["draft", "draft"]))
    for member in union.members:
        member.gamma = 3  # (sampled drafts are never merged: 6 nodes)
    with pytest.raises(ProposerError, match=r"^union: its 2 members proposed 6 nodes together, more than the 5 one"):
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=20, temperature=1.0, seed=0)


def test_a_member_running_out_of_memory_stays_itself(target, info):
    union = UnionProposer.random(info, UnionConfig(members=["none", "draft"]))
    oom = torch.OutOfMemoryError("CUDA out of memory")

    def raise_it(state):
        raise oom

    union.members[1].propose = raise_it
    with pytest.raises(torch.OutOfMemoryError) as caught:
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=5)
    assert caught.value is oom


def test_a_plugin_member_s_failure_names_its_plugin(target, info):
    pytest.importorskip("specframe_ngram")
    union = UnionProposer.random(info, UnionConfig(members=["none", "ngram"]))
    union.members[1].propose = lambda state: det([99], [-1])
    with pytest.raises(ProposerError, match=r"union member 'ngram' \(plugin 'ngram'\) returned a malformed proposal"):
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=5)


def test_a_member_s_edits_of_the_tokens_stay_its_own(target, info):
    # A member writing into state.tokens (a breach of the contract) misled every member after it, as the engine's
    # own copy keeps it from misleading the engine.
    union = UnionProposer.random(info, UnionConfig(members=["none", "none"]))
    told = []

    def scribble(state):
        state.tokens[:] = 0
        return Proposal.empty(state.tokens.device)

    def record(state):
        told.append(state.tokens.tolist())
        return Proposal.empty(state.tokens.device)

    union.members[0].propose, union.members[1].propose = scribble, record
    out = SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=4).token_ids
    assert told == [[1, 2, *out[: i + 1]] for i in range(len(told))] and len(told) == 3


def test_a_malformed_member_proposal_is_named(target, info):
    union = UnionProposer.random(info, UnionConfig(members=["none", "draft"]))
    union.members[1].propose = lambda state: det([99], [-1])
    with pytest.raises(
        ProposerError, match="union member 'draft' returned a malformed proposal: node 0's token id 99 is out of range"
    ):
        SpeculativeDecoder(target, union).generate([1, 2], max_new_tokens=5)


# Exactness with sampled members: two drafts with different random weights hang chains drawn from two different
# q's off the same root (the full suite, statistics included).
class TestUnionOfTwoSampledDrafts(ProposerConformance):
    proposer_class = UnionProposer
    proposer_config = UnionConfig(members=["draft", "draft"], options={"draft": {"num_speculative_tokens": 2}})
    sampling_settings = VARIANT_SETTINGS


class TestUnionOfTreesAndChains(ProposerConformance):
    proposer_class = UnionProposer
    proposer_config = UnionConfig(
        members=["eagle", "draft", "medusa"], options={"eagle": {"depth": 2, "top_k": 2, "total_tokens": 4}}
    )
    sampling_settings = VARIANT_SETTINGS


@pytest.mark.slow
def test_suite_catches_a_merge_that_mixes_up_members_q(monkeypatch):
    """Power: a union that hands a sampled node another member's q must fail the suite. (Dropping q altogether
    would not be wrong: accepting any independently chosen token with r(x) is exact, only less often.)"""
    import specframe.proposers.union as union_module

    real = union_module.merge_proposals

    def broken(proposals, vocab_size, device, structures=None):
        m = real(proposals, vocab_size, device, structures)
        q = m.proposal.draft_probs
        if q is not None and len(proposals) == 2 and len(proposals[0]) == len(proposals[1]):
            m.proposal.draft_probs = q.roll(len(proposals[0]), dims=0)  # member 0's rows <-> member 1's
        return m

    monkeypatch.setattr(union_module, "merge_proposals", broken)
    config = UnionConfig(members=["draft", "draft"], options={"draft": {"num_speculative_tokens": 2}})
    r = conformance.check_sampling(UnionProposer, "cpu", "temperature=1", config=config, confirm=False)
    assert r.p_value < conformance.ALPHA, r.detail


def test_a_sampled_node_after_a_deterministic_one_with_its_token_keeps_its_q():
    # (a mutation that joined a sampled 5 to a deterministic 5 under the same parent, dropping its q, passed every
    # test, the slow union statistics included: the merge tests only put sampled nodes first)
    q = torch.full((1, 8), 1 / 8)
    m = merge_proposals([det([5], [-1]), sampled([5], [-1], q)], vocab_size=8, device="cpu")
    assert m.proposal.tokens.tolist() == [5, 5] and m.proposal.deterministic.tolist() == [True, False]
    assert torch.equal(m.proposal.draft_probs[1], q[0])
    assert m.owners == [{0: 0}, {1: 0}]


def test_the_merged_tree_of_a_deterministic_and_a_sampled_member_emits_p():
    """The rule on a merged tree: a deterministic 3 and a sibling drawn from q (sometimes a 3 too) at one root;
    the first token emitted must follow p (the mutation above: p = 6e-99 over 12,000 draws)."""
    from specframe.acceptance import TreeAcceptance
    from specframe.sampling import SamplingParams
    from specframe.testing.conformance import ALPHA, chi_square

    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    q = torch.tensor([0.05, 0.1, 0.1, 0.5, 0.2, 0.05])
    g, rule, counts = torch.Generator().manual_seed(0), TreeAcceptance(), torch.zeros(6, dtype=torch.long)
    for _ in range(6000):
        x = int(torch.multinomial(q, 1, generator=g))
        merged = merge_proposals([det([3], [-1]), sampled([x], [-1], q[None].clone())], 6, "cpu").proposal
        logits = torch.zeros(len(merged) + 1, 6)
        logits[0] = p.log()
        path, nxt = rule(logits, merged, SamplingParams(1.0), g)
        counts[int(merged.tokens[path[0]]) if path else nxt] += 1
    assert chi_square(counts, p.double())[2] > ALPHA
