import copy
import hashlib
import json
import re

import pytest
import torch

from specframe import SpeculativeDecoder
from specframe.data import DistillExample, read_distill
from specframe.decoder import target_info
from specframe.errors import ConfigError, ModelLoadError, TrainingError
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.shared_draft import as_full_vocab_model, load_shared_draft
from specframe.testing.conformance import reference_greedy
from specframe.testing.tiny import tiny_llama, write_distill_data
from specframe.training.common import check_fits_half_precision, choose_vocab, optimizer_step, split_heldout
from specframe.training.draft import DraftTrainConfig, train_draft


@pytest.fixture
def trained(tmp_path):
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)
    write_distill_data(tmp_path / "d.jsonl", target)
    cfg = DraftTrainConfig(
        data=str(tmp_path / "d.jsonl"),
        out=str(tmp_path / "draft"),
        layers=1,
        vocab_size=10,
        epochs=3,
        lr=1e-2,
        batch_size=8,
        heldout_fraction=0.2,
        features_cache=str(tmp_path / "features"),
    )
    metrics = train_draft(cfg, target, None, log=lambda m: None)
    return target, cfg, metrics


def test_teacher_from_cached_features_lines_up_with_the_draft(tmp_path):
    # A draft made of all the target's layers agrees with the teacher, so the training KL is ~0 only if the
    # cached features are taken at exactly the positions the draft predicts (and the cache is really written).
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    write_distill_data(tmp_path / "d.jsonl", target)
    common = dict(data=str(tmp_path / "d.jsonl"), vocab_size=16, epochs=1, lr=1e-12, heldout_fraction=0.2)
    cache = tmp_path / "features"
    full = train_draft(
        DraftTrainConfig(**common, out=str(tmp_path / "a"), layers=2, features_cache=str(cache)),
        target,
        None,
        log=lambda m: None,
    )
    assert list(cache.glob("features-*.safetensors"))
    assert full["history"][-1]["train_kl"] < 1e-2  # the teacher pass is bfloat16
    assert full["history"][-1]["top1_agreement"] == 1.0
    part = train_draft(
        DraftTrainConfig(**common, out=str(tmp_path / "b"), layers=1, features_cache=""),
        target,
        None,
        log=lambda m: None,
    )
    assert part["history"][-1]["train_kl"] > 20 * full["history"][-1]["train_kl"]


def test_training_improves_agreement_and_saves_only_new_weights(trained):
    target, cfg, metrics = trained
    hist = metrics["history"]
    assert hist[-1]["train_kl"] < hist[1]["train_kl"] and 0 <= hist[-1]["alpha"] <= 1
    from safetensors.torch import load_file

    keys = set(load_file(f"{cfg.out}/model.safetensors"))
    assert keys and all(k.startswith(("model.layers.0.", "model.norm.")) for k in keys)
    assert all(v.dtype == torch.float16 for v in load_file(f"{cfg.out}/model.safetensors").values())


def test_metrics_of_a_draft_equal_to_the_target_are_perfect():
    from specframe.shared_draft import build_shared_draft
    from specframe.training.common import Sequence
    from specframe.training.draft import evaluate, teacher_reference

    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)
    vocab = torch.arange(16)
    clone = build_shared_draft(target, 3, vocab, init_layers=[0, 1, 2]).eval()
    seqs = [Sequence([1, 2, 3, 4, 5, 6], 3), Sequence([7, 8, 9], 1)]
    m = evaluate(clone, teacher_reference(target, vocab, seqs, pad=0), vocab, seqs, pad=0)
    assert m["top1_agreement"] == 1.0 and m["alpha"] == pytest.approx(1.0, abs=1e-4) and m["positions"] == 5


def test_metrics_of_a_reduced_vocabulary_draft_against_the_full_target():
    """alpha = 1 - TV(p, q) over the full vocabulary, q = 0 outside the draft's; top-1 against the full argmax."""
    from specframe.shared_draft import build_shared_draft
    from specframe.training.common import Sequence, collate
    from specframe.training.draft import evaluate, teacher_reference

    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)
    vocab = torch.tensor([0, 2, 3, 5, 7, 11, 13])
    draft = build_shared_draft(target, 1, vocab, init_layers=[1]).eval()
    seqs = [Sequence([1, 2, 3, 4, 5, 6, 9], 2), Sequence([7, 8, 9, 10], 1), Sequence([3, 3, 3], 1)]
    m = evaluate(draft, teacher_reference(target, vocab, seqs, pad=0, batch_size=2), vocab, seqs, pad=0)
    ids, attn, mask = collate(seqs, 0)  # the same numbers, directly and in one batch
    with torch.no_grad():
        p = target(input_ids=ids, attention_mask=attn).logits[mask].float().softmax(-1)
        q = torch.zeros_like(p)
        q[:, vocab] = draft(input_ids=ids, attention_mask=attn).logits[mask].float().softmax(-1)
    assert m["positions"] == int(mask.sum()) == 10
    assert m["alpha"] == pytest.approx(float((1 - 0.5 * (p - q).abs().sum(-1)).mean()), abs=1e-5)
    assert m["top1_agreement"] == pytest.approx(float((q.argmax(-1) == p.argmax(-1)).float().mean()))
    with pytest.raises(ValueError, match="batch 0"):  # a reference made from other sequences
        evaluate(draft, teacher_reference(target, vocab, seqs[1:], pad=0, batch_size=2), vocab, seqs[:2], pad=0)


