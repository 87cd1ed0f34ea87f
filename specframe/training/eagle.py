"""`specframe train --proposer eagle`: train the EAGLE drafter on the target's own features.

Data: self-distillation sequences (`specframe data distill`) and the target's post-norm last hidden states
over them (`specframe.training.features`, computed once and cached). At each position j the drafter reads
(f_j + noise, token j+1) and predicts f_{j+1}; the loss is EAGLE-1's:

    feature_weight * SmoothL1(f̂_{j+1}, f_{j+1})  +  token_weight * CE(p_{j+1}, q_{j+1})

with p = softmax of the target's LM-head rows (the reduced vocabulary) on the real feature and q the same on
the predicted one. Then `self_fed_steps` self-fed passes (EAGLE-3's training-time test; default 1): pass s
feeds the drafter its own predicted features from pass s-1, as draft-tree level s reads them, attending to the
real pairs before it and to its own earlier self-fed pairs; each adds `self_fed_weight` times the same losses
and costs about one more forward/backward.

With `fuse_layers` (EAGLE-3's multi-layer features) the input feature at real positions is fused with those
target layers' outputs (`EagleDrafter.fused`); the regression target stays the next last-layer feature, and
the self-fed steps feed the predicted feature as it is, as drafting does.

Reported per epoch on held-out prompts, against the target's next token over its full vocabulary:
`top1` (step 1, teacher-forced: the first draft level), `top1_step2` and `top1_step3` (the drafter fed its own
predicted features for one and two steps: draft levels 2 and 3, whatever `self_fed_steps` trains) and
`feature_l1` (mean absolute feature error at step 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specframe.errors import ConfigError, is_count, is_number
from specframe.fingerprint import target_fingerprint
from specframe.training.common import TrainRunConfig, only_run_in_out


@dataclass
class EagleTrainConfig(TrainRunConfig):
    artifact = "eagle"

    # Output folder for the trained drafter (eagle_config.json, eagle_vocab.json, model.safetensors).
    out: str = "runs/eagle"
    # Passes over the training split.
    epochs: int = 4
    # Peak AdamW learning rate (linear warm-up, cosine decay); 1e-3 trained the shipped drafter.
    lr: float = 1e-3
    # Amplitude a of the uniform noise U(-a, a) added to input features in training (EAGLE's augmentation:
    # the drafter must cope with its own imperfect features at depth >= 2).
    noise: float = 0.1
    # Weight of the feature regression loss (SmoothL1 between predicted and real next feature).
    feature_weight: float = 1.0
    # Weight of the token loss (cross-entropy of the draft distribution against the target's, both through
    # the target's LM-head rows). EAGLE-1 uses 0.1; 1.0 (with one self-fed step of weight 0.5) measured better
    # held-out top-1 on SmolLM2-135M (the shipped drafter's card).
    token_weight: float = 1.0
    # Self-fed steps after the teacher-forced one (EAGLE-3's training-time test): step s reads the drafter's
    # own predicted features from step s-1, as draft-tree level s does. 0 = EAGLE-1 (teacher-forced only);
    # each step costs about one more forward/backward per batch.
    self_fed_steps: int = 1
    # Weight of each self-fed step's losses (relative to the teacher-forced step's).
    self_fed_weight: float = 0.5
    # Start the decoder layer and norm as copies of the target's last layer and final norm (default: a fresh
    # layer, as EAGLE; the target's last layer expects its residual stream, not features + embeddings).
    init_from_last_layer: bool = False
    # EAGLE-3's multi-layer features: target layers (hidden-state indices: 0 = embeddings, i = the output of
    # decoder layer i) whose outputs are fused into the drafter's input feature wherever the target's hidden
    # states are known, e.g. [2, 15, 27] for a 30-layer target (the shipped drafter's). [] = EAGLE-1's
    # last-layer feature only. Their hidden states are cached next to the features in a file of its own
    # (len(fuse_layers) + 1 times the plain feature cache's size).
    fuse_layers: list[int] = field(default_factory=list)
    # Also train on the positions inside the prompt (the target's next feature and distribution there, on the
    # user's text), not only on the response's. Held-out metrics count response positions either way. On a
    # 172k-token subset it raised held-out top-1 at draft levels 1-3 and accepted length (docs/eagle.md).
    prompt_positions: bool = True
    # Start from a saved drafter (a folder this trainer wrote, e.g. specframe/artifacts/eagle-smollm2-135m-instruct)
    # instead of fresh weights: its weights, vocabulary and fused layers (train.fuse_layers must match them;
    # train.vocab_size is not used). "" = a fresh drafter.
    init_from: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length < 3:
            raise ConfigError(f"train.max_length must be >= 3, got {self.max_length}")
        for key in ("noise", "feature_weight", "token_weight", "self_fed_weight"):
            if not (getattr(self, key) >= 0 and math.isfinite(getattr(self, key))):
                raise ConfigError(f"train.{key} must be a finite number >= 0, got {getattr(self, key)}")
        if not is_count(self.self_fed_steps, minimum=0) or self.self_fed_steps > self.max_length - 2:
            raise ConfigError(
                f"train.self_fed_steps must be an integer from 0 to max_length - 2 = {self.max_length - 2}, "
                f"got {self.self_fed_steps!r}"
            )
        if self.self_fed_steps and self.self_fed_weight == 0:
            raise ConfigError("train.self_fed_weight is 0 with self_fed_steps > 0: set self_fed_steps=0 to train none")
        if self.feature_weight == 0 and self.token_weight == 0:
            raise ConfigError("train.feature_weight and train.token_weight cannot both be 0")
        if not isinstance(self.fuse_layers, list | tuple):
            raise ConfigError(f"train.fuse_layers must be a list of target layers, got {self.fuse_layers!r}")
        self.fuse_layers = list(self.fuse_layers)
        if self.init_from and self.init_from_last_layer:
            raise ConfigError("train.init_from and train.init_from_last_layer both choose the start: set one")


def collate_features(
    batch, prompt_positions: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(features [B, T, H] float32, ids [B, T], loss [B, T-1], extra layers [B, T, n*H] float32 or None):
    loss[b, j] = the output at input position j (predicting f_{j+1}) counts, i.e. f_{j+1} lies inside the
    sequence and predicts a response token (with `prompt_positions`: any token)."""
    width = max(s.ids.numel() for s in batch)
    hidden = batch[0].features.shape[1]
    feats = torch.zeros(len(batch), width, hidden)
    extra = None if batch[0].extra is None else torch.zeros(len(batch), width, batch[0].extra.shape[1])
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    loss = torch.zeros(len(batch), width - 1, dtype=torch.bool)
    for i, s in enumerate(batch):
        n = s.ids.numel()
        feats[i, :n] = s.features.float()
        if extra is not None:
            extra[i, :n] = s.extra.float()
        ids[i, :n] = s.ids
        loss[i, 0 if prompt_positions else max(0, s.first_target - 2) : n - 1] = True
    return feats, ids, loss, extra


