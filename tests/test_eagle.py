import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from specframe import SpeculativeDecoder
from specframe.decoder import target_info
from specframe.errors import ConfigError, ModelLoadError
from specframe.proposer import DecodeState
from specframe.proposers.eagle import EagleConfig, EagleProposer, load_drafter
from specframe.sampling import SamplingParams
from specframe.testing import replay
from specframe.testing.conformance import reference_greedy
from specframe.testing.suite import VARIANT_SETTINGS, ProposerConformance
from specframe.testing.tiny import one_thread, tiny_llama, write_distill_data
from specframe.training.eagle import EagleTrainConfig, train_eagle

TREE = EagleConfig(depth=3, top_k=3, total_tokens=8)
CHAIN = EagleConfig(depth=3, tree=False)


class TestEagleTreeConformance(ProposerConformance):
    proposer_class = EagleProposer
    proposer_config = TREE
    sampling_settings = VARIANT_SETTINGS


class TestEagleChainConformance(ProposerConformance):
    proposer_class = EagleProposer
    proposer_config = CHAIN
    sampling_settings = VARIANT_SETTINGS


class FusedEagle(EagleProposer):
    """An EAGLE proposer whose random drafter fuses target layers 0 and 1 (EAGLE-3's multi-layer features)."""

    @classmethod
    def random(cls, target, config=None, seed=0):
        return EagleProposer.random(target, config, seed, fuse_layers=(0, 1))


class TestEagleFusedConformance(ProposerConformance):
    proposer_class = FusedEagle
    proposer_config = TREE
    sampling_settings = VARIANT_SETTINGS


# ---------------------------------------------------------------------------------------------- helpers


def target16():
    return tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)


def fresh_proposal(target, config, seed, tokens, max_depth=100, fuse_layers=()):
    """A new proposer begun on tokens[:-1] (target features from scratch), and its proposal after `tokens`."""
    p = EagleProposer.random(target_info(target), config, seed=seed, fuse_layers=fuse_layers)
    return p, replay.fresh_proposal(p, target, tokens, max_depth)


# ---------------------------------------------------------------------------------------------- runtime