def test_trained_draft_is_exact_under_greedy_and_reduced_vocabulary(trained):
    target, cfg, _ = trained
    info = target_info(target)
    proposer = DraftProposer.from_config(DraftConfig(model=cfg.out, num_speculative_tokens=3), info)
    assert proposer.vocab_ids is not None and len(proposer.vocab_ids) == 10
    dec = SpeculativeDecoder(target, proposer)
    for prompt in ([1, 2, 3], [4, 5]):
        res = dec.generate(prompt, max_new_tokens=12)
        assert res.token_ids == reference_greedy(target, prompt, 12)
    res = dec.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=0)
    assert all(0 <= t < 16 for t in res.token_ids)


def test_a_shared_draft_follows_the_targets_cpu_kernels_and_stays_exact(trained, monkeypatch):
    """A draft built on a target that runs specframe's CPU kernels gets them too (its linear layers rerouted, as
    `load_model` does for a draft given as a model), one on the stock kernels does not, and both are exact. (A
    float32 draft: `dtype: auto` makes one on a target off these kernels bfloat16 on a CPU with native bfloat16
    products; and the reference runs on the kernels the decoder's target runs on: they match
    PyTorch's products bit for bit on some CPUs, to float rounding on others. The decoder's forward also
    fuses q/k/v and gate/up, equal to the separate products here up to rounding that, on these tiny models,
    changes no token.)"""
    from specframe.cpu_kernels import fast_kernels_on, is_rerouted, use_fast_cpu_kernels

    monkeypatch.setattr("specframe.cpu_kernels.layout_choice", "few-rows")  # (every layer rerouted, not measured)
    target, cfg, _ = trained
    plain = DraftProposer.from_config(
        DraftConfig(model=cfg.out, num_speculative_tokens=3, dtype="float32"), target_info(target)
    )
    assert not fast_kernels_on(plain.model) and not any(map(is_rerouted, plain.model.modules()))
    fast_target = copy.deepcopy(target)
    use_fast_cpu_kernels(fast_target)
    fast = DraftProposer.from_config(
        DraftConfig(model=cfg.out, num_speculative_tokens=3, dtype="float32"), target_info(fast_target)
    )
    assert fast_kernels_on(fast.model) and is_rerouted(fast.model.lm_head)
    assert not fast_kernels_on(target)  # (the target the first draft was built on is untouched)
    dec = SpeculativeDecoder(fast_target, fast)
    for prompt in ([1, 2, 3], [4, 5]):
        assert dec.generate(prompt, max_new_tokens=12).token_ids == reference_greedy(fast_target, prompt, 12)


def test_quantize_rounds_the_drafts_own_layers_to_8_bit_blocks_and_stays_exact(trained, monkeypatch):
    """`proposer.quantize`: auto rounds the draft's own layers and head (a copy of target rows; kept where those are
    on a block grid already) where the target runs specframe's CPU kernels and the block kernel is there; none
    keeps the saved weights; the output is the target's either way. (A float32 draft: `dtype: auto` makes one on a
    target off these kernels bfloat16 on a CPU with native bfloat16 products, and `plain` below is compared with
    the saved float32 weights.)"""
    from specframe.block_weights import block_grid
    from specframe.cpu_kernels import use_fast_cpu_kernels

    monkeypatch.setattr("specframe.block_weights.blocks_available", lambda: True)  # (the option, not the kernel)
    target, cfg, _ = trained
    fast_target = copy.deepcopy(target)
    use_fast_cpu_kernels(fast_target)
    target_weights = {k: v.clone() for k, v in fast_target.state_dict().items()}
    saved = DraftProposer.from_config(
        DraftConfig(model=cfg.out, quantize="none", dtype="float32"), target_info(fast_target)
    ).model
    rounded = DraftProposer.from_config(DraftConfig(model=cfg.out, dtype="float32"), target_info(fast_target)).model
    q_saved, q_rounded = (m.model.layers[0].self_attn.q_proj.weight.detach() for m in (saved, rounded))
    assert block_grid(q_saved) is None and block_grid(q_rounded).bits == 8
    assert torch.allclose(q_saved, q_rounded, atol=q_saved.abs().max() / 127)
    assert block_grid(rounded.lm_head.weight.detach()) is not None  # (its copy of the target's rows, off any grid)
    plain = DraftProposer.from_config(
        DraftConfig(model=cfg.out, dtype="float32"), target_info(target)
    ).model  # (stock kernels)
    assert torch.equal(plain.model.layers[0].self_attn.q_proj.weight, q_saved)
    dec = SpeculativeDecoder(
        fast_target, DraftProposer.from_config(DraftConfig(model=cfg.out, dtype="float32"), target_info(fast_target))
    )
    for prompt in ([1, 2, 3], [4, 5]):
        assert dec.generate(prompt, max_new_tokens=12).token_ids == reference_greedy(fast_target, prompt, 12)
    assert all(torch.equal(v, target_weights[k]) for k, v in fast_target.state_dict().items())  # (the target's own)
    with pytest.raises(ConfigError, match="proposer.quantize must be one of auto, none, q8_0; got 'int4'"):
        DraftConfig(quantize="int4")


def test_full_vocab_wrapper_matches_the_reduced_draft(trained, changes_global_rng):
    target, cfg, _ = trained
    draft, vocab_ids, meta = load_shared_draft(cfg.out, target)
    assert not changes_global_rng(lambda: DraftProposer.from_config(DraftConfig(model=cfg.out), target_info(target)))
    assert not changes_global_rng(lambda: as_full_vocab_model(draft, vocab_ids, 16))
    assert meta["format"] == "specframe-shared-draft" and meta["llama_config"]["num_hidden_layers"] == 1
    full = as_full_vocab_model(draft, vocab_ids, 16)
    ids = torch.tensor([[1, 2, 3, 4]])
    small, big = draft(input_ids=ids).logits[0, -1], full(input_ids=ids).logits[0, -1]
    assert torch.allclose(big[vocab_ids], small, atol=1e-5) and big.argmax() == vocab_ids[small.argmax()]