def level_masks(loss: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """Counted outputs of passes 1..levels from `collate_features`' `loss` [B, T-1]: entry s-1 is [B, T-s],
    true where pass s's prediction (of f_{i+s}) and its chain's start are both counted by `loss`, i.e. predict
    response tokens. (The first, input P-2 with P = first_target, predicts the first response token, which
    decoding never drafts: the target emits it at prefill. So the held-out metrics count one chain per
    sequence and level that decoding does not draft, under 1% of positions on the distilled data.)"""
    width = loss.shape[1]
    return [loss[:, s:] & loss[:, : width - s] for s in range(levels)]  # (s = 0: `loss` itself)


def self_fed_mask(n: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, n-step+1, keys] mask of self-fed pass `step` (>= 2) over n real pairs: query i (the
    pair at position i+step-1) sees the real pairs at positions 0..i, then its own chain of self-fed pairs,
    entry i of each pass 2..step (the cache holds n real pairs, then n-1, n-2, ... pairs of passes 2, 3, ...),
    as a draft-tree node sees the committed pairs and its ancestors."""
    rows = n - step + 1
    sizes = [n - k + 1 for k in range(1, step + 1)]  # pairs of passes 1..step in the cache
    allowed = torch.zeros(rows, sum(sizes), dtype=torch.bool)
    allowed[:, :n] = torch.ones(rows, n, dtype=torch.bool).tril()
    i = torch.arange(rows)
    for offset in torch.tensor(sizes).cumsum(0)[:-1].tolist():
        allowed[i, offset + i] = True
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def drafter_passes(drafter, feats, ids, noise: float = 0.0, self_fed: int = 0, generator=None, extra=None):
    """Predicted features of the teacher-forced pass and of `self_fed` self-fed passes: a list whose entry s-1
    is pass s, [B, T-s, H]. Pass 1's input j is the pair (f_j, t_{j+1}) at position j (f_j fused with the
    `extra` layers for a fusing drafter); pass s's input i is (f̂_{i+s-1} of pass s-1, t_{i+s}) at position
    i+s-1. Passes stop early when the sequences are too short for the next."""
    from transformers import DynamicCache

    b, t, _ = feats.shape
    device = drafter.fc.weight.device
    inp = feats[:, :-1].to(device)
    if drafter.fuse_layers:
        inp = drafter.fused(inp, extra[:, :-1].to(device))
    if noise > 0:
        inp = inp + (torch.rand(inp.shape, generator=generator) * 2 - 1).to(device) * noise
    with torch.no_grad():
        emb = drafter.embed(ids.to(drafter.embed.weight.device)).to(device=device, dtype=torch.float32)
    pos = torch.arange(t - 1, device=device)[None].expand(b, -1)
    steps = min(self_fed, t - 2)  # pass s needs t - s >= 1 inputs
    cache = DynamicCache(config=drafter.config) if steps > 0 else None
    outs = [drafter(inp, None, pos, None, cache, embeds=emb[:, 1:])]
    for s in range(2, steps + 2):
        mask = self_fed_mask(t - 1, s, outs[-1].dtype).to(device)
        outs.append(drafter(outs[-1][:, :-1].detach(), None, pos[:, s - 1 :], mask, cache, embeds=emb[:, s:]))
    return outs


EVAL_LEVELS = 3  # draft levels evaluated held-out: teacher-forced, then two self-fed steps
LEVEL_KEYS = tuple("top1" if s == 0 else f"top1_step{s + 1}" for s in range(EVAL_LEVELS))  # their metric names


@torch.no_grad()
def evaluate(
    drafter, full_head: torch.Tensor, vocab_ids: torch.Tensor, seqs, batch_size: int = 8, memo: dict | None = None
) -> dict:
    """Held-out top-1 agreement with the target's next token (argmax over its full vocabulary) at draft levels
    1..EVAL_LEVELS (level s: the drafter fed its own predicted features for s-1 steps) and the level-1 feature
    error. `memo` keeps the target's argmaxes between calls."""
    drafter.eval()
    memo = {} if memo is None else memo
    hits, counts = [0] * EVAL_LEVELS, [0] * EVAL_LEVELS
    l1 = 0.0
    vocab_ids = vocab_ids.to(full_head.device)
    for i in range(0, len(seqs), batch_size):
        feats, ids, loss, extra = collate_features(seqs[i : i + batch_size])
        outs = drafter_passes(drafter, feats, ids, self_fed=EVAL_LEVELS - 1, extra=extra)
        feats, loss = feats.to(outs[0].device), loss.to(outs[0].device)
        masks = level_masks(loss, len(outs))  # level s+1 predicts f_{j+s+1} from input j
        if i not in memo:  # the target's next token at each counted position, per level
            memo[i] = [(feats[:, s + 1 :][m] @ full_head.T).argmax(-1) for s, m in enumerate(masks)]
        for s, (out, m, want) in enumerate(zip(outs, masks, memo[i], strict=True)):
            hits[s] += int((vocab_ids[drafter.logits(out[m]).argmax(-1)] == want).sum())
            counts[s] += int(m.sum())
        l1 += float((outs[0][masks[0]] - feats[:, 1:][masks[0]]).abs().mean(-1).sum())
    # (None: no held-out sequence is long enough for that level)
    levels = {key: hits[s] / counts[s] if counts[s] else None for s, key in enumerate(LEVEL_KEYS)}
    return {**levels, "feature_l1": l1 / max(1, counts[0]), "positions": counts[0]}