@pytest.mark.parametrize("fuse_layers", [(), (0, 2)], ids=["last-layer", "fused"])
@pytest.mark.parametrize("config", [TREE, CHAIN], ids=["tree", "chain"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_after_steps_equals_a_fresh_proposer(config, temperature, fuse_layers):
    target = target16()
    proposer = EagleProposer.random(target_info(target), config, seed=3, fuse_layers=fuse_layers)
    steps = replay.recorded_proposals(proposer, also=lambda p: (p.committed, p.cache.get_seq_length()))
    SpeculativeDecoder(target, proposer).generate([1, 2, 3, 4, 5], max_new_tokens=24, temperature=temperature, seed=0)
    assert len(steps) >= 4
    for tokens, max_depth, proposal, (committed, cached) in steps:
        if max_depth == 0:  # nothing to draft: the pending pairs wait for the next proposal
            assert len(proposal) == 0
            continue
        assert committed == tokens.numel() - 1 and cached == committed  # drafted nodes were cropped away
        _, again = fresh_proposal(target, config, 3, tokens, max_depth, fuse_layers)
        assert again.tokens.tolist() == proposal.tokens.tolist()
        assert again.parents.tolist() == proposal.parents.tolist()


def path_of(proposal, i):
    path = []
    while i >= 0:
        path.append(i)
        i = int(proposal.parents[i])
    return path[::-1]


@pytest.mark.parametrize("fuse_layers", [(), (1, 0)], ids=["last-layer", "fused"])
@torch.no_grad()
def test_tree_scores_equal_sequential_recomputation(fuse_layers):
    """Each node's cumulative log-probability, computed with the 4-D tree mask, equals feeding its path
    to the drafter as a plain sequence from scratch: the mask and the positions are right. A fusing drafter
    reads fused features at the real positions and its own predicted features at drafted ones."""
    target = target16()
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    config = EagleConfig(depth=4, top_k=3, total_tokens=12, dtype="float32")  # compared at 1e-4
    p, proposal = fresh_proposal(target, config, 5, tokens, fuse_layers=fuse_layers)
    assert len(proposal) == 12 and max(proposal.depths()) >= 3
    d = p.drafter
    hs = target(input_ids=tokens[None, :-1], output_hidden_states=True).hidden_states
    feats = hs[-1][0]
    if fuse_layers:
        fused = d.fused(feats, torch.cat([hs[layer][0] for layer in fuse_layers], -1))
        assert not torch.allclose(fused, feats)  # the extra layers change the input
        feats = fused
    vocab = {t: i for i, t in enumerate(p.vocab_ids.tolist())}
    for node in range(len(proposal)):
        f, nxt = feats, tokens[1:]
        pred = d(f[None], nxt[None], torch.arange(nxt.numel())[None])[0]  # causal, no cache
        score = 0.0
        for j in path_of(proposal, node):
            x = int(proposal.tokens[j])
            score += float(torch.log_softmax(d.logits(pred[-1]), -1)[vocab[x]])
            f, nxt = torch.cat([f, pred[-1:]]), torch.cat([nxt, torch.tensor([x])])
            pred = d(f[None], nxt[None], torch.arange(nxt.numel())[None])[0]
        assert abs(score - float(p.last_scores[node])) < 1e-4, (node, score, float(p.last_scores[node]))


def test_dynamic_tree_properties():
    target = target16()
    for config in (EagleConfig(depth=4, top_k=3, total_tokens=10), EagleConfig(depth=5, top_k=4, total_tokens=60)):
        p, proposal = fresh_proposal(target, config, 7, torch.tensor([2, 7, 1, 8, 2, 8]))
        depths = proposal.depths()
        n = len(proposal)
        all_nodes = p.top_k + (p.depth - 1) * p.top_k**2
        assert n == min(p.total_tokens, all_nodes) and max(depths) <= p.depth
        assert bool(proposal.deterministic.all()) and proposal.tokens.dtype == torch.long
        scores = p.last_scores.tolist()
        for i, parent in enumerate(proposal.parents.tolist()):
            assert -1 <= parent < i  # topological, closed under ancestors
            if parent >= 0:
                assert scores[i] <= scores[parent] + 1e-6
        siblings = {}
        for i, parent in enumerate(proposal.parents.tolist()):
            siblings.setdefault(parent, []).append(int(proposal.tokens[i]))
        assert all(len(s) == len(set(s)) for s in siblings.values())  # no duplicate children
        assert all(0 <= t < 16 for t in proposal.tokens.tolist())
        assert set(proposal.tokens.tolist()) <= set(p.vocab_ids.tolist())
    # the engine's budget: max_depth caps the tree, 0 gives nothing
    wide = EagleConfig(depth=5, top_k=3, total_tokens=20)
    for max_depth in (0, 1, 2):
        p, prop = fresh_proposal(target, wide, 7, torch.tensor([2, 7, 1]), max_depth=max_depth)
        assert max(prop.depths(), default=0) == max_depth and p.cache.get_seq_length() == p.committed
    # chain mode: one greedy chain of `depth` tokens
    _, chain = fresh_proposal(target, EagleConfig(depth=4, tree=False), 7, torch.tensor([2, 7, 1, 8]))
    assert chain.is_chain() and len(chain) == 4


def test_max_depth_zero_keeps_the_state_consistent():
    """Steps that propose nothing (max_depth 0) still learn the root, so later features stay aligned."""
    target = target16()
    p = EagleProposer.random(target_info(target), TREE, seed=1)
    dec = SpeculativeDecoder(target, p)
    for n in (1, 2, 3, 9):
        assert dec.generate([4, 5, 6], max_new_tokens=n).token_ids == reference_greedy(target, [4, 5, 6], n)


# ---------------------------------------------------------------------------------------------- training


def tiny_run(tmp, num_layers: int, examples: int, **options):
    """A tiny target with self-distillation data in `tmp`, and a fast training config for it."""
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=num_layers)
    write_distill_data(tmp / "d.jsonl", target, n=examples, response_length=10)
    settings = dict(vocab_size=12, epochs=6, lr=1e-2, batch_size=4, heldout_fraction=0.25, token_weight=1.0)
    return target, EagleTrainConfig(
        data=str(tmp / "d.jsonl"), features_cache=str(tmp / "features"), **{**settings, **options}
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle")
    # One layer: its greedy continuations are predictable enough for a tiny drafter to learn in seconds
    # (a 3-layer random target is barely predictable even by a bigram table).
    with one_thread():  # (a module fixture sets up before the per-test one_thread fixture)
        target, cfg = tiny_run(tmp, num_layers=1, examples=120, out=str(tmp / "eagle"))
        logs = []
        metrics = train_eagle(cfg, target, None, log=logs.append)
    return target, cfg, metrics, logs


def test_training_improves_heldout_top1_and_saves_only_the_drafter(trained):
    target, cfg, metrics, logs = trained
    hist = metrics["history"]
    assert [h["epoch"] for h in hist] == list(range(cfg.epochs + 1))
    assert hist[-1]["top1"] > hist[0]["top1"] + 0.1, hist
    assert hist[-1]["feature_l1"] < hist[0]["feature_l1"] and hist[-1]["train_loss"] < hist[1]["train_loss"]
    assert 0 <= hist[-1]["top1_step2"] <= 1 and metrics["heldout"] == hist[-1]
    from safetensors.torch import load_file

    weights = load_file(f"{cfg.out}/model.safetensors")
    assert weights and all(k.startswith(("fc.", "layer.", "norm.")) for k in weights)
    assert all(v.dtype == torch.float16 for v in weights.values())
    meta = json.loads(open(f"{cfg.out}/eagle_config.json").read())
    assert meta["format"] == "specframe-eagle" and meta["llama_config"]["num_hidden_layers"] == 1
    assert len(json.load(open(f"{cfg.out}/eagle_vocab.json"))) == 12
    assert len(list(Path(cfg.features_cache).glob("features-*.safetensors"))) == 1  # one shared extraction
    assert any(m.startswith("epoch 6:") for m in logs)
    assert meta["shape_choice"] == "measured" and not any("cannot be chosen at load" in m for m in logs)


def test_saved_drafter_round_trips_and_decodes_exactly(trained, changes_global_rng):
    target, cfg, _, _ = trained
    info = target_info(target)
    config = EagleConfig(model=cfg.out, depth=4, top_k=3, total_tokens=10, dtype="float32")  # exact round trip
    proposer = EagleProposer.from_config(config, info)
    assert not changes_global_rng(lambda: EagleProposer.from_config(config, info))
    from safetensors.torch import load_file

    saved = load_file(f"{cfg.out}/model.safetensors")
    own = proposer.drafter.own_state_dict()
    assert set(own) == set(saved) and all(torch.equal(own[k], saved[k].float()) for k in saved)
    assert proposer.vocab_ids.tolist() == json.load(open(f"{cfg.out}/eagle_vocab.json"))
    dec = SpeculativeDecoder(target, proposer)
    accepted = 0
    for prompt in ([1, 2, 3], [4, 5, 9, 11]):
        res = dec.generate(prompt, max_new_tokens=16)
        assert res.token_ids == reference_greedy(target, prompt, 16)
        accepted += res.stats["accepted_tokens"]
    assert accepted > 8  # a trained drafter is accepted often on its own target
    res = dec.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=0)
    assert all(0 <= t < 16 for t in res.token_ids)


def test_quantize_rounds_the_drafters_own_weights_to_8_bit_blocks_and_stays_exact(trained, monkeypatch):
    """`proposer.quantize`: auto rounds fc and the drafter's layer (not the target's head rows) where the target
    runs specframe's CPU kernels; none keeps them as saved; the output is the target's either way."""
    from specframe.block_weights import block_grid
    from specframe.cpu_kernels import use_fast_cpu_kernels

    monkeypatch.setattr("specframe.block_weights.blocks_available", lambda: True)  # (the option, not the kernel)
    target, cfg, _, _ = trained
    fast_target = copy.deepcopy(target)
    use_fast_cpu_kernels(fast_target)
    info = target_info(fast_target)
    target_weights = {k: v.clone() for k, v in fast_target.state_dict().items()}
    shape = dict(depth=3, top_k=2, total_tokens=4, dtype="float32")
    saved = EagleProposer.from_config(EagleConfig(model=cfg.out, quantize="none", **shape), info).drafter
    proposer = EagleProposer.from_config(EagleConfig(model=cfg.out, **shape), info)
    rounded = proposer.drafter
    assert block_grid(saved.fc.weight.detach()) is None and block_grid(rounded.fc.weight.detach()).bits == 8
    assert block_grid(rounded.layer.mlp.gate_proj.weight.detach()).bits == 8
    assert torch.allclose(saved.fc.weight, rounded.fc.weight, atol=saved.fc.weight.abs().max() / 127)
    assert torch.equal(saved.head, rounded.head)
    dec = SpeculativeDecoder(fast_target, proposer)
    for prompt in ([1, 2, 3], [4, 5, 9, 11]):
        assert dec.generate(prompt, max_new_tokens=16).token_ids == reference_greedy(target, prompt, 16)
    assert all(torch.equal(v, target_weights[k]) for k, v in fast_target.state_dict().items())  # (the target's own)
    with pytest.raises(ConfigError, match="proposer.quantize must be one of"):
        EagleConfig(quantize="yes")


def test_tree_shape_saved_with_the_drafter_is_the_default(trained, tmp_path):

    target, cfg, _, _ = trained
    info = target_info(target)
    # The trainer saves `"shape_choice": "measured"`: on a CPU, 1-3 draft nodes timed fastest at load (their own
    # test: test_a_drafter_may_have_its_cpu_shape_measured_on_the_machine).
    measured = EagleProposer.from_config(EagleConfig(model=cfg.out), info)
    assert measured.total_tokens <= 3 and "(measured: 3 shapes" in measured.shape_choice
    tuned = tmp_path / "tuned"
    shutil.copytree(cfg.out, tuned, ignore=shutil.ignore_patterns("checkpoint"))
    meta = json.loads((tuned / "eagle_config.json").read_text())
    assert meta.pop("shape_choice") == "measured"
    (tuned / "eagle_config.json").write_text(json.dumps(meta))
    plain = EagleProposer.from_config(EagleConfig(model=str(tuned)), info)
    assert (plain.depth, plain.top_k, plain.total_tokens) == (5, 6, 24) and plain.shape_choice is None
    meta["tree_shape"] = {"depth": 2, "top_k": 3, "total_tokens": 3}
    (tuned / "eagle_config.json").write_text(json.dumps(meta))
    p = EagleProposer.from_config(EagleConfig(model=str(tuned)), info)
    assert (p.depth, p.top_k, p.total_tokens) == (2, 3, 3)
    # A key the config sets wins, and the saved shape is then dropped whole: the others are the device's
    # defaults (a saved one-node shape had capped `proposer.depth=5` at one node).
    p = EagleProposer.from_config(EagleConfig(model=str(tuned), total_tokens=5), info)
    assert (p.depth, p.top_k, p.total_tokens) == (5, 6, 5)
    meta["tree_shape"] = {"depth": 1, "top_k": 1, "total_tokens": 1}
    (tuned / "eagle_config.json").write_text(json.dumps(meta))
    p = EagleProposer.from_config(EagleConfig(model=str(tuned), depth=4), info)
    assert (p.depth, p.top_k, p.total_tokens) == (4, 6, 24)
    stats = SpeculativeDecoder(target, p).generate([1, 2, 3], max_new_tokens=12).stats
    assert len(stats["proposed_by_position"]) == 4 and stats["proposed_nodes"] > stats["target_forwards"]
    # a trained drafter's top_k past its vocabulary is refused (before: cut to it, unsaid; a random build for
    # `specframe check` on a tiny target still cuts it, saying "in effect" where it matters)
    vocab = len(p.vocab_ids)
    with pytest.raises(
        ConfigError, match=f"proposer.top_k={vocab + 1} is more than the drafter's vocabulary of {vocab}"
    ):
        EagleProposer.from_config(EagleConfig(model=str(tuned), top_k=vocab + 1), info)
    meta["tree_shape"]["confidence_threshold"] = 0.25  # (not part of the shape: it still applies)
    (tuned / "eagle_config.json").write_text(json.dumps(meta))
    p = EagleProposer.from_config(EagleConfig(model=str(tuned), depth=4), info)
    assert p.depth == 4 and p.min_score == pytest.approx(math.log(0.25))
    _, proposal = fresh_proposal(target, EagleConfig(depth=2, top_k=3, total_tokens=3), 1, torch.tensor([1, 2]))
    assert len(proposal) == 3 and max(proposal.depths()) <= 2
    for key, bad in (("depth", 0), ("top_k", "3"), ("total_tokens", 2.5), ("total_tokens", 1025)):  # named
        meta["tree_shape"] = {"depth": 2, "top_k": 3, "total_tokens": 3, key: bad}
        (tuned / "eagle_config.json").write_text(json.dumps(meta))
        with pytest.raises(ModelLoadError, match=f"tree_shape.{key} in .*eagle_config.json must be an integer in"):
            EagleProposer.from_config(EagleConfig(model=str(tuned)), info)


def test_resume_continues_after_the_last_epoch(trained, tmp_path):
    target, cfg, _, _ = trained
    shutil.copytree(cfg.out, tmp_path / "eagle")  # (the module's drafter stays as trained for the other tests)
    more = EagleTrainConfig(
        **{**cfg.__dict__, "epochs": cfg.epochs + 1, "self_fed_steps": 2, "out": str(tmp_path / "eagle")}
    )
    logs = []
    metrics = train_eagle(more, target, None, resume=True, log=logs.append)
    assert any("resumed" in m and f"epoch {cfg.epochs}" in m for m in logs)
    assert "resuming with self_fed_steps 2; the checkpoint trained with 1" in logs  # allowed, and said
    assert [h["epoch"] for h in metrics["history"]] == list(range(cfg.epochs + 2))
    assert not any(m.startswith("before training") for m in logs)


def test_self_fed_step_training_and_last_layer_init(tmp_path):
    target = tiny_llama(vocab_size=16, seed=1, hidden_size=32, num_layers=1)
    write_distill_data(tmp_path / "d.jsonl", target, n=120, response_length=10)
    cfg = EagleTrainConfig(
        data=str(tmp_path / "d.jsonl"),
        out=str(tmp_path / "e"),
        features_cache="",
        vocab_size=16,
        epochs=4,
        lr=1e-2,
        batch_size=4,
        heldout_fraction=0.25,
        self_fed_steps=2,
        self_fed_weight=1.0,
        token_weight=1.0,
        init_from_last_layer=True,
    )
    metrics = train_eagle(cfg, target, None, log=lambda m: None)
    hist = metrics["history"]
    assert hist[-1]["top1_step2"] > hist[0]["top1_step2"] + 0.05, hist
    assert hist[-1]["top1_step3"] > hist[0]["top1_step3"] + 0.05, hist
    assert not (tmp_path / "features").exists()  # features_cache="" caches nothing


def test_fused_drafter_trains_saves_version_2_and_round_trips(tmp_path):

    from safetensors.torch import load_file

    out = str(tmp_path / "fused")
    target, cfg = tiny_run(tmp_path, num_layers=2, examples=80, out=out, epochs=3, fuse_layers=[1, 0])
    logs = []
    metrics = train_eagle(cfg, target, None, log=logs.append)
    hist = metrics["history"]
    assert hist[-1]["top1"] > hist[0]["top1"] + 0.1, hist
    assert any("fusing target layers [1, 0]" in m for m in logs)
    weights = load_file(f"{cfg.out}/model.safetensors")
    assert {"fuse.weight", "fuse_norms.0.weight", "fuse_norms.1.weight"} <= set(weights)
    assert weights["fuse.weight"].shape == (32, 64) and bool(weights["fuse.weight"].abs().sum() > 0)  # trained
    meta = json.loads(open(f"{cfg.out}/eagle_config.json").read())
    assert meta["version"] == 2 and meta["fuse_layers"] == [1, 0]

    info = target_info(target)
    proposer = EagleProposer.from_config(EagleConfig(model=cfg.out, depth=3, dtype="float32"), info)
    assert proposer.hidden_state_layers == (1, 0, -1)
    own = proposer.drafter.own_state_dict()
    assert set(own) == set(weights) and all(torch.equal(own[k], weights[k].float()) for k in weights)
    dec = SpeculativeDecoder(target, proposer)
    for prompt in ([1, 2, 3], [4, 5, 9, 11]):
        assert dec.generate(prompt, max_new_tokens=16).token_ids == reference_greedy(target, prompt, 16)

    def tampered(name, **changes):
        folder = tmp_path / name
        shutil.copytree(cfg.out, folder, ignore=shutil.ignore_patterns("checkpoint"))
        edited = {**meta, **changes}
        edited = {k: v for k, v in edited.items() if v is not None}
        (folder / "eagle_config.json").write_text(json.dumps(edited))
        return str(folder)

    with pytest.raises(ModelLoadError, match="fuse_layers must list target layers 0..1"):
        load_drafter(tampered("bad-layer", fuse_layers=[1, 2]), target)
    with pytest.raises(ModelLoadError, match="has weights its config does not use.*fuse"):
        load_drafter(tampered("no-layers", fuse_layers=None, version=1), target)
    with pytest.raises(ModelLoadError, match="version 3; this specframe reads versions 1 and 2"):
        load_drafter(tampered("future", version=3), target)
    with pytest.raises(ModelLoadError, match=r"inconsistent: version 1 with fuse_layers \[1, 0\]"):
        load_drafter(tampered("old-version", version=1), target)

    # The runtime reads the same fused features as training: the engine's hidden states (through pick_hidden)
    # give the drafter the prediction that the trainer's pass over the cached extra layers gives.
    from specframe.data import read_distill
    from specframe.decoder import pick_hidden
    from specframe.training.eagle import collate_features, drafter_passes
    from specframe.training.features import extract_features

    seq = extract_features(
        target, read_distill(cfg.data)[:4], dtype=torch.float32, quiet=True, extra_layers=cfg.fuse_layers
    )[0]
    k = seq.ids.numel() - 1
    feats, ids, _, extra = collate_features([seq])
    with torch.no_grad():
        want = drafter_passes(proposer.drafter, feats, ids, extra=extra)[0][0, k - 1]
        prefix = seq.ids[:k]
        out = target(input_ids=prefix[None], output_hidden_states=True)
        proposer.begin(prefix, pick_hidden(out, proposer.hidden_state_layers, slice(None)))
    proposer.propose(DecodeState(seq.ids, k, SamplingParams(), torch.Generator(), max_depth=3))
    # (the cache holds bfloat16 hidden states, the engine float32 ones: equal up to bfloat16 rounding)
    torch.testing.assert_close(proposer.root_feat, want, atol=1e-2, rtol=1e-2)
    swapped = torch.cat([extra[..., 32:], extra[..., :32]], -1)  # the layers in the wrong order: far off
    with torch.no_grad():
        wrong = drafter_passes(proposer.drafter, feats, ids, extra=swapped)[0][0, k - 1]
    assert float((wrong - want).abs().max()) > 0.1

    # Resuming needs the same layers (the checkpoint records them), refused before any feature extraction.
    with pytest.raises(ConfigError, match=r"train.fuse_layers \[0, 1\] differs from \[1, 0\] of the checkpoint"):
        other_layers = {"fuse_layers": [0, 1], "features_cache": str(tmp_path / "fresh")}
        train_eagle(EagleTrainConfig(**{**cfg.__dict__, **other_layers}), target, None, resume=True)
    assert not (tmp_path / "fresh").exists()
    state_file = Path(cfg.out) / "checkpoint" / "state.json"  # a checkpoint that does not record its layers:
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({k: v for k, v in state.items() if k != "fuse_layers"}))
    with pytest.raises(ConfigError, match=r"checkpoint in .* was trained with train.fuse_layers=\[1, 0\], not \[\]"):
        train_eagle(EagleTrainConfig(**{**cfg.__dict__, "fuse_layers": []}), target, None, resume=True)

    # The Medusa and draft trainers on the same data read their plain features from this fused cache file
    # (whatever their held-out split) instead of running the target again.
    from specframe.training.draft import DraftTrainConfig, train_draft
    from specframe.training.medusa import MedusaTrainConfig, train_medusa

    cached = sorted(Path(cfg.features_cache).iterdir())
    assert len(cached) == 1
    common = dict(data=cfg.data, features_cache=cfg.features_cache, epochs=1, vocab_size=12, heldout_fraction=0.1)
    train_medusa(MedusaTrainConfig(out=str(tmp_path / "m"), num_heads=2, **common), target, None, log=lambda m: None)
    train_draft(DraftTrainConfig(out=str(tmp_path / "d"), layers=1, **common), target, None, log=lambda m: None)
    assert sorted(Path(cfg.features_cache).iterdir()) == cached