def test_bf16_draft_leaves_the_shared_embedding_alone_and_stays_exact(trained):
    """A bfloat16 draft on a float32 target converts only its own weights, never the target's embedding that
    it shares, and greedy output is still the target's."""
    target, cfg, _ = trained
    before = target.get_input_embeddings().weight.clone()
    draft, _, _ = load_shared_draft(cfg.out, target, torch.bfloat16)
    assert draft.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert draft.lm_head.weight.dtype == torch.bfloat16
    assert target.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(target.get_input_embeddings().weight, before)
    assert draft(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16
    config = DraftConfig(model=cfg.out, num_speculative_tokens=3, dtype="bfloat16")
    dec = SpeculativeDecoder(target, DraftProposer.from_config(config, target_info(target)))
    for prompt in ([1, 2, 3], [4, 5]):
        assert dec.generate(prompt, max_new_tokens=12).token_ids == reference_greedy(target, prompt, 12)


def test_gamma_comes_from_the_config_else_the_draft_folder_else_four(trained):
    import json
    from pathlib import Path

    target, cfg, _ = trained
    info = target_info(target)
    meta_file = Path(cfg.out) / "draft_config.json"
    meta = json.loads(meta_file.read_text())
    assert meta["shape_choice"] == "measured"  # (the trainer's; its own test below)
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "shape_choice"}))
    assert DraftProposer.from_config(DraftConfig(model=cfg.out), info).gamma == 4
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "num_speculative_tokens": 2}))
    assert DraftProposer.from_config(DraftConfig(model=cfg.out), info).gamma == 2
    assert DraftProposer.from_config(DraftConfig(model=cfg.out, num_speculative_tokens=3), info).gamma == 3
    proposal_lengths = []
    proposer = DraftProposer.from_config(DraftConfig(model=cfg.out), info)
    propose = proposer.propose
    proposer.propose = lambda state: proposal_lengths.append(len(p := propose(state))) or p
    SpeculativeDecoder(target, proposer).generate([1, 2, 3], max_new_tokens=12)
    assert proposal_lengths and max(proposal_lengths) == 2
    for bad in (0, "2", 1.5, True):  # a malformed saved γ is named, never silently replaced by the default
        meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "num_speculative_tokens": bad}))
        with pytest.raises(ModelLoadError, match="num_speculative_tokens in .*draft_config.json must be an integer"):
            DraftProposer.from_config(DraftConfig(model=cfg.out, num_speculative_tokens=3), info)


def test_a_trained_draft_has_its_cpu_gamma_measured_on_the_machine(trained, monkeypatch):
    # The trainer saves `"shape_choice": "measured"`: on a CPU the draft drafts the γ of 1-3 that is fastest with
    # this machine's timings (specframe/step_costs.py) and its held-out agreement a (1 + a + ... + a^γ).
    import dataclasses
    from pathlib import Path

    from specframe.proposers import draft
    from specframe.step_costs import StepCosts

    target, cfg, _ = trained
    info = target_info(target)
    real = DraftProposer.from_config(DraftConfig(model=cfg.out), info)  # (really timed: one of the three)
    assert real.gamma in (1, 2, 3) and real.shape_choice.startswith(f"γ = {real.gamma} (measured: γ of 1-3, ")
    meta_file = Path(cfg.out) / "draft_config.json"
    meta = json.loads(meta_file.read_text())
    write = lambda m: meta_file.write_text(json.dumps(m))  # noqa: E731
    a = 0.8
    held = {**meta["metrics"]["heldout"], "top1_agreement": a}
    write({**meta, "metrics": {**meta["metrics"], "heldout": held}, "num_speculative_tokens": 4})
    candidates = draft.measured_gammas(json.loads(meta_file.read_text()), "here")
    assert [(c.shape, c.verify_tokens, c.drafter_forwards) for c in candidates] == [(1, 2, 1), (2, 3, 2), (3, 4, 3)]
    assert [c.accepted_length for c in candidates] == pytest.approx([1 + a, 1 + a + a**2, 1 + a + a**2 + a**3])
    draft_steps = []
    monkeypatch.setattr(draft, "relative_cost", lambda call, model: draft_steps.append(call()) or 0.1)
    for relative, gamma in (((1.0, 1.0, 1.0, 1.0), 3), ((1.0, 1.0, 9.0, 9.0), 1), ((1.0, 1.0, 1.05, 9.0), 2)):
        monkeypatch.setattr(draft, "measure_step_costs", lambda model, r=relative: StepCosts(0.01, r))
        p = DraftProposer.from_config(DraftConfig(model=cfg.out), info)  # (measured wins over the saved γ of 4)
        assert p.gamma == gamma and p.shape_choice.startswith(f"γ = {gamma} (measured: γ of 1-3"), relative
        assert "a draft step 0.10" in p.shape_choice
        lengths = []
        propose = p.propose
        p.propose = lambda state, f=propose, out=lengths: out.append(len(q := f(state))) or q
        got = SpeculativeDecoder(target, p).generate([1, 2, 3], max_new_tokens=12)  # exact, whatever γ
        assert got.token_ids == reference_greedy(target, [1, 2, 3], 12)
        assert lengths and max(lengths) == gamma
    assert len(draft_steps) == 3  # (the timed draft step ran)

    def refuse(model):
        raise AssertionError("timed")

    monkeypatch.setattr(draft, "measure_step_costs", refuse)
    # A configured γ wins and nothing is timed; on another device ("meta" stands in for a GPU), nothing either.
    p = DraftProposer.from_config(DraftConfig(model=cfg.out, num_speculative_tokens=2), info)
    assert p.gamma == 2 and p.shape_choice is None
    elsewhere = DraftProposer.from_config(
        DraftConfig(model=cfg.out), dataclasses.replace(info, device=torch.device("meta"))
    )
    assert elsewhere.gamma == 4 and elsewhere.shape_choice is None  # (the saved γ)
    # Without the held-out agreement, or with a misspelt choice, the folder is refused by name.
    for bad in (None, 1.5, "0.5", True):
        write({**meta, "metrics": {**meta["metrics"], "heldout": {**held, "top1_agreement": bad}}})
        with pytest.raises(ModelLoadError, match=r'shape_choice "measured" in .*draft_config.json needs metrics.held'):
            DraftProposer.from_config(DraftConfig(model=cfg.out), info)
    write({**meta, "shape_choice": "measure"})
    with pytest.raises(ModelLoadError, match=r"shape_choice in .*draft_config.json must be one of saved, measured"):
        DraftProposer.from_config(DraftConfig(model=cfg.out), info)


