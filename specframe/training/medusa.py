"""`specframe train --proposer medusa`: Medusa heads on self-distillation data.

Stage 1 (Medusa-1): the target is frozen. Its features over the data are computed once (cached, see
`specframe.training.features`), and the heads learn with cross-entropy: at the position whose feature produced
response token t+1 (the root at decode time), head k predicts token t+1+k. Head k (from 1) is weighted
`head_decay**(k-1)`.

Stage 2 (Medusa-2): heads plus a LoRA adapter on the target (PEFT), trained together. The adapted target must
keep its own outputs, so the loss adds KL(p_original || p_adapted) over the full vocabulary at every response
position. The verified model is then the *adapted* one: generation must load the adapter
(`target.adapter=<out>/adapter`), and exactness holds with respect to that model, not the original.

Reported on held-out prompts (a fixed split by prompt id): each head's top-1 and top-5 accuracy, and *path
statistics*: for every tree path (r1, ..., rd), how many positions had the true tokens at exactly those ranks
of heads 1..d. Greedy verification accepts a node exactly when its path matches, so the expected accepted
length of a tree is 1 + sum over its nodes of count / positions; `best_tree` picks the nodes with the highest
counts (an ancestor-closed set). The tree saved with the heads is chosen this way, on held-out training
prompts, never on a benchmark.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from specframe.errors import ConfigError, ModelLoadError
from specframe.fingerprint import ADAPTER_KEY, begin_artifact, mark_adapter, readable, target_fingerprint
from specframe.training.common import (
    NO_MEASURED_SHAPE,
    TrainRunConfig,
    forward_kl,
    on_device,
    only_run_in_out,
    recovered,
    resume_from,
    resuming_from,
    run_epochs,
    run_identity,
    start_run,
)

PATH_RANKS = 10  # ranks per head considered in the path statistics


@dataclass
class MedusaTrainConfig(TrainRunConfig):
    artifact = "medusa"

    # Output folder for the heads (medusa_config.json, medusa_vocab.json, model.safetensors; adapter/ in stage 2).
    out: str = "runs/medusa"
    # Passes over the training split.
    epochs: int = 2
    # Peak AdamW learning rate (linear warm-up, cosine decay).
    lr: float = 1e-3
    # Stage 1: positions per optimisation step. Stage 2: sequences per step (each a whole prompt and response
    # through the target twice). 0 = the stage's default: 512 positions, or 8 sequences as the other trainers.
    batch_size: int = 0
    # 1 = Medusa-1 (frozen target, heads only); 2 = Medusa-2 (heads + LoRA on the target through PEFT).
    stage: int = 1
    # Number of heads K: head k predicts the token k positions after the root.
    num_heads: int = 4
    # Residual blocks per head.
    layers: int = 1
    # Loss weight of head k is head_decay ** (k - 1).
    head_decay: float = 0.8
    # Nodes in the saved tree (chosen from held-out path statistics).
    tree_nodes: int = 16
    # Stage 2: LoRA rank, and the target modules it adapts.
    lora_rank: int = 8
    lora_modules: tuple[str, ...] = ("q_proj", "v_proj")
    # Stage 2: weight of KL(p_original || p_adapted), which keeps the adapted target's outputs.
    keep_weight: float = 1.0
    # Start from these trained heads (a folder; their vocabulary too): in stage 1 to train them further, e.g.
    # on new data; in stage 2 to add the adapter to trained stage-1 heads. None = fresh heads.
    init_heads: str | None = None
    # Also train at the positions inside the prompt (heads predicting the user's next tokens from the target's
    # features there), not only where the root is a response token. Held-out metrics and the saved tree count
    # response positions either way. Off: on a 766-prompt subset it raised heads 2-3 a little, not head 1
    # (all a one-node tree uses), and doubled the epoch time (docs/medusa.md).
    prompt_positions: bool = False

    def __post_init__(self) -> None:
        if self.batch_size == 0:  # (an integer or not: the base class checks which)
            self.batch_size = 512 if self.stage == 1 else 8
        super().__post_init__()
        for key in ("num_heads", "layers", "tree_nodes", "lora_rank"):
            value = getattr(self, key)
            if value < 1:  # (an integer: checked first)
                raise ConfigError(f"train.{key} must be >= 1, got {value}")
        if self.stage not in (1, 2):
            raise ConfigError(f"train.stage must be 1 (Medusa-1) or 2 (Medusa-2), got {self.stage}")
        if not 0 < self.head_decay <= 1:
            raise ConfigError(f"train.head_decay must be in (0, 1], got {self.head_decay}")
        if not (self.keep_weight >= 0 and math.isfinite(self.keep_weight)):
            raise ConfigError(f"train.keep_weight must be a finite number >= 0, got {self.keep_weight}")
        if not self.lora_modules or not all(isinstance(m, str) and m for m in self.lora_modules):
            raise ConfigError(f"train.lora_modules must name at least one module, got {list(self.lora_modules)}")


# ---------------------------------------------------------------------------------------------- trees


def best_tree(path_counts: dict, nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` paths with the highest held-out counts (ties: shallower, then lower ranks): ancestor-closed,
    because a path never counts more than its parent."""
    counts = path_counts["counts"]
    paths = sorted((tuple(int(r) for r in k.split(",")) for k in counts), key=lambda p: (-counts[key(p)], len(p), p))
    chosen = paths[:nodes]
    if not chosen:
        raise ConfigError(
            "the path statistics are empty: no held-out position has a head-1 label in the heads' vocabulary to "
            "choose a tree from (too few held-out prompts, or too small a train.vocab_size)"
        )
    return sorted(chosen, key=lambda p: (len(p), p))