@pytest.mark.parametrize("fuse_layers", [(), (0, 1)])
def test_self_fed_passes_equal_drafting_one_chain_at_a_time(fuse_layers):
    """Training's batched self-fed passes (one causal pass over the real pairs, then pass s reading pass s-1's
    predictions through `self_fed_mask`) give, at every position, what drafting computes: the real pairs
    committed to a fresh cache, then a chain of the drafter's own predicted features at the next positions."""
    from transformers import DynamicCache

    from specframe.training.eagle import drafter_passes

    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    drafter = EagleProposer.random(target_info(target), CHAIN, seed=3, fuse_layers=fuse_layers).drafter.float()
    if fuse_layers:  # a fresh fuse map is zero: give it weights, so that a wrong fusion shows
        torch.nn.init.normal_(drafter.fuse.weight, std=0.2)
    gen = torch.Generator().manual_seed(0)
    t = 9
    ids = torch.randint(0, 16, (2, t), generator=gen)
    feats = torch.randn(2, t, 32, generator=gen)
    extra = torch.randn(2, t, 32 * len(fuse_layers), generator=gen) if fuse_layers else None
    with torch.no_grad():
        outs = drafter_passes(drafter, feats, ids, self_fed=3, extra=extra)
    assert [o.shape[1] for o in outs] == [t - 1, t - 2, t - 3, t - 4]
    for b in range(2):
        for i in range(t - 4):
            cache = DynamicCache(config=drafter.config)
            real = feats[b, : i + 1]
            if fuse_layers:
                real = drafter.fused(real, extra[b, : i + 1])
            with torch.no_grad():
                pred = drafter(real[None], ids[b, 1 : i + 2][None], torch.arange(i + 1)[None], None, cache)[0, -1]
                torch.testing.assert_close(outs[0][b, i], pred, atol=1e-5, rtol=1e-5)
                for s in range(2, 5):  # level s: (f̂ of level s-1, t_{i+s}) at position i+s-1
                    tok = ids[b, i + s][None, None]
                    pred = drafter(pred[None, None], tok, torch.tensor([[i + s - 1]]), None, cache)[0, -1]
                    torch.testing.assert_close(outs[s - 1][b, i], pred, atol=2e-4, rtol=1e-4)
    with torch.no_grad():  # passes stop where the sequence is too short for the next one
        short = extra[:, :3] if fuse_layers else None
        assert len(drafter_passes(drafter, feats[:, :3], ids[:, :3], self_fed=5, extra=short)) == 2