def describe(metrics: dict) -> str:
    """The held-out metrics as one log phrase."""
    shown = " / ".join("n/a" if metrics.get(key) is None else f"{metrics[key]:.3f}" for key in LEVEL_KEYS)
    return f"held-out top-1 at draft levels 1-{EVAL_LEVELS} {shown}, feature L1 {metrics['feature_l1']:.3f}"


def losses(drafter, out: torch.Tensor, real: torch.Tensor, mask: torch.Tensor):
    """(feature SmoothL1, token cross-entropy) at the masked positions."""
    pred, real = out[mask], real.to(out.device)[mask]
    feat = torch.nn.functional.smooth_l1_loss(pred, real)
    with torch.no_grad():
        p = drafter.logits(real).softmax(-1)
    tok = -(p * drafter.logits(pred).log_softmax(-1)).sum(-1).mean()
    return feat, tok


def initial_drafter(cfg: EagleTrainConfig, target) -> tuple[torch.nn.Module, torch.Tensor]:
    """(trainable float32 drafter, vocab_ids) loaded from `cfg.init_from`, whose fused layers must be
    `cfg.fuse_layers`."""
    from specframe.errors import ModelLoadError
    from specframe.proposers.eagle import load_drafter

    try:  # (its errors name train.init_from or the folder given there)
        drafter, vocab_ids, _ = load_drafter(cfg.init_from, target, torch.float32, option="train.init_from")
    except ModelLoadError as e:
        raise ConfigError(str(e)) from e
    if list(drafter.fuse_layers) != cfg.fuse_layers:
        raise ConfigError(
            f"train.fuse_layers {cfg.fuse_layers} differs from {list(drafter.fuse_layers)} of the drafter in "
            f"train.init_from '{cfg.init_from}': train with the same layers"
        )
    return drafter.requires_grad_(True).train(), vocab_ids  # (its parameters are its own weights only)


