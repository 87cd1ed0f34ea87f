"""`eagle`: a one-layer drafter that extrapolates the target's own features (EAGLE-1 drafter, EAGLE-2 tree).

A *feature* f_j is the target's last hidden state after its final norm at position j (what its LM head
reads). The drafter reads, at position j, the pair (f_j, embedding of token j+1) and predicts f_{j+1}:

    x_j = fc([f_j ; E(t_{j+1})])          Linear(2H -> H)
    h_j = LlamaDecoderLayer(x_j)          one layer with its own KV cache, shaped like the target's layers
    f̂_{j+1} = RMSNorm(h_j)                (a copy of the target's final norm when trained with init_from_last_layer)
    draft logits = f̂_{j+1} @ W[vocab_ids].T   the target's own LM-head rows, on a reduced vocabulary

E and W are the target's embedding and LM head, shared at load time and never stored. A drafter with
`fuse_layers` (EAGLE-3's multi-layer features) replaces f_j, wherever the target's hidden states are known,
by f_j + fuse(normed outputs of those target layers) (`EagleDrafter.fused`). At runtime the
drafter's committed cache covers every position whose real feature and next token are known; drafted nodes
are fed with the drafter's own predicted features and cropped away after every proposal.

Proposals are EAGLE-2 dynamic trees: expand level by level, each frontier node proposing its `top_k` most
likely children, scored by the product of draft probabilities along the path; the `top_k` best new nodes
form the next frontier; at the end the best `total_tokens` nodes (a set closed under ancestors) are
verified. Every node is a deterministic choice (q one-hot), so the engine's acceptance rule keeps the
output distribution exactly the target's under greedy and sampled decoding alike.

Saved drafter (a folder, see docs/eagle.md):
    eagle_config.json   {"format": "specframe-eagle", "version": 1 or 2, "llama_config": {...}, "target": {...},
                         "fuse_layers": [...] (version 2 only), "metrics": {...}, "train_config": {...},
                         "tree_shape": {...} (optional), "shape_choice": "saved" or "measured" (optional:
                         "measured" = on a CPU, the shape of 1-3 draft nodes fastest on the machine,
                         `measured_candidates`, specframe/step_costs.py)}
    eagle_vocab.json    [token ids of the draft's output rows]
    model.safetensors   fc.weight, fc.bias, layer.*, norm.weight (float16); with fused layers (version 2,
                        "fuse_layers": [...] in eagle_config.json) also fuse.weight, fuse_norms.*
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specframe.cpu_kernels import fast_kernels_on, few_rows_linear, use_fast_cpu_kernels
from specframe.errors import ConfigError, ModelLoadError, brief, check_field_types, is_count, user_path
from specframe.lean_forward import forget_outdated_copies
from specframe.models import check_proposer_dtype, check_proposer_quantize, proposer_dtype, quantize_proposer
from specframe.proposer import (
    MAX_TREE_NODES,
    Acceptance,
    DecodeState,
    Proposal,
    Proposer,
    TargetInfo,
    check_confidence_threshold,
    resolve_confidence_threshold,
    rng_untouched,
    saved_shape_applies,
    seeded,
)
from specframe.step_costs import (
    CONTEXT,
    OnlineShapeChoice,
    ShapeCandidate,
    check_shape_choice,
    choose_measured,
    measure_step_costs,
    relative_cost,
)
from specframe.training.eagle import LEVEL_KEYS, EagleTrainConfig
from specframe.training.features import check_extra_layers

FORMAT = "specframe-eagle"
# Tree shape when neither the config nor the drafter's folder (`tree_shape` in eagle_config.json) gives one, on
# a CPU (where each verified token costs a little) and on a GPU (where ~60 cost what 1 does: EAGLE-2's shape).
DEFAULT_TREE_SHAPE = {"depth": 5, "top_k": 6, "total_tokens": 24}
ACCELERATOR_TREE_SHAPE = {"depth": 6, "top_k": 10, "total_tokens": 60}
SHAPE_KEYS = ("depth", "top_k", "total_tokens")  # the keys of a draft shape (config, saved tree_shape)
# The most candidates a tree may score while drafting one step: depth x k^2, k = min(top_k, vocabulary,
# total_tokens) nodes a frontier with k children each (the shapes above: 180 and 600). Each key is capped at
# MAX_TREE_NODES, but depth 1024 with top_k 1024 would score a billion candidates a step.
MAX_DRAFT_CANDIDATES = 65536

# Weight names the drafter stores (everything else is the target's or recomputed).
OWN_PREFIXES = ("fc.", "layer.", "norm.", "fuse.", "fuse_norms.")
# Target config keys the drafter's decoder layer copies (so it has the target's layer shape and rotary).
_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
)


@dataclass
class EagleConfig:
    # Trained drafter folder (from `specframe train --proposer eagle`); None = the one shipped for the target.
    model: str | None = None
    # Deepest draft level (tokens a step can gain beyond the target's own one). None (this and the next two):
    # the shape saved with the drafter (tuned on held-out training prompts), else 5 / 6 / 24; on a CPU, a drafter
    # saved with `"shape_choice": "measured"` drafts the shape timed fastest at load (`measured_candidates`).
    # Setting any of the three sets the whole shape: the others are then the device's defaults, not the saved ones.
    # Each at most MAX_TREE_NODES (1024), the config's and the saved shape's alike.
    depth: int | None = None
    # Tree mode: children proposed per frontier node, and frontier nodes kept per level.
    top_k: int | None = None
    # Tree mode: draft nodes sent to verification (the best by cumulative draft probability).
    total_tokens: int | None = None
    # True: EAGLE-2 dynamic tree; False: one greedy chain of `depth` tokens.
    tree: bool = True
    # Drop draft nodes whose cumulative draft probability (product along the path) is below this, and stop
    # expanding when no frontier node reaches it: the tree grows where the drafter is sure and shrinks (to its
    # best first token, always kept) where it is not; depth/top_k/total_tokens stay the caps. 0 = off.
    # None: the value saved with the drafter, else 0. Exactness does not depend on it.
    confidence_threshold: float | None = None
    # Drafter weights' dtype: auto (the target's, but bfloat16 for a float32 target on a CPU with native bf16
    # matmuls that does not run specframe's CPU kernels; exactness untouched; see
    # specframe.models.proposer_dtype), float32, bfloat16 or float16.
    dtype: str = "auto"
    # The drafter's own linear weights (fc, its layer, fuse) rounded at load to 8-bit blocks (GGUF Q8_0: each 32
    # weights of a row share one 16-bit scale), which specframe's CPU block kernel multiplies reading a quarter of
    # the bytes: auto (where the target runs specframe's CPU kernels and the weights are float32), none (as
    # saved) or q8_0. It changes which tokens are drafted slightly, never the output; see
    # specframe.models.quantize_proposer.
    quantize: str = "auto"
    # With a shape chosen at load from this CPU's timings (above), re-choose it every step from the acceptance
    # this generation has had so far, a plain step (no draft) included where drafts are seldom accepted
    # (specframe.step_costs.OnlineShapeChoice). false: the shape chosen at load, every step. Exact either way.
    adapt_shape: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "proposer.")
        for key in SHAPE_KEYS:
            value = getattr(self, key)
            if value is not None and not (is_count(value) and value <= MAX_TREE_NODES):
                raise ConfigError(f"proposer.{key} must be an integer in [1, {MAX_TREE_NODES}], got {value!r}")
        if not isinstance(self.tree, bool):
            raise ConfigError(f"proposer.tree must be true or false, got {self.tree!r}")
        unused = [k for k in ("top_k", "total_tokens") if not self.tree and getattr(self, k) is not None]
        if unused:  # (never quietly dropped)
            raise ConfigError(
                f"proposer.{unused[0]} shapes the tree: with proposer.tree=false the drafter proposes one greedy "
                "chain of proposer.depth tokens"
            )
        check_confidence_threshold(self.confidence_threshold)
        check_proposer_dtype(self.dtype)
        check_proposer_quantize(self.quantize)


# ---------------------------------------------------------------------------------------------- the drafter


def drafter_config(target_config, vocab_size: int) -> LlamaConfig:
    """The drafter's one-layer Llama config, shaped like the target's layers. Read through the config's own
    attribute names (GPT-2's `n_embd` is its `hidden_size`); what a non-Llama target lacks gets a Llama
    layer's usual choice (4x the hidden size for the MLP, heads as the target's attention has)."""
    keep = {k: v for k in _LAYER_KEYS if (v := getattr(target_config, k, None)) is not None}
    model_type = getattr(target_config, "model_type", "?")
    if not is_count(keep.get("hidden_size")):
        raise ModelLoadError(f"eagle: the '{model_type}' target's config gives no hidden size to shape a drafter by")
    if "intermediate_size" not in keep:
        keep["intermediate_size"] = getattr(target_config, "n_inner", None) or 4 * keep["hidden_size"]
    rope = keep.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):  # (Gemma 3: {layer type: its rope})
        keep["rope_parameters"] = rope["full_attention"]  # (the drafter's one layer attends to everything)
    rope_theta = getattr(target_config, "rope_theta", None)
    if "rope_parameters" not in keep and rope_theta is not None:
        keep["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    try:
        cfg = LlamaConfig(**keep, num_hidden_layers=1, vocab_size=vocab_size, tie_word_embeddings=False)
    except (TypeError, ValueError) as e:  # (huggingface_hub's strict dataclass errors are ValueErrors)
        raise ModelLoadError(
            f"eagle: cannot shape a one-layer Llama drafter like the '{model_type}' target's layers: {brief(e)}"
        ) from e
    cfg._attn_implementation = "sdpa"
    return cfg


class EagleDrafter(torch.nn.Module):
    """fc + one decoder layer + norm. The target's embedding and head rows are attached, not owned.

    With `fuse_layers` (EAGLE-3's multi-layer features), the feature of a position whose target hidden states
    are known is fused: f + fuse([RMSNorm_1(h_l1); ...; RMSNorm_n(h_ln)]) over those target layers' outputs,
    `fuse` starting at zero (so a fresh fused drafter starts as the unfused one). Drafted positions have only
    the drafter's predicted feature, which is used as it is."""

    def __init__(self, config: LlamaConfig, fuse_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fuse_layers = tuple(fuse_layers)
        if self.fuse_layers:
            n = len(self.fuse_layers)
            self.fuse_norms = torch.nn.ModuleList(LlamaRMSNorm(h, eps=config.rms_norm_eps) for _ in range(n))
            self.fuse = torch.nn.Linear(n * h, h, bias=False)
            torch.nn.init.zeros_(self.fuse.weight)
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.embed = None  # the target's input embedding module (set by `attach`, never a submodule)
        self.register_buffer("head", torch.zeros(0, h), persistent=False)  # [K, H]: target LM-head rows

    def attach(self, target: torch.nn.Module, vocab_ids: torch.Tensor) -> EagleDrafter:
        """Share the target's embedding (by reference) and copy its LM-head rows `vocab_ids`."""
        object.__setattr__(self, "embed", target.get_input_embeddings())  # bypass submodule registration
        w = target.get_output_embeddings().weight.detach()
        self.head = w[vocab_ids.to(w.device)].clone().to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        return self

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the drafter adds to the target (no embedding, no head, no rotary buffers)."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(OWN_PREFIXES)}

    def fused(self, feats: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """The drafter's input feature at positions with known target hidden states: `feats` [..., H] (the last
        layer's), `extra` [..., n * H] (the `fuse_layers` outputs side by side; None without fusion)."""
        if not self.fuse_layers:
            return feats
        h = self.config.hidden_size
        dtype = self.fuse.weight.dtype
        # Normalised in float32: a raw residual stream may exceed float16's range before its norm.
        normed = [norm(extra[..., i * h : (i + 1) * h].float()).to(dtype) for i, norm in enumerate(self.fuse_norms)]
        return feats.to(dtype) + self.fuse(torch.cat(normed, -1))

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] f_j
        tokens: torch.Tensor,  # [B, T] t_{j+1}
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # additive [B or 1, 1, T, past + T]; None = causal
        cache: DynamicCache | None = None,
        embeds: torch.Tensor | None = None,  # precomputed E(tokens), else looked up here
    ) -> torch.Tensor:
        """Predicted features f̂_{j+1}: [B, T, H]."""
        if embeds is None:
            embeds = self.embed(tokens.to(self.embed.weight.device))
        x = self.fc(torch.cat([features.to(self.fc.weight.dtype), embeds.to(self.fc.weight.dtype)], -1))
        rope = self.rotary(x, position_ids)
        h = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=rope,
        )
        return self.norm(h)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary logits (float32) of predicted features ([..., H] -> [..., K])."""
        if fast_kernels_on(self):  # a proposal's few rows: the faster CPU layout
            return few_rows_linear(feats, self.head).float()
        return torch.nn.functional.linear(feats, self.head).float()


class EagleShape(NamedTuple):
    """A draft shape: levels drafted, children per frontier node (1: a chain) and nodes verified."""

    depth: int
    top_k: int
    total_tokens: int

    def describe(self) -> str:
        if self.top_k == 1:
            return f"chain of {self.depth}"
        return f"{self.total_tokens}-node tree over {self.depth} levels (top {self.top_k}, reranked)"


def measured_candidates(meta: dict, where: str, tree: bool = True) -> list[ShapeCandidate]:
    """The CPU shapes a drafter saved with `"shape_choice": "measured"` chooses from: chains of 1 and 2 draft
    tokens, and 3 draft nodes, as the EAGLE-2 tree reranked over two levels (top 3 per node; with `tree` false, a
    chain of 3). Their expected accepted lengths come from the drafter's held-out top-1 per draft level
    (`metrics.heldout`: top1, top1_step2, top1_step3), each level's taken as the chance that it is accepted when
    the levels before it were: 1 + p1 + p1 p2 (+ p1 p2 p3 for 3 nodes). (Errors go together, so a level is
    accepted more often after accepted ones than its own top-1: the estimate is low for deeper chains.) The
    3-node tree is given the chain of 3's estimate: on 24 held-out training prompts (two sets of 12, 128 new
    tokens, greedy, AMD EPYC, 2026-12-04) it accepted 2.06 and 1.87 where the chain of 3 accepted 2.07 and 1.79,
    with one drafter forward less per step (1.58x and 1.48x plain decoding against the chain's 1.50x and 1.34x)."""
    held = (meta.get("metrics") or {}).get("heldout") or {}
    levels = [held.get(k) for k in LEVEL_KEYS]
    if not all(isinstance(p, (int, float)) and 0 <= p <= 1 for p in levels):
        raise ModelLoadError(
            f'shape_choice "measured" {where} needs metrics.heldout.{", ".join(LEVEL_KEYS)} (the trainer\'s '
            f"held-out top-1 per draft level, each in [0, 1]), got {levels}"
        )
    candidates, reaches = [], []
    for nodes, p in enumerate(levels, 1):
        reaches.append(p * (reaches[-1] if reaches else 1.0))
        shape, reach = EagleShape(nodes, 1, nodes), tuple(reaches)
        if nodes == 3 and tree:  # (two levels deep: the third level's share counted at the second)
            shape, reach = EagleShape(2, 3, 3), (reaches[0], reaches[1] + reaches[2])
        candidates.append(
            ShapeCandidate(shape, 1 + sum(reaches), verify_tokens=nodes + 1, drafter_forwards=shape.depth, reach=reach)
        )
    return candidates


def build_drafter(
    target: torch.nn.Module,
    vocab_ids: torch.Tensor,
    init_from_last_layer: bool = False,
    fuse_layers: tuple[int, ...] = (),
) -> EagleDrafter:
    """A fresh drafter for `target`, in float32 on the target's device, fusing `fuse_layers` into its input
    features; optionally initialised from the target's last decoder layer and final norm (Llama targets)."""
    drafter = EagleDrafter(drafter_config(target.config, len(vocab_ids)), fuse_layers)
    if init_from_last_layer:
        inner = getattr(target, "model", None)
        layers = getattr(inner, "layers", None)
        try:
            drafter.layer.load_state_dict(layers[-1].state_dict())
            drafter.norm.load_state_dict(inner.norm.state_dict())
        except Exception as e:  # another architecture: the layer shapes or names differ
            raise ModelLoadError(
                f"cannot initialise the EAGLE drafter from the last layer of a '{target.config.model_type}' "
                f"target ({type(e).__name__}); train with init_from_last_layer=false"
            ) from e
        with torch.no_grad():  # start as "pass the embedding through": fc = [0 | I]
            h = drafter.config.hidden_size
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, :h] = torch.eye(h) * 0.5
            drafter.fc.weight[:, h:] = torch.eye(h) * 0.5
            drafter.fc.bias.zero_()
    device = target.get_output_embeddings().weight.device
    return drafter.to(device=device, dtype=torch.float32).attach(target, vocab_ids)