def test_level_masks_count_chains_that_drafting_can_start():
    """Level s counts input i when its prediction lies in the response (as level 1 does at i + s - 1) and its
    chain's root, the last prompt token or later, is where drafting starts (as level 1 counts input i)."""
    from specframe.training.eagle import level_masks

    # One sequence of 7 tokens, response from token 3: level 1 counts inputs 1..5 (predicting tokens 3..7).
    loss = torch.tensor([[False, True, True, True, True, True]])
    m1, m2, m3 = level_masks(loss, 3)
    assert m1.tolist() == loss.tolist()
    assert m2.tolist() == [[False, True, True, True, True]]  # input 0 would start its chain inside the prompt
    assert m3.tolist() == [[False, True, True, True]]
    padded = torch.tensor([[False, True, True, False, False, False]])  # a short row in a padded batch
    assert [m.tolist() for m in level_masks(padded, 3)[1:]] == [[[False, True, False, False, False]], [[False] * 4]]


def test_prompt_positions_add_the_prompt_to_the_training_loss_only():
    """A sequence of 7 tokens whose response starts at token 3: by default inputs 1..5 count (their next
    features are f_2..f_6; f_2, the last prompt token's, predicts response token 3); with prompt_positions
    inputs 0..5 count. Held-out evaluation calls the default."""
    from specframe.training.eagle import collate_features
    from specframe.training.features import FeatureSequence

    seq = FeatureSequence(torch.arange(7), 3, torch.zeros(7, 4))
    short = FeatureSequence(torch.arange(4), 2, torch.zeros(4, 4))  # padded to 7 in the batch
    assert collate_features([seq, short])[2].tolist() == [[False] + [True] * 5, [True] * 3 + [False] * 3]
    assert collate_features([seq, short], prompt_positions=True)[2].tolist() == [[True] * 6, [True] * 3 + [False] * 3]