def test_draft_for_another_target_is_refused(trained):
    target, cfg, _ = trained
    other = tiny_llama(vocab_size=16, seed=5, hidden_size=32, num_layers=3)
    with pytest.raises(ModelLoadError, match="made for another target: the weights differ"):
        load_shared_draft(cfg.out, other)
    same_embeddings = copy.deepcopy(target)
    torch.nn.init.normal_(same_embeddings.model.layers[-1].mlp.up_proj.weight)
    with pytest.raises(ModelLoadError, match="made for another target: the weights differ"):
        load_shared_draft(cfg.out, same_embeddings)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_draft_trained_in_float32_loads_on_the_target_in_half_precision(trained, dtype):
    target, cfg, _ = trained
    draft, _, _ = load_shared_draft(cfg.out, copy.deepcopy(target).to(dtype))
    assert draft.dtype == dtype


def test_resume_continues_after_the_last_epoch(trained, tmp_path):
    target, cfg, _ = trained
    cfg3 = DraftTrainConfig(**{**cfg.__dict__, "epochs": 4})
    logs = []
    metrics = train_draft(cfg3, target, None, resume=True, log=logs.append)
    assert any("resumed" in m and "epoch 3" in m for m in logs)
    assert [h["epoch"] for h in metrics["history"]] == [0, 1, 2, 3, 4]


def test_a_loss_that_is_not_finite_stops_training_before_it_reaches_the_weights():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(TrainingError, match=f"training diverged: the loss is {bad}"):
            optimizer_step((weight * bad).sum(), {"w": weight}, optimizer, schedule, None)
        assert weight.tolist() == [1.0, 1.0, 1.0] and weight.grad is None


def test_weights_that_outgrow_float16_stop_training_before_anything_is_saved(trained, tmp_path):
    # A learning rate far too high can leave the loss finite while the weights grow past float16's range: the run
    # ended "saved" with an artifact of infs that generate refused. It stops at the epoch's checkpoint now.
    target, cfg, _ = trained
    wild = DraftTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "wild"), "lr": 1e7, "epochs": 1})
    with pytest.raises(TrainingError, match=r"^training diverged: the weight '[^']+' reached .* range of float16"):
        train_draft(wild, target, None, resume=False, log=lambda m: None)
    assert not (tmp_path / "wild" / "model.safetensors").exists()
    assert not (tmp_path / "wild" / "checkpoint").exists()
    check_fits_half_precision({"w": torch.tensor([65504.0, -65504.0]), "ids": torch.tensor([10**6])})
    for bad in (65600.0, float("inf"), float("nan")):
        with pytest.raises(TrainingError, match="the weight 'w' reached"):
            check_fits_half_precision({"w": torch.tensor([0.0, bad])})


def test_resume_without_a_checkpoint_is_refused(trained, tmp_path):
    target, cfg, _ = trained
    typo = DraftTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "drfat"), "features_cache": str(tmp_path / "f")})
    with pytest.raises(ConfigError, match="--resume: no checkpoint in .*drfat/checkpoint"):
        train_draft(typo, target, None, resume=True, log=lambda m: None)
    assert not (tmp_path / "f").exists() and not (tmp_path / "drfat").exists()


def test_resume_with_other_layers_is_refused_before_the_features_are_extracted(trained, tmp_path):
    target, cfg, _ = trained
    other = DraftTrainConfig(**{**cfg.__dict__, "layers": 2, "features_cache": str(tmp_path / "fresh")})
    with pytest.raises(ConfigError, match="checkpoint in .* was trained with train.layers=1, not 2"):
        train_draft(other, target, None, resume=True, log=lambda m: None)
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize(
    "change, what",
    [
        ({"seed": 1}, r"seed \(it splits .*\): 0 then, 1 now; resume"),  # (held-out ones would be trained on)
        ({"heldout_fraction": 0.3}, "held-out split"),
        ({"vocab_size": 12}, "vocabulary"),
        ({"max_length": 9}, r"max_length: \d+ then, 9 now; resume"),
        ({"data": "fewer"}, "training data"),
    ],
)
def test_resume_with_other_data_or_options_is_refused_before_extraction(trained, tmp_path, change, what):
    target, cfg, _ = trained
    if change.get("data") == "fewer":
        lines = open(cfg.data).read().splitlines(keepends=True)
        held = {e.id for e in split_heldout(read_distill(cfg.data), cfg.heldout_fraction, cfg.seed)[1]}
        kept = [line for line in lines if json.loads(line)["id"] in held or lines.index(line) % 2]
        (tmp_path / "fewer.jsonl").write_text("".join(kept))
        change = {"data": str(tmp_path / "fewer.jsonl")}
    other = DraftTrainConfig(**{**cfg.__dict__, **change, "epochs": 4, "features_cache": str(tmp_path / "fresh")})
    with pytest.raises(ConfigError, match=f"checkpoint in .* was trained with another {what}"):
        train_draft(other, target, None, resume=True, log=lambda m: None)
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("change", [{"batch_size": 3}, {"init_layers": [2]}])
def test_resume_with_other_training_options_is_refused_naming_the_option(trained, tmp_path, change):
    # (once accepted silently: the saved train_config then recorded options the run had not trained with)
    target, cfg, _ = trained
    other = DraftTrainConfig(**{**cfg.__dict__, **change, "epochs": 4, "features_cache": str(tmp_path / "fresh")})
    ((key, value),) = change.items()
    was = getattr(cfg, key)
    with pytest.raises(
        ConfigError, match=rf"trained with train\.{key}={re.escape(repr(was))}, not {re.escape(repr(value))}"
    ):
        train_draft(other, target, None, resume=True, log=lambda m: None)
    assert not (tmp_path / "fresh").exists()