def chosen_tree(metrics: dict, nodes: int) -> list[tuple[int, ...]] | None:
    """`best_tree` of held-out metrics, or None when they hold no path statistics (the heads are then saved
    without a tree, and use the default one)."""
    return best_tree(metrics["path_counts"], nodes) if metrics["path_counts"]["counts"] else None


def key(path: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in path)


def expected_accepted_length(path_counts: dict, tree: list[tuple[int, ...]]) -> float:
    """1 + sum over the tree's nodes of P(the node's path matches), on the data the counts came from."""
    n = max(1, path_counts["positions"])
    return 1 + sum(path_counts["counts"].get(key(p), 0) for p in tree) / n


# ---------------------------------------------------------------------------------------------- data


def vocab_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target id -> column in the reduced vocabulary, or -100 (ignored by the loss) when outside it."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index


def head_labels(
    ids: torch.Tensor, first_target: int, num_heads: int, prompt_positions: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [N], labels [N, K]): position t produced response token t+1 (with `prompt_positions`, any
    token t+1, prompt positions included); head k's label is token t+1+k."""
    n = ids.numel()
    pos = torch.arange(0 if prompt_positions else max(0, first_target - 1), n - 1)
    labels = torch.full((pos.numel(), num_heads), -1, dtype=torch.long)
    for k in range(1, num_heads + 1):
        at = pos + 1 + k
        ok = at < n
        labels[ok, k - 1] = ids[at[ok]]
    return pos, labels