def test_init_from_continues_a_saved_drafter(trained, tmp_path):
    target, cfg, metrics, _ = trained
    more = EagleTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "more"), "epochs": 1, "init_from": cfg.out})
    logs = []
    again = train_eagle(more, target, None, log=logs.append)
    assert any(f"from {cfg.out}" in m for m in logs)
    start = again["history"][0]  # the saved (float16) drafter, evaluated before training: where the first run ended
    assert abs(start["top1"] - metrics["heldout"]["top1"]) < 0.02, (start, metrics["heldout"])
    assert start["top1"] > metrics["history"][0]["top1"] + 0.1  # far from a fresh drafter's
    assert json.load(open(f"{more.out}/eagle_vocab.json")) == json.load(open(f"{cfg.out}/eagle_vocab.json"))


def test_init_from_must_be_a_drafter_with_the_same_layers(trained, tmp_path):
    target, cfg, _, _ = trained
    for options, message in (
        ({"init_from": str(tmp_path / "nowhere")}, r"train.init_from '.*nowhere' does not exist"),
        ({"init_from": str(tmp_path)}, r"train.init_from '.*' holds no eagle_config.json"),
        ({"init_from": cfg.out, "fuse_layers": [0]}, r"train.fuse_layers \[0\] differs from \[\] of the drafter"),
    ):
        bad = EagleTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "bad"), **options})
        with pytest.raises(ConfigError, match=message):
            train_eagle(bad, target, None, log=lambda m: None)
    other = tiny_llama(vocab_size=16, seed=5, hidden_size=32, num_layers=1)  # (the error names the option)
    bad = EagleTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "bad"), "init_from": cfg.out})
    with pytest.raises(ConfigError, match=r"^train.init_from: EAGLE drafter '.*' was made for another target"):
        train_eagle(bad, other, None, log=lambda m: None)
    assert not (tmp_path / "bad").exists()