def test_a_held_out_fraction_that_leaves_one_side_empty_is_named(trained, tmp_path):
    target, cfg, _ = trained
    for fraction, side in ((0.999, "training"), (1e-9, "held-out")):
        other = DraftTrainConfig(**{**cfg.__dict__, "heldout_fraction": fraction, "out": str(tmp_path / "o")})
        with pytest.raises(ConfigError, match=f"heldout_fraction={fraction} leaves no {side} example"):
            train_draft(other, target, None, log=lambda m: None)


def test_resume_with_fewer_epochs_than_done_is_refused(trained, tmp_path):
    target, cfg, _ = trained
    fewer = DraftTrainConfig(**{**cfg.__dict__, "epochs": cfg.epochs - 1, "features_cache": str(tmp_path / "fresh")})
    with pytest.raises(
        ConfigError, match=f"was saved after epoch {cfg.epochs}: train.epochs={cfg.epochs - 1} would train none"
    ):
        train_draft(fewer, target, None, resume=True, log=lambda m: None)


def test_data_the_target_cannot_train_on_is_refused_before_the_features_are_extracted(trained, tmp_path):
    import json

    target, cfg, _ = trained
    rows = [json.loads(line) for line in open(cfg.data)]
    rows[3]["response_ids"][0] = 16  # the tiny target has 16 tokens
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {**cfg.__dict__, "data": str(tmp_path / "bad.jsonl"), "features_cache": str(tmp_path / "f")}
    with pytest.raises(ConfigError, match=f"example '{rows[3]['id']}' has token id 16, outside the target's"):
        train_draft(DraftTrainConfig(**{**base, "out": str(tmp_path / "a")}), target, None, log=lambda m: None)
    short = {**base, "data": cfg.data, "max_length": 3}  # every prompt is longer: no response token is left
    with pytest.raises(ConfigError, match="no training example keeps a response token within max_length=3"):
        train_draft(DraftTrainConfig(**{**short, "out": str(tmp_path / "b")}), target, None, log=lambda m: None)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("layer", [5, -1])
def test_init_layers_outside_the_target_are_named(tmp_path, layer):
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    write_distill_data(tmp_path / "d.jsonl", target, n=10)
    cfg = DraftTrainConfig(
        data=str(tmp_path / "d.jsonl"),
        out=str(tmp_path / "a"),
        layers=1,
        init_layers=[layer],
        heldout_fraction=0.3,
        features_cache="",
    )
    with pytest.raises(ConfigError, match=f"train.init_layers: {layer} is not a layer of the target \\(0 to 1\\)"):
        train_draft(cfg, target, None, log=lambda m: None)


def test_more_draft_layers_than_the_target_has_names_train_layers(tmp_path):
    # (the default start copies target layers 0..layers-1: the error used to blame train.init_layers, not set)
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    write_distill_data(tmp_path / "d.jsonl", target, n=10)
    base = {"data": str(tmp_path / "d.jsonl"), "heldout_fraction": 0.3, "features_cache": "", "epochs": 1}
    cfg = DraftTrainConfig(**base, out=str(tmp_path / "a"), layers=3)
    with pytest.raises(ConfigError, match=r"train.layers=3 is more than the target's 2 layers.*give train.init_layers"):
        train_draft(cfg, target, None, log=lambda m: None)
    assert not (tmp_path / "a").exists()
    repeated = DraftTrainConfig(**base, out=str(tmp_path / "b"), layers=3, init_layers=[0, 1, 1])  # (allowed)
    train_draft(repeated, target, None, log=lambda m: None)
    assert (tmp_path / "b" / "draft_config.json").is_file()