def stack_features(seqs, num_heads: int, prompt_positions: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """All (feature, labels) pairs of a list of FeatureSequence: [N, H] bfloat16 and [N, K] target ids (-1 = none).
    Positions whose next token is a response token; with `prompt_positions`, every position but the last."""
    xs, ys = [], []
    for s in seqs:
        pos, labels = head_labels(s.ids, s.first_target, num_heads, prompt_positions)
        xs.append(s.features[pos])
        ys.append(labels)
    return torch.cat(xs), torch.cat(ys)


# ---------------------------------------------------------------------------------------------- metrics


@torch.no_grad()
def evaluate(heads, lm_rows: torch.Tensor, vocab_ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per-head top-1/top-5 accuracy (over every labelled position) and the path statistics."""
    k_heads = heads.num_heads
    top1, top5, total = [0] * k_heads, [0] * k_heads, [0] * k_heads
    counts: Counter[str] = Counter()
    positions = 0
    for i in range(0, x.shape[0], 1024):
        xb = x[i : i + 1024].to(lm_rows.device, lm_rows.dtype)
        yb = y[i : i + 1024].to(lm_rows.device)
        ranks = heads.logits(xb, lm_rows).topk(min(PATH_RANKS, len(vocab_ids)), dim=-1).indices  # [K, B, R]
        cand = vocab_ids[ranks]  # target ids
        hit = cand == yb.T[:, :, None]  # [K, B, R]
        for k in range(k_heads):
            valid = yb[:, k] >= 0
            total[k] += int(valid.sum())
            top1[k] += int(hit[k, :, 0][valid].sum())
            top5[k] += int(hit[k, :, :5].any(-1)[valid].sum())
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(hit[..., 0], -1, dtype=torch.long))
        for row in rank.T.tolist():  # per position: the rank of the true token under each head, -1 = missed
            positions += 1
            path: list[int] = []
            for r in row:
                if r < 0:
                    break
                path.append(r)
                counts[key(tuple(path))] += 1
    return {
        "top1": [a / max(1, t) for a, t in zip(top1, total, strict=True)],
        "top5": [a / max(1, t) for a, t in zip(top5, total, strict=True)],
        "positions": positions,
        "path_counts": {"positions": positions, "counts": dict(counts.most_common(2000))},
    }


def summary(metrics: dict, tree: list[tuple[int, ...]] | None) -> str:
    accs = ", ".join(
        f"head {k + 1} {a:.3f}/{b:.3f}" for k, (a, b) in enumerate(zip(metrics["top1"], metrics["top5"], strict=True))
    )
    if tree is None:
        return f"held-out top-1/top-5: {accs}; no held-out path statistics to choose a tree from"
    return (
        f"held-out top-1/top-5: {accs}; tree of {len(tree)} nodes: expected accepted length "
        f"{expected_accepted_length(metrics['path_counts'], tree):.2f}"
    )


# ---------------------------------------------------------------------------------------------- training


@only_run_in_out
def train_medusa(cfg: MedusaTrainConfig, target, tokenizer, resume: bool = False, log=print) -> dict:
    """Train and save Medusa heads for `target` (a float32 model); returns the held-out metrics."""
    from specframe.proposers.medusa import MedusaHeads, load_heads, save_heads

    train_ex, held_ex, vocab_ids = start_run(cfg, target, tokenizer, log)
    vocab = target.get_output_embeddings().weight.shape[0]
    index = vocab_index(vocab_ids, vocab)
    hidden = target.config.hidden_size
    if cfg.init_heads:  # (loaded and checked before the features are extracted)
        try:
            heads, vocab_ids, _ = load_heads(cfg.init_heads, target)
        except ModelLoadError as e:
            raise ConfigError(f"train.init_heads: {e}") from e
        if heads.projection is not None:  # (specframe's heads share the target's LM head; these have their own)
            raise ConfigError(
                f"train.init_heads '{cfg.init_heads}' holds heads from the Medusa repository, each with its own "
                "projection onto the vocabulary; specframe trains heads that share the target's LM head and cannot "
                "start from them (use them as they are: proposer.model=<folder>)"
            )
        index = vocab_index(vocab_ids, vocab)
        if heads.num_heads != cfg.num_heads or len(heads.heads[0]) != cfg.layers:
            raise ConfigError(
                f"train.init_heads '{cfg.init_heads}' has {heads.num_heads} heads of "
                f"{len(heads.heads[0])} blocks; the config asks for {cfg.num_heads} of {cfg.layers}"
            )
    else:
        heads = MedusaHeads(hidden, cfg.num_heads, cfg.layers)
    heads.to(target.device)  # (features and batches are built on the CPU and moved per batch)
    vocab_ids, index = vocab_ids.to(target.device), index.to(target.device)
    log(
        f"medusa stage {cfg.stage}: {cfg.num_heads} heads x {cfg.layers} blocks, vocabulary {len(vocab_ids)}; "
        f"{len(train_ex)} train / {len(held_ex)} held-out sequences (responses)"
    )
    run = _train_stage1 if cfg.stage == 1 else _train_stage2
    final, tree, model_for_fingerprint, extra = run(
        cfg, target, heads, vocab_ids, index, train_ex, held_ex, resume, log
    )
    extra = {"train_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()}, **extra}
    if final["heldout"]["path_counts"]["counts"]:  # (on a CPU: the 1-3 node tree timed fastest at load)
        extra["shape_choice"] = "measured"
    else:
        log(NO_MEASURED_SHAPE.format(what="path", keys="proposer.tree"))
    save_heads(
        heads,
        vocab_ids,
        model_for_fingerprint,
        cfg.out,
        tree,
        {"path_counts": final["heldout"]["path_counts"], "metrics": _without_counts(final), **extra},
    )
    log(f"saved to {cfg.out}")
    return _without_counts(final)  # the path statistics live in the saved medusa_config.json


def _without_counts(final: dict) -> dict:
    strip = lambda m: {k: v for k, v in m.items() if k != "path_counts"}  # noqa: E731
    return {**final, "heldout": strip(final["heldout"]), "history": [strip(h) for h in final["history"]]}


def label_columns(labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Target-id labels (-1 = none) as columns of the reduced vocabulary, -100 (ignored) when none or outside it."""
    return torch.where(labels >= 0, index[labels.clamp(min=0)], torch.full_like(labels, -100))


def _heads_loss(logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, decay: float) -> torch.Tensor | None:
    """Weighted cross-entropy over heads; logits [K, N, Vr], labels [N, K] target ids (-1 = none). None when no
    head has a label in the reduced vocabulary here (a batch of a response's last positions, say): nothing to
    learn from, and no gradient to step with."""
    cols = label_columns(labels, index)
    loss = None
    for k in range(logits.shape[0]):
        if bool((cols[:, k] >= 0).any()):
            ce = decay**k * torch.nn.functional.cross_entropy(logits[k].float(), cols[:, k], ignore_index=-100)
            loss = ce if loss is None else loss + ce
    return loss


def _train_stage1(cfg, target, heads, vocab_ids, index, train_ex, held_ex, resume, log):
    from specframe.training.features import split_features

    params = dict(heads.named_parameters())
    ckpt = recovered(Path(cfg.out) / "checkpoint")
    run = run_identity(cfg, train_ex, held_ex, vocab_ids, target_fingerprint(target))
    resuming = resuming_from(ckpt, params, resume, run, cfg.epochs)  # (refused before the features)
    train_feats, held_feats = split_features(cfg, target, train_ex, held_ex)
    x_train, y_train = stack_features(train_feats, cfg.num_heads, cfg.prompt_positions)
    x_held, y_held = stack_features(held_feats, cfg.num_heads)
    log(f"{x_train.shape[0]} training positions, {x_held.shape[0]} held-out")
    if not bool((label_columns(y_train, index.cpu()) >= 0).any()):
        raise ConfigError("no training position has a label in the heads' vocabulary: nothing to train on")
    lm_rows = target.get_output_embeddings().weight.detach()[vocab_ids].float()
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=0.0)
    steps = math.ceil(x_train.shape[0] / cfg.batch_size)
    checkpoints = resume_from(ckpt, params, optimizer, cfg, resuming=resuming, run=run, log=log)
    checkpoints.make_schedule(steps, cfg.epochs)

    def batch_loss(idx: torch.Tensor, _gen) -> torch.Tensor | None:  # (None: no label in this batch, skipped)
        logits = heads.logits(x_train[idx].to(lm_rows.device).float(), lm_rows)
        return _heads_loss(logits, y_train[idx].to(lm_rows.device), index, cfg.head_decay)

    history = run_epochs(  # (each step's items: `batch_size` positions of the epoch's permutation of them all)
        cfg,
        checkpoints,
        (heads,),
        lambda gen: list(torch.randperm(x_train.shape[0], generator=gen).split(cfg.batch_size)),
        batch_loss,
        lambda: evaluate(heads.eval(), lm_rows, vocab_ids, x_held, y_held),
        lambda m: summary(m, chosen_tree(m, cfg.tree_nodes)),
        log,
        decay=0.98,
        unit="step",
        postfix_every=20,
    )
    final, tree = _final(history, cfg, x_train.shape[0], x_held.shape[0])
    return final, tree, target, {"adapter": None}


def _final(history: list, cfg, n_train: int, n_held: int) -> tuple[dict, list[tuple[int, ...]] | None]:
    """The run's metrics, and the tree of `cfg.tree_nodes` nodes chosen from the last held-out statistics (None
    when they are empty)."""
    last = history[-1]
    tree = chosen_tree(last, cfg.tree_nodes)
    return {
        "heldout": {
            **last,
            "tree_nodes": len(tree) if tree else 0,
            "expected_accepted_length": expected_accepted_length(last["path_counts"], tree) if tree else None,
        },
        "history": history,
        "train_positions": n_train,
        "heldout_positions": n_held,
    }, tree


def _train_stage2(cfg, target, heads, vocab_ids, index, train_ex, held_ex, resume, log):
    """Medusa-2: heads + LoRA trained together; KL to the original target keeps its outputs. The adapter is merged
    into `target` when training ends (the model generation verifies with); a run refused, failed or stopped leaves
    `target` as it was given."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0, target_modules=list(cfg.lora_modules)
    )
    target.requires_grad_(False)
    base_fingerprint = target_fingerprint(target)  # (before PEFT wraps its modules)
    if ADAPTER_KEY in base_fingerprint:  # (generate merges one adapter: the target's or these heads', not both)
        raise ConfigError(
            "medusa stage 2 trains its own PEFT adapter, and this target already has one merged (--adapter / "
            "target.adapter): train stage 2 on the base target, or stage 1 on this one"
        )
    from specframe.models import tied_embedding_names

    tied = tied_embedding_names(target)
    shared = [m for m in cfg.lora_modules if any(name == m or name.endswith(f".{m}") for name in tied)]
    if shared:  # (merged into the one weight they share, a LoRA on either would change both)
        raise ConfigError(
            f"train.lora_modules names {shared[0]!r}, which shares its weight with the target's "
            f"{'output' if 'embed' in shared[0] else 'input'} embeddings (tie_word_embeddings): merged into that one "
            "weight when training ends, the adapter would change both, unlike the model it was trained as; leave it out"
        )
    try:
        with warnings.catch_warnings():  # (PEFT reads a property transformers deprecated: not the user's to act on)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = get_peft_model(target, lora)
    except ValueError as e:  # (PEFT's words for modules the target does not have)
        raise ConfigError(f"train.lora_modules {list(cfg.lora_modules)}: {' '.join(str(e).split())}") from e
    try:
        final, tree, adapter_dir = _fit_stage2(
            model, cfg, target, heads, vocab_ids, index, train_ex, held_ex, base_fingerprint, resume, log
        )
    except BaseException:  # (refused, failed or stopped: the caller's target as it was given, without PEFT's layers)
        model.unload()
        raise
    merged = model.merge_and_unload()  # the model generation will verify with: the base plus this adapter
    mark_adapter(merged, base_fingerprint, adapter_dir)
    return final, tree, merged, {"adapter": str(adapter_dir.resolve())}


def _fit_stage2(model, cfg, target, heads, vocab_ids, index, train_ex, held_ex, base_fingerprint, resume, log):
    """Stage 2's training on `model` (the target with PEFT's LoRA layers in place) and the adapter saved: (the
    run's metrics, the tree, the adapter's folder)."""
    from specframe.training.common import collate, make_batches, to_sequences
    from specframe.training.features import extract_features

    base = model.get_base_model()
    lm_rows = target.get_output_embeddings().weight.detach()[vocab_ids].float()
    params = {f"heads.{k}": p for k, p in heads.named_parameters()}
    params.update({f"lora.{k}": p for k, p in model.named_parameters() if p.requires_grad})
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=0.0)
    seqs = to_sequences(train_ex, cfg.max_length)
    batches = make_batches(seqs, cfg.batch_size, cfg.seed)
    out = Path(cfg.out)
    ckpt = recovered(out / "checkpoint")
    run = run_identity(cfg, train_ex, held_ex, vocab_ids, base_fingerprint)
    resuming = resuming_from(ckpt, params, resume, run, cfg.epochs)
    checkpoints = resume_from(ckpt, params, optimizer, cfg, resuming=resuming, run=run, log=log)
    checkpoints.make_schedule(len(batches), cfg.epochs)

    def heldout() -> dict:
        model.eval()
        feats = extract_features(base, held_ex, cfg.max_length, dtype=base.dtype, quiet=True)
        x, y = stack_features(feats, cfg.num_heads)
        return evaluate(heads.eval(), lm_rows, vocab_ids, x, y)

    def batch_loss(b: int, _gen) -> tuple[torch.Tensor, dict]:
        ids, attn, mask = collate(batches[b], pad=0, prompt_positions=cfg.prompt_positions)
        labels = torch.cat(  # (from the batch on the CPU, then moved with it)
            [
                head_labels(ids[i, : int(attn[i].sum())], s.first_target, cfg.num_heads, cfg.prompt_positions)[1]
                for i, s in enumerate(batches[b])
            ]
        )
        ids, attn, mask, labels = on_device((ids, attn, mask, labels), lm_rows.device)
        with torch.no_grad(), model.disable_adapter():
            p_log = target(input_ids=ids, attention_mask=attn).logits[mask].float().log_softmax(-1)
        feat = base.model(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H] adapted
        keep = forward_kl(p_log, base.lm_head(feat[mask]).float().log_softmax(-1))
        heads_loss = _heads_loss(heads.logits(feat[mask], lm_rows), labels, index, cfg.head_decay)
        return cfg.keep_weight * keep + (0.0 if heads_loss is None else heads_loss), {"keep_kl": keep.detach()}

    history = run_epochs(
        cfg,
        checkpoints,
        (heads, model),
        lambda gen: torch.randperm(len(batches), generator=gen).tolist(),
        batch_loss,
        heldout,
        lambda m: summary(m, chosen_tree(m, cfg.tree_nodes)),
        log,
        means={"keep_kl": "KL to the original"},
        baseline=False,
    )
    # (the held-out size from the last evaluation's metrics: also when a resumed run had no epoch left to train)
    positions = sum(
        len(head_labels(torch.tensor(s.ids), s.first_target, cfg.num_heads, cfg.prompt_positions)[0]) for s in seqs
    )
    final, tree = _final(history, cfg, positions, history[-1]["positions"])  # (positions: as stage 1 counts them)
    adapter_dir = out / "adapter"
    begin_artifact(out, "medusa")  # (the adapter is part of the artifact: written after its config went)
    model.save_pretrained(str(adapter_dir))  # PEFT's own format (adapter_config.json + safetensors)
    for f in adapter_dir.iterdir():  # (its safetensors file is made owner-only)
        if f.is_file():
            readable(f)
    return final, tree, adapter_dir