def test_fuse_layers_must_exist_in_the_target(tmp_path):
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    write_distill_data(tmp_path / "d.jsonl", target, n=20, response_length=6)
    cfg = EagleTrainConfig(data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "e"), fuse_layers=[0, 2])
    with pytest.raises(ConfigError, match=r"train.fuse_layers must list target layers 0..1.*got 2"):
        train_eagle(cfg, target, None, log=lambda m: None)
    assert not (tmp_path / "e").exists()
    with pytest.raises(ConfigError, match="train.fuse_layers must be a list"):
        EagleTrainConfig(fuse_layers=3)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_attention_heads": 0}, "incomplete or corrupt: llama_config"),
        ({"num_attention_heads": 3}, "incomplete or corrupt: llama_config|weights do not fit its config"),
        ({"hidden_act": "nonsense"}, "incomplete or corrupt: llama_config"),
        ({"intermediate_size": 10**9}, r"weights do not fit its config: .*mlp.*1000000000\]"),
        ({"head_dim": 8}, "weights do not fit its config"),
    ],
)
def test_a_tampered_drafter_config_is_a_load_error(trained, tmp_path, change, message):
    target, cfg, _, _ = trained
    shutil.copytree(cfg.out, tmp_path / "d")
    meta = json.loads((tmp_path / "d" / "eagle_config.json").read_text())
    meta["llama_config"] = {**meta["llama_config"], **change}
    (tmp_path / "d" / "eagle_config.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match=r"^proposer.model: EAGLE drafter .*(" + message + ")"):
        load_drafter(tmp_path / "d", target)


def test_missing_or_wrong_model_folders_are_refused(tmp_path, trained):
    info = target_info(target16())
    with pytest.raises(ModelLoadError, match="does not exist"):
        EagleProposer.from_config(EagleConfig(model=str(tmp_path / "nope")), info)
    with pytest.raises(ModelLoadError, match="holds no eagle_config.json: train an EAGLE drafter with"):
        EagleProposer.from_config(EagleConfig(model=str(tmp_path)), info)
    with pytest.raises(ConfigError, match="proposer.model is required"):
        EagleProposer.from_config(EagleConfig(), info)
    target, cfg, _, _ = trained
    for dtype in (torch.bfloat16, torch.float16):  # trained in float32, usable on the target in half precision
        load_drafter(cfg.out, copy.deepcopy(target).to(dtype))
    other = tiny_llama(vocab_size=16, seed=5, hidden_size=32, num_layers=1)
    with pytest.raises(ModelLoadError, match=r"^proposer.model: EAGLE drafter .* another target: the weights differ"):
        load_drafter(cfg.out, other)
    wide = tiny_llama(vocab_size=24, seed=0, hidden_size=32, num_layers=1)
    with pytest.raises(ModelLoadError, match="made for another target: vocab size 16 there, 24 here"):
        EagleProposer.from_config(EagleConfig(model=cfg.out), target_info(wide))
    shutil.copytree(cfg.out, tmp_path / "bad-vocab")
    (tmp_path / "bad-vocab" / "eagle_vocab.json").write_text("[0, 16]")
    with pytest.raises(ModelLoadError, match="bad-vocab': eagle_vocab.json lists token ids outside .*\\[0, 16\\)"):
        load_drafter(tmp_path / "bad-vocab", target)
    shutil.copy(f"{cfg.out}/eagle_vocab.json", tmp_path / "bad-vocab")
    meta = json.loads((tmp_path / "bad-vocab" / "eagle_config.json").read_text())
    (tmp_path / "bad-vocab" / "eagle_config.json").write_text(json.dumps({**meta, "llama_config": [1]}))
    with pytest.raises(ModelLoadError, match="bad-vocab' is incomplete or corrupt: llama_config: TypeError"):
        load_drafter(tmp_path / "bad-vocab", target)


@pytest.mark.parametrize(
    "field, value", [("depth", 0), ("top_k", 0), ("total_tokens", -1), ("tree", "yes"), ("dtype", "int8")]
)
def test_bad_proposer_options(field, value):
    with pytest.raises(ConfigError, match=f"proposer.{field}"):
        EagleConfig(**{field: value})


@pytest.mark.parametrize("field", ["top_k", "total_tokens"])
def test_tree_options_for_a_chain_are_refused_not_ignored(field):
    with pytest.raises(ConfigError, match=f"proposer.{field} shapes the tree: with proposer.tree=false"):
        EagleConfig(depth=3, tree=False, **{field: 4})


@pytest.mark.parametrize(
    "field, value",
    [
        ("epochs", 0),
        ("heldout_fraction", 1.0),
        ("noise", -0.1),
        ("lr", 0),
        ("lr", float("inf")),  # (it would train to NaN weights)
        ("noise", float("nan")),
        ("self_fed_steps", -1),
        ("self_fed_steps", True),
        ("self_fed_steps", 1.5),
        ("self_fed_weight", -0.5),
        ("self_fed_weight", 0.0),  # with the default one self-fed step: say self_fed_steps=0 instead
        ("self_fed_steps", 511),  # more than a sequence of max_length (512) tokens allows
        ("prompt_positions", "yes"),
        ("init_from", "runs/eagle"),  # with init_from_last_layer below: two starts
    ],
)
def test_bad_training_options(field, value):
    with pytest.raises(ConfigError, match=f"train.{field}"):
        EagleTrainConfig(**{field: value, **({"init_from_last_layer": True} if field == "init_from" else {})})
    EagleTrainConfig(self_fed_steps=510)  # the most a 512-token sequence runs
    EagleTrainConfig(self_fed_steps=0, self_fed_weight=0.0)  # no self-fed step: its weight is unused


@pytest.mark.parametrize(
    "given, shape",
    [
        (dict(total_tokens=2), (2, 6, 2)),  # depth fitted: a tree of 2 nodes is at most 2 deep
        (dict(depth=30), (30, 6, 30)),  # total_tokens fitted: at least one node a level
        (dict(top_k=1), (5, 1, 5)),  # a chain of 5 makes 5 nodes, not the default 24
        (dict(depth=3, top_k=2, total_tokens=10), (3, 2, 10)),  # 2 + 4 + 4: exactly what it can make
        (dict(total_tokens=200), (7, 6, 200)),  # depth fitted up: 6 + 5 * 36 >= 200 > 6 + 4 * 36
        (dict(top_k=1, total_tokens=10), (10, 1, 10)),  # a chain of 10
        (dict(depth=2, total_tokens=100), (2, 10, 100)),  # top_k fitted up: 10 + 100 >= 100 > 9 + 81
        (dict(top_k=1, total_tokens=1024), (1024, 1, 1024)),  # (1024 nodes: the most a tree may have)
        (dict(total_tokens=1024), (30, 6, 1024)),  # 6 + 29 * 36 >= 1024 > 6 + 28 * 36
    ],
)
def test_unset_tree_keys_fit_the_set_ones(given, shape):
    info = target_info(target16())
    proposer = EagleProposer.random(info, EagleConfig(**given))
    assert (proposer.depth, proposer.top_k, proposer.total_tokens) == shape


def test_a_shape_that_would_score_too_many_candidates_a_step_is_refused(trained):
    # (each key under MAX_TREE_NODES, but depth x top_k^2 candidates scored a step: depth 128 with top_k 1024 did
    # not finish 130 tokens of a tiny target in 100 s)
    info = target_info(target16())
    message = r"scores depth x top_k\^2 = 147456 candidates a step \(top_k in effect 12\), more than the 65536"
    with pytest.raises(ConfigError, match=message):
        EagleProposer.random(info, EagleConfig(depth=1024, top_k=1024, total_tokens=1024))
    EagleProposer.random(info, EagleConfig(depth=455, top_k=1024, total_tokens=1024))  # 455 x 144 = 65520: drafts
    target, cfg, _, _ = trained  # likewise a drafter's saved shape
    meta = json.loads(open(f"{cfg.out}/eagle_config.json").read())
    meta["tree_shape"] = {"depth": 1024, "top_k": 1024, "total_tokens": 1024}
    shutil.copytree(cfg.out, Path(cfg.out).parent / "wide")
    (Path(cfg.out).parent / "wide" / "eagle_config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="more than the 65536 a tree may"):
        EagleProposer.from_config(EagleConfig(model=str(Path(cfg.out).parent / "wide")), target_info(target))


@pytest.mark.parametrize("depth, total_tokens", [(1, 3), (3, 4), (2, 2), (4, 9)])
def test_top_k_beyond_total_tokens_drafts_the_same_tree(depth, total_tokens):
    """A node's children beyond the best total_tokens are never kept: they are not made (a top_k of 4,096 with
    60 nodes took 5.9 GB and 18 s a step on SmolLM2, for the tree a top_k of 60 gives)."""
    target = target16()
    tokens = torch.tensor([1, 5, 2, 7, 3])
    trees = []
    for top_k in (total_tokens, 12):  # (12: the random drafter's whole vocabulary)
        config = EagleConfig(depth=depth, top_k=top_k, total_tokens=total_tokens)
        _, proposal = fresh_proposal(target, config, 0, tokens)
        trees.append((proposal.tokens.tolist(), proposal.parents.tolist()))
    assert trees[0] == trees[1] and len(trees[0][0]) == total_tokens


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(depth=5, top_k=4, total_tokens=2), r"proposer.depth=5 cannot be reached with proposer.total_tokens=2"),
        (
            dict(depth=3, top_k=2, total_tokens=11),
            r"proposer.total_tokens=11 is more than a tree of depth 3 and top_k 2",
        ),
        (
            dict(depth=5, total_tokens=1000, top_k=50),
            r"top_k 50 \(in effect 12: the drafter has 12 tokens\) can make \(588 nodes",
        ),
        (
            dict(depth=2, total_tokens=1000),
            r"depth 2 and top_k 12 can make \(156 nodes",
        ),  # (top_k: at most the vocabulary)
    ],
)
def test_tree_keys_that_cannot_hold_together_are_refused(given, message):
    with pytest.raises(ConfigError, match=message):
        EagleProposer.random(target_info(target16()), EagleConfig(**given))