def test_output_folders_that_cannot_be_written_are_refused_before_training(tmp_path):
    # (before: an `out` that is a file failed after the first epoch, at its checkpoint)
    (tmp_path / "file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="train.out '.*dangling' is a link to nothing"):
        DraftTrainConfig(out=str(tmp_path / "dangling"))
    with pytest.raises(ConfigError, match="train.features_cache '.*file' is a file; it must name a folder"):
        DraftTrainConfig(features_cache=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="train.out '.*file' is a file; it must name a folder"):
        DraftTrainConfig(out=str(tmp_path / "file"))
    # (a seed torch.manual_seed cannot take: it was torch's "Overflow when unpacking long long", exit 1)
    with pytest.raises(ConfigError, match=r"^train.seed must be an integer in \[-2\*\*63, 2\*\*64\), got 10{23}$"):
        DraftTrainConfig(seed=10**23)
    with pytest.raises(ConfigError, match="train.out '.*file/draft' lies under '.*file', which is a file"):
        DraftTrainConfig(out=str(tmp_path / "file" / "draft"))


def test_output_folders_where_nothing_can_be_made_are_refused_before_training(unwritable_folder):
    # (before: features, then a whole epoch, then exit 1 at the first checkpoint: "Operation not permitted")
    where = unwritable_folder
    with pytest.raises(ConfigError, match=rf"^train.out '{where}/run' cannot be written: .* \(in '{where}'\)"):
        DraftTrainConfig(out=f"{where}/run")
    with pytest.raises(ConfigError, match=rf"^train.features_cache '{where}/f/g' cannot be written"):
        DraftTrainConfig(features_cache=f"{where}/f/g")


def test_paths_starting_with_a_tilde_are_in_the_home_folder(tmp_path, monkeypatch):
    # (before: `out: ~/run` in a recipe, or `--out=~/x`, made a folder named '~' in the current one)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = DraftTrainConfig(data="~/d.jsonl", out="~/run", features_cache="~/feat", init_from="~/start")
    assert (cfg.data, cfg.out, cfg.features_cache) == tuple(str(tmp_path / n) for n in ("d.jsonl", "run", "feat"))
    assert cfg.init_from == str(tmp_path / "start") and DraftTrainConfig(out="a~b").out == "a~b"


def test_training_into_another_kind_of_artifact_is_refused(trained, tmp_path):
    # (before: a draft trained into a folder of Medusa heads replaced their weights, and the heads failed to load)
    from specframe.training.eagle import EagleTrainConfig
    from specframe.training.medusa import MedusaTrainConfig

    _, cfg, _ = trained
    for other in (MedusaTrainConfig, EagleTrainConfig):
        article = "an" if other.artifact == "eagle" else "a"
        with pytest.raises(ConfigError, match=f"holds a trained draft artifact .*training {article} {other.artifact} "):
            other(out=cfg.out)
    assert DraftTrainConfig(out=cfg.out).out == cfg.out  # retraining a draft in place is allowed


@pytest.mark.parametrize("field, value", [("layers", 0), ("heldout_fraction", 1.0), ("epochs", 0)])
def test_bad_training_options(field, value):
    with pytest.raises(ConfigError, match=f"train.{field}"):
        DraftTrainConfig(**{field: value})


def test_init_from_continues_from_a_trained_draft(trained, tmp_path):
    # With a learning rate too small to move anything, the continued run starts (epoch 0) where the trained
    # draft ended, saves its weights unchanged, and keeps its vocabulary, not the one its own config would
    # choose (vocab_size=16).
    import json

    target, cfg, metrics = trained
    more = DraftTrainConfig(
        **{
            **cfg.__dict__,
            "out": str(tmp_path / "more"),
            "init_from": cfg.out,
            "vocab_size": 16,
            "epochs": 1,
            "lr": 1e-12,
        }
    )
    logs = []
    again = train_draft(more, target, None, log=logs.append)
    before, after = again["history"][0], metrics["history"][-1]
    assert before["top1_agreement"] == pytest.approx(after["top1_agreement"], abs=0.02)  # (saved in float16)
    assert before["alpha"] == pytest.approx(after["alpha"], abs=0.01)
    from safetensors.torch import load_file

    trained_w, continued_w = load_file(f"{cfg.out}/model.safetensors"), load_file(f"{more.out}/model.safetensors")
    assert continued_w.keys() == trained_w.keys()
    assert all(torch.equal(continued_w[k], trained_w[k]) for k in trained_w)
    layer0 = {k: v.half() for k, v in target.model.layers[0].state_dict().items()}  # (a fresh start's weights)
    assert not all(torch.equal(trained_w[f"model.layers.0.{k}"], v) for k, v in layer0.items())
    vocab = json.loads((tmp_path / "more" / "draft_vocab.json").read_text())
    assert vocab == json.loads((tmp_path / "draft" / "draft_vocab.json").read_text()) and len(vocab) == 10
    assert any(f"from the draft in '{cfg.out}'" in m for m in logs)


def test_init_from_refuses_what_it_cannot_continue(trained, tmp_path):
    target, cfg, _ = trained
    base = {**cfg.__dict__, "out": str(tmp_path / "more"), "epochs": 1}
    with pytest.raises(ConfigError, match="not a trained shared draft"):
        train_draft(DraftTrainConfig(**{**base, "init_from": str(tmp_path)}), target, None, log=lambda m: None)
    with pytest.raises(ConfigError, match="has 1 layers; the config asks for train.layers=2"):
        train_draft(DraftTrainConfig(**{**base, "init_from": cfg.out, "layers": 2}), target, None, log=lambda m: None)
    other = tiny_llama(vocab_size=16, seed=5, hidden_size=32, num_layers=3)
    with pytest.raises(ConfigError, match="train.init_from: .*another target"):
        train_draft(DraftTrainConfig(**{**base, "init_from": cfg.out}), other, None, log=lambda m: None)
    with pytest.raises(ConfigError, match="train.init_from and train.init_layers"):
        DraftTrainConfig(init_from=cfg.out, init_layers=[0, 1])
    # Another split would report prompts the start was trained on as held out (it had seed 0, fraction 0.2).
    for change, message in (
        ({"seed": 1}, "seed=0, this run has train.seed=1"),
        ({"heldout_fraction": 0.3}, "heldout_fraction=0.2, .* or less"),
    ):
        with pytest.raises(ConfigError, match=f"train.init_from '.*' was trained with {message}"):
            train_draft(DraftTrainConfig(**{**base, "init_from": cfg.out, **change}), target, None, log=lambda m: None)
    logs = []  # (a smaller fraction holds out a subset of its held-out prompts)
    train_draft(
        DraftTrainConfig(**{**base, "init_from": cfg.out, "heldout_fraction": 0.1}), target, None, log=logs.append
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "draft_vocab.json").unlink(), "incomplete or corrupt: FileNotFoundError"),
        (lambda d: (d / "draft_vocab.json").write_text("[1, 99]"), "outside the target's vocabulary \\[0, 16\\)"),
        (lambda d: (d / "draft_vocab.json").write_text("[1, 1]"), "lists a token id more than once"),
        (lambda d: edit_meta(d, lambda m: m.pop("target")), "target fingerprint is missing"),
        (lambda d: edit_meta(d, lambda m: m["llama_config"].update(num_hidden_layers=2)), "is missing weights"),
        (  # (refused before any is built: a hostile config could claim millions)
            lambda d: edit_meta(d, lambda m: m["llama_config"].update(num_hidden_layers=200)),
            "is missing weights: layer 1 on \\(draft_config.json says 200 layers, its weights hold 1\\)",
        ),
        (  # (layers claimed by a token tensor each: counted by name, they passed, and were all built)
            lambda d: (edit_meta(d, lambda m: m["llama_config"].update(num_hidden_layers=3)), stub_layers(d, 1, 2)),
            r"has weights that do not fit: model.layers.1.self_attn.q_proj.weight is missing",
        ),
        (
            lambda d: stretch(d, "model.layers.0.mlp.up_proj.weight"),
            r"model.layers.0.mlp.up_proj.weight is of shape \[65, 32\], not \[64, 32\]",
        ),
        (lambda d: edit_meta(d, lambda m: m.pop("llama_config")), "incomplete or corrupt: KeyError"),
        (lambda d: edit_meta(d, lambda m: m["llama_config"].update(num_hidden_layers="x")), "must be an integer"),
        (lambda d: truncate(d / "model.safetensors"), "incomplete or corrupt: SafetensorError"),
        (lambda d: poison(d / "model.safetensors"), "holds values that are not finite \\(in 'model.norm.weight'\\)"),
    ],
)
def test_a_damaged_draft_folder_is_named(trained, tmp_path, damage, message):
    import shutil

    target, cfg, _ = trained
    folder = tmp_path / "damaged"
    shutil.copytree(cfg.out, folder)
    damage(folder)
    with pytest.raises(ModelLoadError, match=f"draft '{folder}'.*{message}"):
        load_shared_draft(folder, target)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1]", "draft_config.json holds no JSON object"),
        ("{not json", "JSONDecodeError"),
        ("[" * 200_000, "RecursionError"),  # (nested too deeply for Python's parser: was exit 1, unnamed)
    ],
)
def test_a_damaged_draft_config_is_named_by_the_proposer(trained, tmp_path, text, message):
    # (not "has no config.json", as if the folder were meant as a Hugging Face model)
    import shutil

    target, cfg, _ = trained
    shutil.copytree(cfg.out, tmp_path / "d")
    (tmp_path / "d" / "draft_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=f"draft '{tmp_path / 'd'}' is incomplete or corrupt: .*{message}"):
        DraftProposer.from_config(DraftConfig(model=str(tmp_path / "d")), target_info(target))


def poison(weights):  # (as a run that diverged would have saved them)
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, weights)


