"""`specframe train --proposer draft`: distil a small shared-weights draft from the target (DistillSpec).

The draft is a few of the target's own decoder layers (initialised as copies), on the target's embeddings,
with a reduced output vocabulary (the most frequent tokens of the distillation data; rows = the target's own
LM-head rows). Only the layers and the final norm are trained, with forward KL(p_target || q_draft) over the
reduced vocabulary at every response position, p_target coming from the target's cached features
(`specframe.training.features`). Reported on held-out prompts: top-1 agreement with the
target's greedy choice and alpha = 1 - TV(p, q) at temperature 1 (the expected acceptance of one sampled
draft token), over the full vocabulary (q = 0 outside the draft's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specframe.errors import ConfigError, ModelLoadError
from specframe.fingerprint import artifact_kind, not_an_artifact, target_fingerprint
from specframe.shared_draft import build_shared_draft, is_shared_draft, load_shared_draft, save_shared_draft
from specframe.training.common import (
    NO_MEASURED_SHAPE,
    Sequence,
    TrainRunConfig,
    collate,
    forward_kl,
    make_batches,
    on_device,
    only_run_in_out,
    recovered,
    resume_from,
    resuming_from,
    run_epochs,
    run_identity,
    start_run,
)
from specframe.training.features import split_features


@dataclass
class DraftTrainConfig(TrainRunConfig):
    artifact = "draft"

    # Output folder for the trained draft (draft_config.json, draft_vocab.json, model.safetensors, card).
    out: str = "runs/draft"
    # Passes over the training split (the shipped SmolLM2-135M draft: 6).
    epochs: int = 6
    # Decoder layers in the draft: more agree better with the target but cost more per drafted token (the
    # shipped SmolLM2-135M draft has 2: on 10x the data it beat the earlier 4-layer draft, see its card).
    layers: int = 2
    # Target layers the draft's layers start from (default: the first `layers`).
    init_layers: list[int] = field(default_factory=list)
    # Continue from this trained shared draft (a folder): its layers, final norm and vocabulary, which must
    # have `layers` layers and be made for this target. "" = start from the target layers above.
    init_from: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layers < 1:
            raise ConfigError(f"train.layers must be >= 1, got {self.layers}")
        if self.init_layers and len(self.init_layers) != self.layers:
            raise ConfigError(f"train.init_layers must list {self.layers} layers, got {self.init_layers}")
        if self.init_from and self.init_layers:
            raise ConfigError("train.init_from and train.init_layers both choose the start: set one")


@dataclass
class TeacherReference:
    """The frozen float32 target on the held-out split, computed once per run: per batch of `batch_size`
    sequences, the target's greedy token over its full vocabulary and its probabilities (temperature 1) on
    the draft's vocabulary. That is all `evaluate` needs: with q = 0 outside the draft's vocabulary,
    alpha = 1 - TV(p, q) = sum over the draft's vocabulary of min(p, q)."""

    batch_size: int
    greedy: list[torch.Tensor]  # per batch: [positions] long
    p_in_vocab: list[torch.Tensor]  # per batch: [positions, len(vocab_ids)] float32


@torch.no_grad()
def teacher_reference(target, vocab_ids, seqs, pad: int, batch_size: int = 8) -> TeacherReference:
    ref = TeacherReference(batch_size, [], [])
    for i in range(0, len(seqs), batch_size):
        ids, attn, mask = on_device(collate(seqs[i : i + batch_size], pad), target.device)
        logits = target(input_ids=ids, attention_mask=attn).logits[mask].float()
        ref.greedy.append(logits.argmax(-1))
        ref.p_in_vocab.append(logits.softmax(-1)[:, vocab_ids])
    return ref