def save_drafter(
    drafter: EagleDrafter,
    vocab_ids: torch.Tensor,
    target: torch.nn.Module,
    out: str | Path,
    metrics: dict,
    extra: dict | None = None,
) -> None:
    from specframe.fingerprint import target_fingerprint, write_artifact

    cfg = {k: v for k, v in drafter.config.to_dict().items() if k != "transformers_version"}
    meta = {
        "format": FORMAT,
        "version": 2 if drafter.fuse_layers else 1,  # 2: has fused layers (unfused drafters stay version 1)
        "llama_config": cfg,
        **({"fuse_layers": list(drafter.fuse_layers)} if drafter.fuse_layers else {}),
        "target": target_fingerprint(target),
        "metrics": metrics,
        **(extra or {}),
    }
    write_artifact(Path(out), "eagle", drafter.own_state_dict(), vocab_ids, meta, indent=2)


def load_drafter(
    path: str | Path, target: torch.nn.Module, dtype: torch.dtype | None = None, option: str = "proposer.model"
):
    """(drafter, vocab_ids, metadata) from a saved folder; refuses a drafter made for another target. `option`
    is the config key that named the folder (for the error when it is not a drafter folder)."""
    from specframe.fingerprint import check_fingerprint, check_vocab_ids, not_an_artifact, read_artifact

    p = Path(user_path(str(path)))
    meta_file = p / "eagle_config.json"
    if not meta_file.is_file():
        raise ModelLoadError(
            f"{option} '{path}' {not_an_artifact(p, 'eagle')}: train an EAGLE drafter with "
            "`specframe train --proposer eagle`"
        )
    name = f"{option}: EAGLE drafter '{p}'"  # (how every error below names it)
    meta, listed, state = read_artifact(p, "eagle", name)
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{option}: '{meta_file}' is not a {FORMAT} file (format {meta.get('format')!r})")
    if meta.get("version") not in (1, 2):
        raise ModelLoadError(
            f"{option}: '{meta_file}' is {FORMAT} version {meta.get('version')!r}; "
            "this specframe reads versions 1 and 2"
        )
    check_fingerprint(meta.get("target"), target, name, adapter=False)
    vocab = target.get_input_embeddings().weight.shape[0]
    vocab_ids = check_vocab_ids(listed, vocab, name, "eagle_vocab.json")
    fuse_layers = meta.get("fuse_layers", [])
    try:
        if not isinstance(fuse_layers, list):
            raise ConfigError(f"fuse_layers must be a list, got {fuse_layers!r}")
        check_extra_layers(fuse_layers, target.config.num_hidden_layers, "fuse_layers")
    except ConfigError as e:
        raise ModelLoadError(f"{name}: {e}") from e
    if bool(fuse_layers) != (meta["version"] == 2):  # version 2 means exactly: fused layers
        raise ModelLoadError(f"{name} is inconsistent: version {meta['version']} with fuse_layers {fuse_layers}")
    try:  # (built on the meta device first: nothing is allocated before the weights are known to fit)
        cfg = LlamaConfig(**meta["llama_config"])
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            layout = EagleDrafter(cfg, tuple(fuse_layers)).own_state_dict()
    except Exception as e:  # whatever building from the saved config raises: the config is what is wrong
        raise ModelLoadError(f"{name} is incomplete or corrupt: llama_config: {type(e).__name__}: {e}") from e
    hidden = target.get_input_embeddings().weight.shape[1]
    if cfg.hidden_size != hidden or cfg.vocab_size != len(vocab_ids):
        raise ModelLoadError(f"{name} is inconsistent: hidden {cfg.hidden_size}, {len(vocab_ids)} ids")
    missing = set(layout) - set(state)
    if missing:
        raise ModelLoadError(f"{name} is missing weights: {sorted(missing)[:3]}")
    unknown = set(state) - set(layout)
    if unknown:
        raise ModelLoadError(f"{name} has weights its config does not use: {sorted(unknown)[:3]}")
    misshapen = sorted(k for k, v in layout.items() if tuple(state[k].shape) != tuple(v.shape))
    if misshapen:
        k = misshapen[0]
        raise ModelLoadError(
            f"{name}: weights do not fit its config: {k} has shape {list(state[k].shape)}, the config "
            f"needs {list(layout[k].shape)}"
        )
    with rng_untouched():  # (random weights, replaced at once)
        drafter = EagleDrafter(cfg, tuple(fuse_layers))
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    w = target.get_output_embeddings().weight
    drafter = drafter.to(device=w.device, dtype=dtype or w.dtype).attach(target, vocab_ids)
    return drafter.eval().requires_grad_(False), vocab_ids.to(w.device), meta