def edit_meta(folder, change):
    meta = json.loads((folder / "draft_config.json").read_text())
    change(meta)
    (folder / "draft_config.json").write_text(json.dumps(meta))


def stub_layers(folder, *layers):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors.update({f"model.layers.{i}.stub": torch.zeros(0) for i in layers})
    save_file(tensors, folder / "model.safetensors")


def stretch(folder, name):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, *tensors[name].shape[1:], dtype=tensors[name].dtype)
    save_file(tensors, folder / "model.safetensors")


def truncate(file, size=100):
    file.write_bytes(file.read_bytes()[:size])


def test_a_draft_for_the_base_model_serves_it_with_an_adapter_merged(trained, tmp_path):
    from specframe.fingerprint import mark_adapter, target_fingerprint

    target, cfg, _ = trained
    adapted = copy.deepcopy(target)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"an adapter")
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    mark_adapter(adapted, target_fingerprint(target), tmp_path)
    load_shared_draft(cfg.out, adapted)  # (exactness never depends on the draft; Medusa heads do refuse this)


def test_a_gamma_tuned_on_a_cpu_is_not_used_on_other_devices(trained, tmp_path):
    import dataclasses
    import shutil

    from specframe.proposers.draft import DEFAULT_GAMMA

    target, cfg, _ = trained
    shutil.copytree(cfg.out, tmp_path / "tuned")
    edit_meta(tmp_path / "tuned", lambda m: m.update(num_speculative_tokens=1, shape_tuned_on="cpu"))
    info = target_info(target)
    config = DraftConfig(model=str(tmp_path / "tuned"))
    assert DraftProposer.from_config(config, info).gamma == 1
    elsewhere = dataclasses.replace(info, device=torch.device("meta"))  # (standing in for a GPU)
    assert DraftProposer.from_config(config, elsewhere).gamma == DEFAULT_GAMMA


def test_empty_data_is_refused_and_a_whole_vocabulary_is_said(tmp_path):
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = DraftTrainConfig(data=str(empty), out=str(tmp_path / "a"), layers=1, epochs=1, heldout_fraction=0.2)
    with pytest.raises(ConfigError, match=r"^train.data '.*empty.jsonl' holds no examples \(make it with"):
        train_draft(cfg, target, None, log=lambda m: None)
    write_distill_data(tmp_path / "d.jsonl", target)
    logs: list[str] = []
    whole = DraftTrainConfig(**{**cfg.__dict__, "data": str(tmp_path / "d.jsonl"), "vocab_size": 100000})
    train_draft(whole, target, None, log=logs.append)
    assert "train.vocab_size=100000 covers the target's whole vocabulary of 16 tokens" in logs
    assert load_shared_draft(tmp_path / "a", target)[1].numel() == 16