@only_run_in_out
def train_eagle(cfg: EagleTrainConfig, target, tokenizer, resume: bool = False, log=print) -> dict:
    """Train and save an EAGLE drafter for `target` (a float32 model); returns the held-out metrics."""

    from specframe.proposers.eagle import build_drafter, save_drafter
    from specframe.training.common import (
        NO_MEASURED_SHAPE,
        checkpoint_state,
        recovered,
        resume_from,
        resuming_from,
        run_epochs,
        run_identity,
        start_run,
    )
    from specframe.training.features import check_extra_layers, split_features

    out = Path(cfg.out)
    check_extra_layers(cfg.fuse_layers, target.config.num_hidden_layers, "train.fuse_layers")
    train_ex, held_ex, vocab_ids = start_run(cfg, target, tokenizer, log)
    if cfg.init_from:  # (loaded and checked before the features are extracted)
        drafter, vocab_ids = initial_drafter(cfg, target)
    ckpt = recovered(out / "checkpoint")  # (its layers checked before the features are extracted too)
    if resume and (ckpt / "state.json").is_file():
        state = checkpoint_state(ckpt)
        saved = state.get("fuse_layers", [])
        trained_steps = state.get("self_fed_steps", 1)  # (checkpoints from before it was recorded: 1)
        if trained_steps != cfg.self_fed_steps:  # allowed (a curriculum), but said
            log(f"resuming with self_fed_steps {cfg.self_fed_steps}; the checkpoint trained with {trained_steps}")
        if saved != cfg.fuse_layers:
            raise ConfigError(
                f"train.fuse_layers {cfg.fuse_layers} differs from {saved} of the checkpoint in {ckpt}: resume "
                "with the same layers, or train into a new out folder"
            )
    if not cfg.init_from:
        drafter = build_drafter(target, vocab_ids, cfg.init_from_last_layer, tuple(cfg.fuse_layers))
    params = dict(drafter.named_parameters())
    run = run_identity(cfg, train_ex, held_ex, vocab_ids, target_fingerprint(target))
    resuming = resuming_from(ckpt, params, resume, run, cfg.epochs)  # (refused before the features)
    full_head = target.get_output_embeddings().weight.detach().float()
    vocab_size = full_head.shape[0]
    train_feats, held_feats = split_features(cfg, target, train_ex, held_ex, tuple(cfg.fuse_layers))
    train_seqs = [s for s in train_feats if len(s.ids) > 2]
    held_seqs = [s for s in held_feats if len(s.ids) > 2]
    if not train_seqs or not held_seqs:
        raise ConfigError(f"train.data '{cfg.data}' has no sequence longer than 2 tokens in a split")
    in_vocab = torch.zeros(vocab_size, dtype=torch.bool)
    in_vocab[vocab_ids.cpu()] = True  # (the ids of a drafter loaded by init_from are on the target's device)
    held_resp = torch.cat([s.ids[s.first_target :] for s in held_seqs])
    coverage = float(in_vocab[held_resp].float().mean()) if held_resp.numel() else 0.0
    tokens = sum(s.ids.numel() for s in train_seqs)
    log(
        f"eagle: drafter {sum(p.numel() for p in params.values()):,} parameters"
        f"{' from the target last layer' if cfg.init_from_last_layer else ''}"
        f"{f' from {cfg.init_from}' if cfg.init_from else ''}"
        f"{f', fusing target layers {cfg.fuse_layers}' if cfg.fuse_layers else ''}, vocabulary {len(vocab_ids)} "
        f"(covers {coverage:.1%} of held-out response tokens); {len(train_seqs)} train ({tokens} tokens) / "
        f"{len(held_seqs)} held-out sequences"
    )

    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=0.0)
    order_by_len = sorted(range(len(train_seqs)), key=lambda i: train_seqs[i].ids.numel())
    batches = [order_by_len[i : i + cfg.batch_size] for i in range(0, len(order_by_len), cfg.batch_size)]
    extra = {"fuse_layers": cfg.fuse_layers, "self_fed_steps": cfg.self_fed_steps}
    checkpoints = resume_from(ckpt, params, optimizer, cfg, resuming=resuming, run=run, log=log, extra=extra)
    history = checkpoints.history
    checkpoints.make_schedule(len(batches), cfg.epochs)
    memo: dict = {}

    def batch_loss(b: int, gen: torch.Generator) -> torch.Tensor | None:
        feats, ids, mask, extra = collate_features([train_seqs[i] for i in batches[b]], cfg.prompt_positions)
        if not bool(mask.any()):
            return None
        outs = drafter_passes(drafter, feats, ids, cfg.noise, cfg.self_fed_steps, gen, extra)
        mask = mask.to(outs[0].device)
        loss = 0.0
        for s, (predicted, counted) in enumerate(zip(outs, level_masks(mask, len(outs)), strict=True)):
            if bool(counted.any()):  # pass s+1 predicts f_{j+s+1}
                feat_loss, token_loss = losses(drafter, predicted, feats[:, s + 1 :], counted)
                loss = loss + (1.0 if s == 0 else cfg.self_fed_weight) * (
                    cfg.feature_weight * feat_loss + cfg.token_weight * token_loss
                )
        return loss

    run_epochs(  # (`gen` draws the feature noise after the epoch's order)
        cfg,
        checkpoints,
        (drafter,),
        lambda gen: torch.randperm(len(batches), generator=gen).tolist(),
        batch_loss,
        lambda: evaluate(drafter, full_head, vocab_ids, held_seqs, memo=memo),
        describe,
        log,
        draws=True,
    )
    final = {
        "heldout": history[-1],
        "history": history,
        "vocab_coverage": coverage,
        "train_sequences": len(train_seqs),
        "train_tokens": tokens,
        "heldout_sequences": len(held_seqs),
    }
    # On a CPU the drafter drafts the 1-3 node shape timed fastest at load from these held-out levels (a
    # GPU-sized tree there runs slower than plain decoding); on a GPU, the device's default tree.
    measured = all(is_number(final["heldout"].get(k)) for k in LEVEL_KEYS)
    save_drafter(
        drafter.eval(),
        vocab_ids,
        target,
        out,
        final,
        extra={
            "train_config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            **({"shape_choice": "measured"} if measured else {}),
        },
    )
    if not measured:
        keys = "proposer.depth, proposer.top_k and proposer.total_tokens"
        log(NO_MEASURED_SHAPE.format(what="per-level top-1", keys=keys))
    log(f"saved to {cfg.out}")
    return final