def test_registered_and_configured():
    from specframe.config import load_config
    from specframe.plugins import get_registry

    assert get_registry().get("eagle").cls is EagleProposer
    cfg = load_config("configs/eagle.yaml", ["proposer.depth=3"])
    assert cfg.proposer_name == "eagle" and cfg.proposer.depth == 3 and cfg.proposer.tree is True
    with pytest.raises(ConfigError, match="proposer.top_k"):
        load_config("configs/eagle.yaml", ["proposer.top_k=0"])


def test_a_tree_shape_tuned_on_a_cpu_is_not_used_on_other_devices(trained, tmp_path):
    # The shipped drafter's one-token shape is the fastest on a CPU; on a GPU, where ~60 verified tokens cost
    # what 1 does, the device's default (EAGLE-2's 60-node shape) applies. ("meta" stands in for a GPU here.)
    import dataclasses

    from specframe.proposers.eagle import ACCELERATOR_TREE_SHAPE

    target, cfg, _, _ = trained
    shutil.copytree(cfg.out, tmp_path / "tuned")
    meta = json.loads((tmp_path / "tuned" / "eagle_config.json").read_text())
    meta["tree_shape"] = {"depth": 1, "top_k": 1, "total_tokens": 1}
    info = target_info(target)
    elsewhere = dataclasses.replace(info, device=torch.device("meta"))
    for tuned_on, on_cpu, on_meta in ((None, 1, 1), ("cpu", 1, ACCELERATOR_TREE_SHAPE["total_tokens"])):
        (tmp_path / "tuned" / "eagle_config.json").write_text(json.dumps({**meta, "shape_tuned_on": tuned_on}))
        config = EagleConfig(model=str(tmp_path / "tuned"))
        assert EagleProposer.from_config(config, info).total_tokens == on_cpu, tuned_on
        assert EagleProposer.from_config(config, elsewhere).total_tokens == on_meta, tuned_on
    assert EagleProposer.from_config(EagleConfig(model=str(tmp_path / "tuned"), depth=2), elsewhere).depth == 2
    # A device written as a device ("cuda:0", "CPU") names its type; a saved threshold applies on every device.
    shape = {**meta["tree_shape"], "confidence_threshold": 0.25}
    for tuned_on in ("CPU", "cpu:0"):
        (tmp_path / "tuned" / "eagle_config.json").write_text(
            json.dumps({**meta, "tree_shape": shape, "shape_tuned_on": tuned_on})
        )
        assert EagleProposer.from_config(EagleConfig(model=str(tmp_path / "tuned")), info).total_tokens == 1
        far = EagleProposer.from_config(EagleConfig(model=str(tmp_path / "tuned")), elsewhere)
        assert far.total_tokens == ACCELERATOR_TREE_SHAPE["total_tokens"] and far.min_score == pytest.approx(
            math.log(0.25)
        )
    (tmp_path / "tuned" / "eagle_config.json").write_text(json.dumps({**meta, "shape_tuned_on": 3}))
    with pytest.raises(ModelLoadError, match="shape_tuned_on in .*eagle_config.json must be a device type"):
        EagleProposer.from_config(EagleConfig(model=str(tmp_path / "tuned")), info)


@pytest.mark.parametrize("arch", ["gpt2", "gptj", "bloom"])
def test_random_drafters_are_shaped_like_targets_that_name_their_sizes_otherwise(arch):
    # GPT-2 and GPT-J call their hidden size n_embd (Bloom has no intermediate_size): the drafter was built with
    # Llama's default sizes (4096 wide for a 16-wide target) and failed in its first forward.
    import transformers as T

    torch.manual_seed(0)
    target = {
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=16, n_embd=16, n_layer=2, n_head=2, n_positions=64)),
        "gptj": lambda: T.GPTJForCausalLM(
            T.GPTJConfig(vocab_size=16, n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=64)
        ),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=16, hidden_size=16, n_layer=2, n_head=2)),
    }[arch]().eval()
    # (Bloom's ALiBi biases go by cache slot, which a tree's side-by-side nodes would get wrong: a chain)
    config = EagleConfig(tree=False, depth=3) if arch == "bloom" else EagleConfig()
    proposer = EagleProposer.random(target_info(target), config)
    drafter = proposer.drafter.config
    assert (drafter.hidden_size, drafter.intermediate_size, drafter.num_attention_heads) == (16, 64, 2)
    for prompt in ([1, 2, 3], [5, 4]):
        got = SpeculativeDecoder(target, proposer).generate(prompt, max_new_tokens=10).token_ids
        assert got == reference_greedy(target, prompt, 10)