def test_generate_names_the_gamma_a_trained_draft_chose_on_this_cpu(tmp_path, tiny_dirs, capsys):
    # The stats line says what was timed at load (docs/training.md), and says nothing when γ is configured.
    from specframe.cli import main
    from specframe.models import load_model

    target = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True).model
    write_distill_data(tmp_path / "d.jsonl", target, n=30)
    common = ["train", "--proposer", "draft", "--target", str(tiny_dirs["target"]), "--device", "cpu"]
    options = [f"data={tmp_path / 'd.jsonl'}", f"out={tmp_path / 'draft'}", "layers=1", "vocab_size=6", "epochs=1"]
    assert main([*common, *options, "heldout_fraction=0.2", "features_cache="]) == 0, capsys.readouterr().err
    capsys.readouterr()
    generate = ["generate", "--target", str(tiny_dirs["target"]), "--proposer", "draft", "--raw", "--prompt", "a b"]
    generate += ["--max-new-tokens", "6", f"proposer.model={tmp_path / 'draft'}"]
    assert main(generate) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    at_first = r"draft: γ = [123] at first \(re-chosen each step by the acceptance so far\)"
    assert re.search(rf"tokens/s; {at_first}, chosen at load from this CPU's timings$", line), line
    assert main([*generate, "--json"]) == 0  # (--json says it too: a shape decides a sampled run's draws)
    assert re.fullmatch(at_first, " ".join(json.loads(capsys.readouterr().out)["shapes"]))
    assert main([*generate, "proposer.adapt_shape=false"]) == 0  # (γ as chosen at load, every step)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"tokens/s; draft: γ = [123], chosen at load from this CPU's timings$", line), line
    assert main([*generate, "proposer.num_speculative_tokens=2"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[draft] ") and line.endswith(" tokens/s"), line


def distill_example(pid, prompt=(1, 2), resp=(3, 4)):
    return DistillExample(pid, "s", list(prompt), list(resp), True)


# (tests from a mutation review of training, 2026-12-06: each fails on the mutation it is named for)


def test_the_held_out_split_depends_on_the_seed_as_documented():
    rows = [distill_example(f"p{i}") for i in range(200)]
    held0 = {e.id for e in split_heldout(rows, 0.2, seed=0)[1]}
    held1 = {e.id for e in split_heldout(rows, 0.2, seed=1)[1]}
    assert held0 != held1
    # the documented rule, exactly: sha256("<seed>:<prompt_id>")[:8] / 2**64 < fraction
    want = {
        e.id
        for e in rows
        if int.from_bytes(hashlib.sha256(f"7:{e.prompt_id}".encode()).digest()[:8], "big") / 2**64 < 0.2
    }
    assert {e.id for e in split_heldout(rows, 0.2, seed=7)[1]} == want


def test_the_vocabulary_is_the_most_frequent_response_tokens_then_prompt_tokens():
    rows = [
        distill_example("a", prompt=(9, 9, 9, 9, 9), resp=(1, 1, 2)),
        distill_example("b", prompt=(9, 8), resp=(2, 3)),
    ]
    # responses: 1 x2, 2 x2, 3 x1; prompt token 9 is frequent but never in a response
    assert choose_vocab(rows, 3, 16, []).tolist() == [1, 2, 3]
    assert choose_vocab(rows, 4, 16, []).tolist() == [1, 2, 3, 9]  # then prompt tokens fill up
    assert choose_vocab(rows, 2, 16, [15]).tolist() == [1, 15] or choose_vocab(rows, 2, 16, [15]).tolist() == [2, 15]


def test_the_vocabulary_never_comes_from_held_out_responses(tmp_path):
    from specframe.training.common import start_run
    from specframe.training.draft import DraftTrainConfig

    ids = [f"p{i}" for i in range(40)]
    held = {e.id for e in split_heldout([distill_example(i) for i in ids], 0.2, 0)[1]}
    rows = [
        {"id": i, "prompt_ids": [7], "response_ids": [15] * 20 if i in held else [1 + n % 6, 1 + (n + 1) % 6]}
        for n, i in enumerate(ids)
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DraftTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"), heldout_fraction=0.2, vocab_size=4, layers=1
    )
    _, _, vocab = start_run(cfg, tiny_llama(vocab_size=16, hidden_size=32), None, log=lambda m: None)
    assert 15 not in vocab.tolist()


def test_top1_agreement_maps_draft_columns_to_target_ids():
    from specframe.shared_draft import build_shared_draft
    from specframe.training.common import Sequence
    from specframe.training.draft import evaluate, teacher_reference

    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)
    seqs = [Sequence([1, 2, 3, 4, 5, 6], 3), Sequence([7, 8, 9], 1)]
    greedy = torch.cat(teacher_reference(target, torch.arange(16), seqs, pad=0).greedy)
    vocab = torch.tensor(sorted(set(greedy.tolist()) | {15}))  # holds every greedy token, not at its own index
    clone = build_shared_draft(target, 3, vocab, init_layers=[0, 1, 2]).eval()
    m = evaluate(clone, teacher_reference(target, vocab, seqs, pad=0), vocab, seqs, pad=0)
    assert m["top1_agreement"] == 1.0


def test_the_shared_draft_needs_a_llama_target_and_says_what_to_do_instead():
    from transformers import MistralConfig, MistralForCausalLM

    from specframe.shared_draft import build_shared_draft

    mistral = MistralForCausalLM(
        MistralConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, sliding_window=None)
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="Llama-architecture target, got 'mistral': .*smaller model with its"):
        build_shared_draft(mistral, 1, torch.arange(4))
