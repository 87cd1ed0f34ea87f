"""A small draft built from the target itself: a few decoder layers on the target's own embeddings, with a
reduced vocabulary whose output rows are the target's own LM-head rows (FR-Spec style).

Only the draft's decoder layers and final norm are stored (safetensors, float16); the embeddings and head
rows are taken from the target at load time, so an artifact carries no weight the target already has.
Exactness is unaffected by the reduced vocabulary: tokens outside it get q = 0, so the draft never
proposes them and the acceptance rule still reproduces p.

Directory format:
    draft_config.json   {"format": "specframe-shared-draft", "version": 1, "llama_config": {...},
                         "init_layers": [...], "target": {...fingerprint...}, "metrics": {...}}
    draft_vocab.json    [token ids of the draft's output rows]
    model.safetensors   the draft's layers and norm
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specframe.errors import ConfigError, ModelLoadError, is_count
from specframe.fingerprint import (
    check_fingerprint,
    check_vocab_ids,
    read_artifact,
    target_fingerprint,
    write_artifact,
)
from specframe.proposer import rng_untouched

FORMAT = "specframe-shared-draft"


def is_shared_draft(path: str | Path) -> bool:
    """Whether `path` is meant as a shared draft folder: its draft_config.json names this format, or is damaged
    (then loading it names the damage, instead of treating the folder as a model directory)."""
    p = Path(path) / "draft_config.json"
    if not p.is_file():
        return False
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError):  # (not JSON, not UTF-8, nested too deeply: named at load)
        return True
    return not isinstance(meta, dict) or meta.get("format") == FORMAT


def build_shared_draft(
    target: torch.nn.Module, num_layers: int, vocab_ids: torch.Tensor, init_layers: list[int] | None = None
) -> LlamaForCausalLM:
    """A LlamaForCausalLM of `num_layers` layers sharing `target`'s embedding module; its head is the
    target's output rows `vocab_ids` (a copy, [K, hidden]). Layers start as copies of `init_layers`."""
    tcfg = target.config
    if tcfg.model_type != "llama":
        raise ModelLoadError(
            f"the shared draft needs a Llama-architecture target, got '{tcfg.model_type}': for this target, give "
            "the draft proposer any smaller model with its vocabulary (proposer.model), or train medusa or eagle"
        )
    outside = [i for i in init_layers or [] if not is_count(i, 0) or i >= tcfg.num_hidden_layers]
    if outside:
        raise ConfigError(
            f"train.init_layers: {outside[0]!r} is not a layer of the target (0 to {tcfg.num_hidden_layers - 1})"
        )
    cfg = LlamaConfig(
        **{
            **tcfg.to_dict(),
            "num_hidden_layers": num_layers,
            "vocab_size": len(vocab_ids),
            "tie_word_embeddings": False,
            "architectures": ["LlamaForCausalLM"],
        }
    )
    draft = LlamaForCausalLM(cfg)
    draft.model.embed_tokens = target.get_input_embeddings()  # shared module, never trained
    head = target.get_output_embeddings().weight.detach()[vocab_ids.to(target.device)]
    draft.lm_head.weight = torch.nn.Parameter(head.clone(), requires_grad=False)
    if init_layers is not None:
        for i, src in enumerate(init_layers):
            draft.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.config.vocab_size = len(vocab_ids)
    return draft.to(device=target.device, dtype=target.dtype)