# ---------------------------------------------------------------------------------------------- the proposer


class EagleProposer(Proposer):
    name = "eagle"
    config_class = EagleConfig
    train_config_class = EagleTrainConfig
    hidden_state_layers = (-1,)

    @classmethod
    def train(cls, config: EagleTrainConfig, target: torch.nn.Module, tokenizer, resume: bool = False) -> dict:
        from specframe.training.eagle import train_eagle

        return train_eagle(config, target, tokenizer, resume=resume)

    def __init__(
        self,
        config: EagleConfig,
        target: TargetInfo,
        drafter: EagleDrafter,
        vocab_ids: torch.Tensor,
        tree_shape: dict | None = None,
    ):
        super().__init__(config, target)
        default = DEFAULT_TREE_SHAPE if target.device.type == "cpu" else ACCELERATOR_TREE_SHAPE
        shape = {**default, **(tree_shape or {})}  # the drafter's saved shape, then the device's defaults
        self.depth = config.depth if config.depth is not None else shape["depth"]
        self.top_k = config.top_k if config.top_k is not None else shape["top_k"]
        self.total_tokens = config.total_tokens if config.total_tokens is not None else shape["total_tokens"]
        if config.tree:
            self._fit_tree_shape(config, vocab_ids.numel())
            k = min(self.top_k, vocab_ids.numel(), self.total_tokens)
            if self.depth * k * k > MAX_DRAFT_CANDIDATES:
                raise ConfigError(
                    f"the tree shape depth {self.depth}, top_k {self.top_k}, total_tokens {self.total_tokens} "
                    f"(proposer.* over the drafter's saved tree_shape) scores depth x top_k^2 = {self.depth * k * k} "
                    f"candidates a step (top_k in effect {k}), more than the {MAX_DRAFT_CANDIDATES} a tree may: set "
                    "a smaller depth or top_k"
                )
        self.shape_choice: str | None = None  # how the shape was measured on this machine (use_fastest_shape)
        self.measured_shape: str | None = None  # that shape in a few words, e.g. "chain of 2" (None: not measured)
        self.online: OnlineShapeChoice | None = None  # the shape re-chosen every step (config.adapt_shape)
        threshold = resolve_confidence_threshold(
            config.confidence_threshold,
            shape.get("confidence_threshold"),
            "the confidence_threshold saved with the drafter",
        )
        # Nodes need a cumulative log-probability >= this (-inf: no threshold).
        self.min_score = math.log(threshold) if threshold else -math.inf
        self.drafter = drafter.eval().requires_grad_(False)
        # The target layers the drafter reads: its fused layers (if any), then the last one (the feature).
        self.hidden_state_layers = (*drafter.fuse_layers, -1)
        if target.fast_cpu_kernels:  # (as the target) float32 CPU only: the faster layout for few rows
            use_fast_cpu_kernels(self.drafter)
        self.vocab_ids = vocab_ids.to(target.device)  # target ids of the drafter's logit columns
        self.dtype = drafter.fc.weight.dtype
        self.cache: DynamicCache | None = None
        self.committed = 0  # pairs (f_j, t_{j+1}) in the drafter's cache: positions 0 .. committed-1
        self.pending_feats: torch.Tensor | None = None  # real features not yet fed to the drafter
        self.root_feat: torch.Tensor | None = None  # the drafter's prediction of the root's feature
        self.last_scores: torch.Tensor | None = None  # cumulative log-probability of the last proposal's nodes

    @classmethod
    def from_config(cls, config: EagleConfig, target: TargetInfo) -> EagleProposer:
        from specframe.artifacts import shipped

        path = config.model or shipped("eagle", target.name, target.model)
        if not path:
            raise ConfigError(
                f"proposer.model is required: no EAGLE drafter ships for target '{target.name}'; train one with "
                "`specframe train --proposer eagle data=... out=...` and pass proposer.model=<that folder>"
            )
        if target.model is None:
            raise ConfigError("the eagle proposer needs the target model (its embedding and LM head)")
        drafter, vocab_ids, meta = load_drafter(
            path, target.model, proposer_dtype(config.dtype, target.dtype, target.device, target.fast_cpu_kernels)
        )
        quantize_proposer(drafter, config.quantize, target.fast_cpu_kernels)  # (before its kernels are chosen)
        shape = meta.get("tree_shape") or {}
        where = f"in {path}/eagle_config.json"
        if not isinstance(shape, dict):
            raise ModelLoadError(f"tree_shape {where} must be an object, got {shape!r}")
        for key in SHAPE_KEYS:
            value = shape.get(key)
            if value is not None and not (is_count(value) and value <= MAX_TREE_NODES):  # (verified every step)
                raise ModelLoadError(
                    f"tree_shape.{key} {where} must be an integer in [1, {MAX_TREE_NODES}], got {value!r}"
                )
        check_confidence_threshold(shape.get("confidence_threshold"), f"tree_shape.confidence_threshold {where}")
        # The saved shape is one shape, tuned whole: a user who sets any of its keys gets the device's defaults for
        # the others (a saved one-node shape would cap `proposer.depth=5` at one node). The threshold still applies.
        unset = all(getattr(config, k) is None for k in SHAPE_KEYS)
        if not unset or not saved_shape_applies(meta, target.device, f"{path}/eagle_config.json"):
            shape = {k: v for k, v in shape.items() if k not in SHAPE_KEYS}
        if config.top_k is not None and config.top_k > len(vocab_ids):  # (before: cut to the vocabulary, unsaid)
            raise ConfigError(
                f"proposer.top_k={config.top_k} is more than the drafter's vocabulary of {len(vocab_ids)} tokens: set "
                f"top_k <= {len(vocab_ids)}"
            )
        measure = check_shape_choice(meta.get("shape_choice"), f"{path}/eagle_config.json") == "measured"
        candidates = measured_candidates(meta, where, config.tree) if measure else []
        proposer = cls(config, target, drafter, vocab_ids, shape)
        if measure and unset and target.device.type == "cpu" and target.model is not None:
            proposer.use_fastest_shape(candidates)
        return proposer

    @classmethod
    def random(
        cls, target: TargetInfo, config: EagleConfig | None = None, seed: int = 0, fuse_layers: tuple[int, ...] = ()
    ) -> EagleProposer:
        """Random weights for any target, fusing `fuse_layers` (random fusion weights too); the reduced vocabulary
        is a seeded random 3/4 of the target's."""
        config = config or EagleConfig()
        v = target.vocab_size
        with seeded(seed):
            vocab_ids = torch.randperm(v)[: max(1, v - v // 4)].sort().values
            drafter = EagleDrafter(drafter_config(target.model.config, len(vocab_ids)), fuse_layers)
            for p in drafter.parameters():  # wide init: peaky, varied draft scores
                if p.dim() == 2:
                    torch.nn.init.normal_(p, std=0.5)
        dtype = proposer_dtype(config.dtype, target.dtype, target.device, target.fast_cpu_kernels)
        drafter = drafter.to(device=target.device, dtype=dtype).attach(target.model, vocab_ids)
        quantize_proposer(drafter, config.quantize, target.fast_cpu_kernels)
        return cls(config, target, drafter, vocab_ids)

    def _fit_tree_shape(self, config: EagleConfig, vocab: int) -> None:
        """A tree's keys that were not set (the saved shape's or the device's defaults) fitted to those that were;
        set ones that cannot hold together refused: a tree of n nodes is at most n levels deep, and depth d with
        top_k k makes at most k + (d - 1) k^2 nodes (k no more than the drafter's vocabulary)."""

        def most(depth: int, top_k: int) -> int:
            k = min(top_k, vocab)
            return k + (depth - 1) * k * k

        if self.depth > self.total_tokens:
            if config.depth is not None and config.total_tokens is not None:
                raise ConfigError(
                    f"proposer.depth={self.depth} cannot be reached with proposer.total_tokens={self.total_tokens}: "
                    f"a tree of {self.total_tokens} nodes is at most {self.total_tokens} deep (set depth <= "
                    "total_tokens)"
                )
            if config.depth is None:
                self.depth = self.total_tokens
            else:
                self.total_tokens = self.depth
        if self.total_tokens <= most(self.depth, self.top_k):
            return
        if config.total_tokens is None:  # (the default node count: as many as the set keys make)
            self.total_tokens = most(self.depth, self.top_k)
        elif config.depth is None:  # (deeper, to hold the nodes asked for: the least depth that does, at most
            k = min(self.top_k, vocab)  # total_tokens; computed, not counted up: total_tokens may be large)
            least = self.total_tokens if k == 1 else 1 + -(-(self.total_tokens - k) // (k * k))
            self.depth = max(self.depth, min(least, self.total_tokens))
        elif config.top_k is None:  # (wider, as far as the vocabulary allows)
            while most(self.depth, self.top_k) < self.total_tokens and self.top_k < vocab:
                self.top_k += 1
        if self.total_tokens > most(self.depth, self.top_k):
            k = min(self.top_k, vocab)
            raise ConfigError(
                f"proposer.total_tokens={self.total_tokens} is more than a tree of depth {self.depth} and top_k "
                f"{self.top_k}{f' (in effect {k}: the drafter has {vocab} tokens)' if k < self.top_k else ''} can "
                f"make ({most(self.depth, self.top_k)} nodes: top_k, then top_k^2 a level); set total_tokens <= "
                f"{most(self.depth, self.top_k)}, or a larger depth or top_k"
            )

    def use_fastest_shape(self, candidates: list[ShapeCandidate]) -> ShapeCandidate:
        """Draft the shape (an EagleShape) of `candidates` that is fastest on this machine
        (specframe/step_costs.py): the target's forwards and one drafter step (a one-pair forward and its logits)
        timed here."""
        costs = measure_step_costs(self.target.model)
        h = self.drafter.fc.weight.shape[0]
        cache = DynamicCache(config=self.drafter.config)
        with torch.no_grad():
            context = torch.zeros(1, CONTEXT, h, dtype=self.dtype, device=self.target.device)
            tokens = torch.zeros(1, CONTEXT + 1, dtype=torch.long, device=self.target.device)
            positions = torch.arange(CONTEXT + 1, device=self.target.device)[None]
            self.drafter(context, tokens[:, :CONTEXT], positions[:, :CONTEXT], None, cache)

            def step() -> None:
                out = self.drafter(context[:, :1], tokens[:, :1], positions[:, CONTEXT:], None, cache)
                self.drafter.logits(out[0])
                cache.crop(-1)

            drafter_cost = relative_cost(step, self.target.model)
        words, searched, adapt = EagleShape.describe, f"{len(candidates)} shapes", self.config.adapt_shape
        choice = choose_measured(candidates, costs, drafter_cost, adapt, words, searched, "a drafter step")
        (self.depth, self.top_k, self.total_tokens), self.online = choice.best.shape, choice.online
        self.measured_shape, self.shape_choice = choice.measured_shape, choice.shape_choice
        return choice.best

    # ------------------------------------------------------------------ state

    def _features(self, hidden_states: dict[int, torch.Tensor], rows: int) -> torch.Tensor:
        """The drafter's input features ([rows, H]) from the target's hidden states at real positions."""
        missing = [layer for layer in self.hidden_state_layers if layer not in hidden_states]
        if missing:
            raise ValueError(f"eagle needs the target's hidden states of layers {list(self.hidden_state_layers)}")
        for layer in self.hidden_state_layers:
            if hidden_states[layer].shape[0] != rows:
                raise ValueError(f"expected {rows} rows of layer {layer}, got {hidden_states[layer].shape[0]}")
        extra = None
        if self.drafter.fuse_layers:
            extra = torch.cat([hidden_states[layer] for layer in self.drafter.fuse_layers], -1)
        return self.drafter.fused(hidden_states[-1].to(self.dtype), extra).to(self.dtype)

    @torch.no_grad()
    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        if fast_kernels_on(self.drafter):  # (its kernels' copies follow a change through `.data`, as the target's)
            forget_outdated_copies(self.drafter)
        feats = self._features(hidden_states, prompt.numel())
        self.cache = DynamicCache(config=self.drafter.config)
        self.committed = 0
        self.root_feat = None
        self.pending_feats = feats
        if self.online is not None:
            self.online.reset()

    def end(self) -> None:
        self.cache = self.pending_feats = self.root_feat = self.last_scores = None

    @torch.no_grad()
    def accepted(self, result: Acceptance) -> None:
        feats = self._features(result.hidden_states, len(result.accepted_tokens) + 1)  # the root, then each node
        self.pending_feats = torch.cat([self.pending_feats, feats])
        if self.online is not None:
            self.online.observe(len(result.accepted_nodes))

    # ------------------------------------------------------------------ drafting

    def _feed(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor):
        """Append pairs to the drafter's cache; `allowed` [n, cached - committed + n] (on the device) says which keys
        past the committed ones (earlier tree pairs, then these) each new pair sees."""
        n = feats.shape[0]
        assert allowed.shape == (n, self.cache.get_seq_length() - self.committed + n)
        mask = torch.zeros(n, self.committed + allowed.shape[1], dtype=self.dtype, device=allowed.device)
        mask[:, self.committed :].masked_fill_(~allowed, torch.finfo(self.dtype).min)  # (additive)
        return self.drafter(feats[None], tokens[None], positions[None], mask[None, None], self.cache)[0]

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        device = state.tokens.device
        if self.online is not None:  # (a plain step: its features wait, and are fed with the next draft's)
            shape = self.online.choose().shape
            if shape is None:
                return Proposal.empty(device)
            self.depth, self.top_k, self.total_tokens = shape
        depth = min(self.depth, state.max_depth)
        if depth <= 0:
            return Proposal.empty(device)
        if self.pending_feats is None or (self.root_feat is None and self.pending_feats.shape[0] == 0):
            raise RuntimeError("eagle: propose() before begin() or without the prompt's features")
        # 1. Commit the real pairs: the last output predicts the root's feature.
        m = self.pending_feats.shape[0]
        if state.tokens.numel() != self.committed + m + 1:  # (a feature for every position but the root's)
            raise RuntimeError(
                f"eagle: {state.tokens.numel()} tokens, but features for {self.committed + m} positions before the root"
            )
        if m:
            # Their next tokens: the sequence after each of them (the last one's is the root).
            following = state.tokens[self.committed + 1 :].to(self.target.device)
            positions = torch.arange(self.committed, self.committed + m, device=self.target.device)
            causal = torch.ones(m, m, dtype=torch.bool, device=self.target.device).tril()
            out = self._feed(self.pending_feats, following, positions, causal)
            self.committed += m
            self.root_feat = out[-1]
            self.pending_feats = self.pending_feats[:0]
        try:
            tokens, parents, scores = self._tree(self.root_feat, depth, state)
        finally:  # drafted nodes never stay in the cache
            extra = self.cache.get_seq_length() - self.committed
            if extra > 0:
                self.cache.crop(-extra)
        self.last_scores = scores
        if self.online is not None:  # (the depth the token budget left: see OnlineShapeChoice.drafted)
            self.online.drafted(tokens.numel(), depth)
        return Proposal(
            tokens.to(device), parents.to(device), torch.ones(tokens.numel(), dtype=torch.bool, device=device)
        )

    def _tree(
        self, root_feat: torch.Tensor, depth: int, state: DecodeState
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's tree, built on the drafter's device: (tokens, parents, cumulative log-probabilities) of the
        kept nodes in topological order (by level, then score). Nothing reaches the host until the end unless a
        confidence threshold is set (then the number of nodes that reach it, once per level, to stop early and
        to feed only those). Nodes are numbered as they are made, level by level; ties in score go to the lower
        number, so a parent (never scored below its children: log-probabilities are <= 0) always comes first.
        With penalties (`state.sampling`), each node's children are scored on logits penalised as the target's
        will be at that node: with the output and the node's path (`DecodeState.penalised`)."""
        # (no more than total_tokens children a node, nor nodes a frontier: a node below a level's best
        # total_tokens is never kept, nor is any of its descendants, which score no higher)
        k = min(self.top_k if self.config.tree else 1, self.vocab_ids.numel(), self.total_tokens)
        threshold = self.min_score > -math.inf  # (compared in double, as a Python float: not rounded to float32)
        device = root_feat.device
        base = self.committed  # position of the root; a node at depth d sits at base + d
        vocab_ids, penalised = self.vocab_ids, state.sampling.penalised
        vals, idx = torch.log_softmax(state.penalised(self.drafter.logits(root_feat), columns=vocab_ids), -1).topk(k)
        scores, tokens = [vals.float()], [self.vocab_ids[idx]]  # per level: every node made, numbered in order
        parents, levels = [torch.full((k,), -1, device=device)], [torch.ones(k, dtype=torch.long, device=device)]
        # The best first token is always a node; the others only when they reach the threshold.
        reach = valid = None
        if threshold:
            reach = vals.double() >= self.min_score  # (sorted: those that reach it come first)
            valid = [reach.clone()]
            valid[0][0] = True
        # The frontier: its nodes' numbers, scores and tokens, the features predicted at their parents, and which
        # tree pairs already fed (ancestors) each may see, then itself. Only nodes that reach the threshold expand.
        frontier = torch.arange(k, device=device)
        f_scores, f_tokens = scores[0], tokens[0]
        f_feats = root_feat.expand(k, -1)
        f_paths = tokens[0][:, None] if penalised else None  # (each frontier node's path of tokens, with penalties)
        if threshold:
            live = int(reach.sum())
            valid_count = max(live, 1)  # nodes made that reach the threshold, and the forced first one
            frontier, f_scores, f_tokens, f_feats = frontier[:live], f_scores[:live], f_tokens[:live], f_feats[:live]
            f_paths = f_paths[:live] if penalised else None
        allowed = torch.eye(frontier.numel(), dtype=torch.bool, device=device)
        made = k
        for d in range(2, depth + 1):
            f = frontier.numel()
            if f == 0:
                break
            # Feed each frontier node x as the pair (f̂ at its parent, x) at position base + d - 2.
            positions = torch.full((f,), base + d - 2, device=device)
            out = self._feed(f_feats, f_tokens, positions, allowed)
            logp = torch.log_softmax(state.penalised(self.drafter.logits(out), f_paths, vocab_ids), -1)  # [F, K]
            vals, idx = (logp + f_scores[:, None]).topk(k, dim=-1)  # each frontier node's k best children
            scores.append(vals.flatten())
            tokens.append(self.vocab_ids[idx].flatten())
            parents.append(frontier.repeat_interleave(k))
            levels.append(torch.full((f * k,), d, device=device))
            if threshold:
                valid.append(scores[-1].double() >= self.min_score)
            # The next frontier: the k best children (stably sorted: ties to the lower number), those that reach
            # the threshold, if one is set.
            ranked = scores[-1].masked_fill(~valid[-1], -math.inf) if threshold else scores[-1]
            best = torch.sort(ranked, descending=True, stable=True).indices[:k]
            if threshold:  # (the valid children's scores are finite, so they rank first)
                level_valid = int(valid[-1].sum())
                valid_count += level_valid
                best = best[:level_valid]
            row = best // k  # each child's parent, as a row of this level's frontier
            frontier, f_scores, f_tokens, f_feats = made + best, scores[-1][best], tokens[-1][best], out[row]
            if penalised:
                f_paths = torch.cat([f_paths[row], f_tokens[:, None]], 1)
            allowed = torch.cat([allowed[row], torch.eye(best.numel(), dtype=torch.bool, device=device)], 1)
            made += f * k
        score, token, parent, level = (torch.cat(x) for x in (scores, tokens, parents, levels))
        # Keep the best total_tokens nodes, a set closed under ancestors (parents sort first, above).
        made_valid = torch.cat(valid) if threshold else None
        keep = torch.sort(
            score.masked_fill(~made_valid, -math.inf) if threshold else score, descending=True, stable=True
        ).indices
        count = valid_count if threshold else made
        keep = keep[: min(count, self.total_tokens) if self.config.tree else count]
        order = keep[torch.sort(level[keep], stable=True).indices]  # topological: by level, then score
        renumber = torch.full((made,), -1, device=device)
        renumber[order] = torch.arange(order.numel(), device=device)
        kept_parents = parent[order]
        new_parents = torch.where(kept_parents >= 0, renumber[kept_parents.clamp_min(0)], -1)
        return token[order], new_parents, score[order]