def test_a_drafter_may_have_its_cpu_shape_measured_on_the_machine(trained, tmp_path, monkeypatch):
    # `"shape_choice": "measured"`: on a CPU, the shape of 1-3 draft nodes fastest with this machine's timings
    # (specframe/step_costs.py); the expected accepted lengths come from the drafter's held-out top-1 per level.
    import dataclasses

    from specframe.proposers import eagle
    from specframe.proposers.eagle import EagleShape
    from specframe.step_costs import StepCosts

    target, cfg, _, _ = trained
    shutil.copytree(cfg.out, tmp_path / "tuned")
    meta = json.loads((tmp_path / "tuned" / "eagle_config.json").read_text())
    shapes = eagle.measured_candidates(meta, "here")
    held = meta["metrics"]["heldout"]
    p1, p2, p3 = held["top1"], held["top1"] * held["top1_step2"], held["top1"] * held["top1_step2"] * held["top1_step3"]
    assert [c.accepted_length for c in shapes] == pytest.approx([1 + p1, 1 + p1 + p2, 1 + p1 + p2 + p3])
    three = EagleShape(depth=2, top_k=3, total_tokens=3)  # (3 nodes: the tree reranked over two levels)
    assert [(c.shape, c.verify_tokens, c.drafter_forwards) for c in shapes] == [
        ((1, 1, 1), 2, 1),
        ((2, 1, 2), 3, 2),
        (three, 4, 2),
    ]
    # Each depth's held-out chance of acceptance; the tree is two levels deep, so the third level's share is
    # counted at the second (a step accepts at most two of its drafts).
    assert [c.reach for c in shapes] == [pytest.approx(r) for r in ((p1,), (p1, p2), (p1, p2 + p3))]
    assert eagle.measured_candidates(meta, "here", tree=False)[2].shape == (3, 1, 3)  # (chain mode: chains only)
    write = lambda m: (tmp_path / "tuned" / "eagle_config.json").write_text(json.dumps(m))  # noqa: E731
    write({**meta, "shape_choice": "measured", "tree_shape": {"depth": 1, "top_k": 1, "total_tokens": 1}})
    info = target_info(target)
    config = EagleConfig(model=str(tmp_path / "tuned"))
    expected = {3: (three, "3-node tree over 2 levels"), 1: ((1, 1, 1), "chain of 1"), 2: ((2, 1, 2), "chain of 2")}
    for relative, nodes in (((1.0, 1.0, 1.0, 1.0), 3), ((1.0, 1.0, 9.0, 9.0), 1), ((1.0, 1.0, 1.05, 9.0), 2)):
        monkeypatch.setattr(eagle, "measure_step_costs", lambda model, r=relative: StepCosts(0.01, r))
        monkeypatch.setattr(eagle, "relative_cost", lambda call, model: call() or 0.0)  # (the step runs)
        p = EagleProposer.from_config(config, info)
        shape, described = expected[nodes]
        assert (p.depth, p.top_k, p.total_tokens) == shape and p.shape_choice.startswith(described), relative
        # Each step re-chooses among the same shapes by the acceptance so far (proposer.adapt_shape), starting
        # from the one chosen at load; with adapt_shape=false, that one every step.
        assert [c.shape for c in p.online.candidates] == [None, (1, 1, 1), (2, 1, 2), three]
        assert p.online.choose().shape == shape
        fixed = EagleProposer.from_config(dataclasses.replace(config, adapt_shape=False), info)
        assert fixed.online is None and (fixed.depth, fixed.top_k, fixed.total_tokens) == shape
        assert "(measured: 3 shapes" in p.shape_choice and p.measured_shape.startswith(described)
        dec = SpeculativeDecoder(target, p)  # it decodes, and exactly (as every shape)
        got = dec.generate([1, 2, 3], max_new_tokens=10)
        assert got.token_ids == reference_greedy(target, [1, 2, 3], 10)
        assert got.stats["proposed_nodes"] <= nodes * got.stats["target_forwards"]

    def refuse(model):
        raise AssertionError("timed")

    monkeypatch.setattr(eagle, "measure_step_costs", refuse)
    # A configured shape wins and nothing is timed; on another device ("meta" stands in for a GPU), nothing either.
    p = EagleProposer.from_config(EagleConfig(model=str(tmp_path / "tuned"), depth=4), info)
    assert p.depth == 4 and p.shape_choice is None
    assert EagleProposer.from_config(config, dataclasses.replace(info, device=torch.device("meta"))).depth == 1
    # Without the per-level metrics, or with a misspelt choice, the folder is refused by name.
    write({**meta, "shape_choice": "measured", "metrics": {}})
    with pytest.raises(ModelLoadError, match=r'shape_choice "measured" in .*eagle_config.json needs metrics.heldout'):
        EagleProposer.from_config(config, info)
    write({**meta, "shape_choice": "measure"})
    with pytest.raises(ModelLoadError, match=r"shape_choice in .*eagle_config.json must be one of saved, measured"):
        EagleProposer.from_config(config, info)


def test_a_drafter_without_per_level_statistics_is_saved_without_a_measured_shape(tmp_path):
    # Held-out responses too short for the third draft level give no top1_step3: no measured CPU shape can be
    # chosen from them, so none is saved, and the log says which keys to set instead (else a CPU would draft the
    # GPU-sized default tree, slower than plain decoding, unsaid).
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=1)
    write_distill_data(tmp_path / "d.jsonl", target, n=40, response_length=1)
    cfg = EagleTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "eagle"), features_cache="", vocab_size=12, epochs=1,
        batch_size=8, heldout_fraction=0.25,
    )  # fmt: skip
    logs = []
    metrics = train_eagle(cfg, target, None, log=logs.append)
    assert metrics["heldout"]["top1_step3"] is None and metrics["heldout"]["top1"] is not None
    assert "shape_choice" not in json.loads((tmp_path / "eagle" / "eagle_config.json").read_text())
    assert any("no per-level top-1 statistics" in m and "proposer.total_tokens" in m for m in logs), logs


@torch.no_grad()
def test_each_fused_layer_is_normalised_by_its_own_norm():
    # (random drafters have norm weights of 1, so a drafter that used the first norm for every layer passed)
    proposer = EagleProposer.random(target_info(target16()), seed=3, fuse_layers=(0, 2))
    drafter, h = proposer.drafter, 32
    for i, norm in enumerate(drafter.fuse_norms):
        norm.weight.copy_(torch.randn(h, generator=torch.Generator().manual_seed(i)))
    gen = torch.Generator().manual_seed(9)
    feats, extra = torch.randn(5, h, generator=gen), torch.randn(5, 2 * h, generator=gen)
    parts = [extra[:, i * h : (i + 1) * h] for i in range(2)]
    rms = [x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + drafter.config.rms_norm_eps) for x in parts]
    normed = torch.cat([x * norm.weight for x, norm in zip(rms, drafter.fuse_norms, strict=True)], -1)
    want = feats.to(drafter.fuse.weight.dtype) + drafter.fuse(normed.to(drafter.fuse.weight.dtype))
    torch.testing.assert_close(drafter.fused(feats, extra), want, atol=1e-4, rtol=1e-4)


def test_nodes_below_the_confidence_threshold_are_not_expanded(monkeypatch):
    # (a frontier left uncut kept the tree the same but fed the drafter every level: no early stop)
    fed, feed = [], EagleProposer._feed
    monkeypatch.setattr(EagleProposer, "_feed", lambda self, *args: fed.append(args[0].shape[0]) or feed(self, *args))
    tokens = torch.tensor([1, 5, 2, 7, 3])
    config = EagleConfig(depth=4, top_k=2, total_tokens=8, confidence_threshold=0.999999)  # (none reaches it)
    proposer, proposal = fresh_proposal(target16(), config, 0, tokens)
    assert len(proposal) == 1  # (the best first token, always kept)
    assert fed == [tokens.numel() - 1]  # (the committed pairs only: no tree level fed)
    assert proposer.cache.get_seq_length() == proposer.committed


@torch.no_grad()
def test_held_out_feature_error_is_a_mean_over_positions():
    """`feature_l1` over several sequences is the position-weighted mean of each one's alone (a mean per
    position, whatever the batch: divided by the sequences instead, it passed every test)."""
    from specframe.training.eagle import evaluate
    from specframe.training.features import FeatureSequence

    target = target16()
    drafter = EagleProposer.random(target_info(target), seed=0).drafter.float()
    gen = torch.Generator().manual_seed(0)
    seqs = [
        FeatureSequence(torch.randint(16, (n,), generator=gen), first, torch.randn(n, 32, generator=gen), f"s{n}")
        for n, first in ((9, 3), (14, 5), (6, 2))
    ]
    head, vocab_ids = target.lm_head.weight, torch.arange(12)
    alone = [evaluate(drafter, head, vocab_ids, [s]) for s in seqs]
    together = evaluate(drafter, head, vocab_ids, seqs, batch_size=2)
    positions = [m["positions"] for m in alone]
    assert together["positions"] == sum(positions) and len(set(positions)) > 1
    weighted = sum(m["feature_l1"] * m["positions"] for m in alone) / sum(positions)
    assert together["feature_l1"] == pytest.approx(weighted, rel=1e-5)