def own_state_dict(draft: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The weights the draft adds to the target: its layers and final norm."""
    return {k: v for k, v in draft.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}


def save_shared_draft(
    draft: LlamaForCausalLM,
    vocab_ids: torch.Tensor,
    target: torch.nn.Module,
    out: Path,
    init_layers: list[int],
    metrics: dict,
    extra: dict | None = None,
) -> None:
    cfg = {k: v for k, v in draft.config.to_dict().items() if k not in ("transformers_version",)}
    meta = {
        "format": FORMAT,
        "version": 1,
        "llama_config": cfg,
        "init_layers": init_layers,
        "target": target_fingerprint(target),
        "metrics": metrics,
        **(extra or {}),
    }
    write_artifact(out, "draft", own_state_dict(draft), vocab_ids, meta, indent=2)


def saved_gamma(meta: dict, path: str | Path) -> int | None:
    """The γ saved with the shared draft in `path` (`num_speculative_tokens` in its draft_config.json, read as
    `meta`), or None; a value that is not an integer >= 1 is an error naming the file (never silently replaced
    by the default)."""
    value = meta.get("num_speculative_tokens")
    if value is not None and not is_count(value):
        file = Path(path) / "draft_config.json"
        raise ModelLoadError(f"num_speculative_tokens in {file} must be an integer >= 1 or null, got {value!r}")
    return value


def saved_threshold(meta: dict) -> object:
    """The confidence threshold saved with a shared draft (`confidence_threshold` in its draft_config.json,
    read as `meta`), or None; the proposer validates it."""
    return meta.get("confidence_threshold")


class CastEmbedding(torch.nn.Module):
    """The target's embedding module, shared by reference (not a submodule, so converting the draft never
    converts the target), with its output cast to the draft's dtype."""

    def __init__(self, embedding: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        object.__setattr__(self, "shared", embedding)
        self.out_dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.shared.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.shared(input_ids).to(self.out_dtype)


def load_shared_draft(
    path: str | Path, target: torch.nn.Module, dtype: torch.dtype | None = None
) -> tuple[LlamaForCausalLM, torch.Tensor, dict]:
    """Rebuild a saved shared draft on `target`, its own weights in `dtype` (default: the target's); returns
    (draft, vocab_ids, metadata: its draft_config.json). Refuses a draft made for another target."""
    p = Path(path)
    what = f"draft '{p}'"
    meta, listed, state = read_artifact(p, "draft", what)
    check_fingerprint(meta.get("target"), target, what, adapter=False)
    vocab_ids = check_vocab_ids(listed, target.get_output_embeddings().weight.shape[0], what, "draft_vocab.json")
    try:
        layers = meta["llama_config"]["num_hidden_layers"]
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{what} is incomplete or corrupt: {type(e).__name__}: {e}") from e
    if not is_count(layers):
        raise ModelLoadError(f"draft '{p}': llama_config.num_hidden_layers must be an integer >= 1, got {layers!r}")
    held = {k.split(".")[2] for k in state if k.startswith("model.layers.")}
    if layers > len(held):  # (before building: the layers a config claims are allocated, as many as it says)
        absent = next(i for i in range(len(held) + 1) if str(i) not in held)
        raise ModelLoadError(
            f"draft '{p}' is missing weights: layer {absent} on (draft_config.json says {layers} layers, its weights "
            f"hold {len(held)})"
        )
    target_layers = getattr(getattr(target, "model", None), "layers", None)
    if target_layers:  # (a draft layer is shaped as the target's: each one's weights whole, before any is built)
        shapes = {k: tuple(v.shape) for k, v in target_layers[0].state_dict().items()}
        for i in range(layers):
            for name, shape in shapes.items():
                saved = state.get(f"model.layers.{i}.{name}")
                if saved is None or tuple(saved.shape) != shape:
                    found = "missing" if saved is None else f"of shape {list(saved.shape)}, not {list(shape)}"
                    raise ModelLoadError(f"draft '{p}' has weights that do not fit: model.layers.{i}.{name} is {found}")
    with rng_untouched():  # (random weights, replaced below)
        draft = build_shared_draft(target, layers, vocab_ids)
    own = set(own_state_dict(draft))
    missing, unknown = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unknown:
        what = f"is missing weights: {missing[:3]}" if missing else f"holds weights its config does not: {unknown[:3]}"
        raise ModelLoadError(f"draft '{p}' {what} (draft_config.json says {layers} layers)")
    try:
        draft.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    except RuntimeError as e:  # (shapes that differ from the config's)
        raise ModelLoadError(f"draft '{p}': weights do not fit its config: {' '.join(str(e).split())[:300]}") from e
    if dtype is not None and dtype != target.dtype:  # convert the draft's own parts, never the shared embedding
        for part in (draft.model.layers, draft.model.norm, draft.lm_head):
            part.to(dtype)
        draft.model.embed_tokens = CastEmbedding(target.get_input_embeddings(), dtype)
        draft.config.dtype = dtype
    return draft.to(target.device).eval().requires_grad_(False), vocab_ids.to(target.device), meta


def as_full_vocab_model(draft: LlamaForCausalLM, vocab_ids: torch.Tensor, vocab_size: int) -> LlamaForCausalLM:
    """The same draft with a full-vocabulary head (rows outside `vocab_ids` score -1e4), for libraries that
    need an ordinary causal LM over the target's vocabulary, e.g. transformers' assisted generation."""
    with rng_untouched():  # (random weights, all replaced)
        full = LlamaForCausalLM(LlamaConfig(**{**draft.config.to_dict(), "vocab_size": vocab_size}))
        head = torch.nn.Linear(draft.config.hidden_size, vocab_size, bias=True)
    full.model = draft.model
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1e4)
        head.weight[vocab_ids.cpu()] = draft.lm_head.weight.detach().float().cpu()
        head.bias[vocab_ids.cpu()] = 0.0
    full.lm_head = head.to(device=draft.lm_head.weight.device, dtype=draft.lm_head.weight.dtype)
    full.generation_config = draft.generation_config
    return full.eval().requires_grad_(False)