@torch.no_grad()
def evaluate(draft, reference: TeacherReference, vocab_ids, seqs, pad: int) -> dict:
    """Top-1 agreement and alpha = 1 - TV(p, q) (temperature 1) at held-out response positions, against the
    target's full vocabulary (`reference`: `teacher_reference` over the same `seqs`)."""
    agree = total = 0
    alpha_sum = 0.0
    size = reference.batch_size
    batches = -(-len(seqs) // size)
    if len(reference.greedy) != batches:
        raise ValueError(f"the reference holds {len(reference.greedy)} batches, these sequences make {batches}")
    for b, i in enumerate(range(0, len(seqs), size)):
        ids, attn, mask = on_device(collate(seqs[i : i + size], pad), draft.device)
        if int(mask.sum()) != len(reference.greedy[b]):
            raise ValueError(f"batch {b}: {int(mask.sum())} positions, the reference has {len(reference.greedy[b])}")
        q = draft(input_ids=ids, attention_mask=attn).logits[mask].float().softmax(-1)
        agree += int((vocab_ids[q.argmax(-1)] == reference.greedy[b]).sum())
        alpha_sum += float(torch.minimum(reference.p_in_vocab[b], q).sum())
        total += int(mask.sum())
    return {"top1_agreement": agree / max(1, total), "alpha": alpha_sum / max(1, total), "positions": total}


def initial_draft(cfg: DraftTrainConfig, target) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    """(draft, vocab_ids, its target init layers) loaded from `cfg.init_from`, which must be a shared draft
    for `target` with `cfg.layers` layers."""
    folder = Path(cfg.init_from)
    if not is_shared_draft(folder):
        why = not_an_artifact(folder, "draft") if artifact_kind(folder) != "draft" else ""
        raise ConfigError(f"train.init_from '{folder}' is not a trained shared draft{f': it {why}' if why else ''}")
    try:
        draft, vocab_ids, _ = load_shared_draft(folder, target)
    except ModelLoadError as e:
        raise ConfigError(f"train.init_from: {e}") from e
    have = len(draft.model.layers)
    if have != cfg.layers:
        raise ConfigError(
            f"train.init_from '{folder}' has {have} layers; the config asks for train.layers={cfg.layers}"
        )
    init = json.loads((folder / "draft_config.json").read_text()).get("init_layers") or list(range(have))
    return draft, vocab_ids.cpu(), init


@only_run_in_out
def train_draft(cfg: DraftTrainConfig, target, tokenizer, resume: bool = False, log=print) -> dict:
    """Train and save a shared draft for `target` (a float32 model); returns the held-out metrics."""
    out = Path(cfg.out)
    have = target.config.num_hidden_layers
    if not cfg.init_from and not cfg.init_layers and cfg.layers > have:  # (the default start: layers 0..layers-1)
        raise ConfigError(
            f"train.layers={cfg.layers} is more than the target's {have} layers, which the draft's layers start "
            f"from: give train.init_layers, {cfg.layers} target layers (repeats allowed), or fewer train.layers"
        )
    train_ex, held_ex, vocab_ids = start_run(cfg, target, tokenizer, log)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if cfg.init_from:  # (loaded and checked before the features are extracted)
        draft, vocab_ids, init = initial_draft(cfg, target)
    else:
        init = cfg.init_layers or list(range(cfg.layers))
        draft = build_shared_draft(target, cfg.layers, vocab_ids, init_layers=init)
    draft.train()
    params = {k: p for k, p in draft.named_parameters() if k.startswith(("model.layers.", "model.norm."))}
    for k, p in draft.named_parameters():
        p.requires_grad_(k in params)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    # The teacher: the target's cached features (one bfloat16 pass shared with the Medusa and EAGLE trainers)
    # through its LM-head rows for the draft's vocabulary, computed per batch (never stored as log-probs).
    ckpt = recovered(out / "checkpoint")
    run = run_identity(cfg, train_ex, held_ex, vocab_ids, target_fingerprint(target))
    resuming = resuming_from(ckpt, params, resume, run, cfg.epochs)  # (refused before the features)
    train_feats, held_feats = split_features(cfg, target, train_ex, held_ex)
    train_seqs = [Sequence(f.ids.tolist(), f.first_target, f.features) for f in train_feats]
    held_seqs = [Sequence(f.ids.tolist(), f.first_target) for f in held_feats]
    in_vocab = torch.zeros(vocab_size, dtype=torch.bool)
    in_vocab[vocab_ids.cpu()] = True
    coverage = sum(int(in_vocab[torch.tensor(e.response_ids)].sum()) for e in held_ex if e.response_ids) / max(
        1, sum(len(e.response_ids) for e in held_ex)
    )
    start = f"the draft in '{cfg.init_from}'" if cfg.init_from else f"target layers {init}"
    log(
        f"draft: {cfg.layers} layers from {start}, vocabulary {len(vocab_ids)} "
        f"(covers {coverage:.1%} of held-out response tokens); {len(train_seqs)} train / {len(held_seqs)} "
        "held-out sequences"
    )

    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=0.0)
    checkpoints = resume_from(ckpt, params, optimizer, cfg, resuming=resuming, run=run, log=log)
    progress, history = checkpoints.start, checkpoints.history
    checkpoints.make_schedule(math.ceil(len(train_seqs) / cfg.batch_size), cfg.epochs)

    vocab_ids = vocab_ids.to(target.device)  # (the coverage above counted on the CPU)
    teacher_head = target.get_output_embeddings().weight.detach()[vocab_ids].float()  # [K, hidden]
    # float32, once per run (the target is frozen); not needed when resuming a run that already finished
    reference = teacher_reference(target, vocab_ids, held_seqs, pad) if progress.epoch < cfg.epochs else None
    batches = make_batches(train_seqs, cfg.batch_size, cfg.seed)

    def batch_loss(b: int, _gen) -> torch.Tensor:
        ids, attn, mask = collate(batches[b], pad)
        with torch.no_grad():  # (the cached features stay on the CPU: only the batch's go to the device)
            hidden = torch.cat([s.features[mask[i, : len(s.ids)]] for i, s in enumerate(batches[b])])
            p_log = (hidden.to(teacher_head.device).float() @ teacher_head.T).log_softmax(-1)
        ids, attn, mask = on_device((ids, attn, mask), draft.device)
        h = draft.model(input_ids=ids, attention_mask=attn).last_hidden_state[mask]
        return forward_kl(p_log, draft.lm_head(h).float().log_softmax(-1))

    run_epochs(
        cfg,
        checkpoints,
        (draft,),
        lambda gen: torch.randperm(len(batches), generator=gen).tolist(),
        batch_loss,
        lambda: evaluate(draft.eval(), reference, vocab_ids, held_seqs, pad),
        lambda m: f"held-out top-1 agreement {m['top1_agreement']:.3f}, alpha {m['alpha']:.3f}",
        log,
        loss_name="KL",
    )
    final = {
        "heldout": history[-1],
        "history": history,
        "vocab_coverage": coverage,
        "train_sequences": len(train_seqs),
        "heldout_sequences": len(held_seqs),
    }
    # On a CPU the draft drafts the γ (1-3) timed fastest at load from its held-out agreement (γ = 4, the default,
    # runs slower than plain decoding there); elsewhere the default γ.
    measured = bool(history[-1].get("positions"))
    save_shared_draft(
        draft.eval(),
        vocab_ids,
        target,
        out,
        init,
        final,
        extra={
            "train_config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            **({"shape_choice": "measured"} if measured else {}),
        },
    )
    if not measured:
        log(NO_MEASURED_SHAPE.format(what="agreement", keys="proposer.num_speculative_tokens"))
    log(f"saved to {cfg.out}")
    return final
