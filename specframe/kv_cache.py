"""The target's KV cache and its rollback: keep exactly the accepted path after each verification.

transformers' `DynamicLayer` appends a forward's keys and values by concatenation, a copy of the layer's whole
cache on every forward; `GrowingLayer` writes them into a buffer with room to spare and hands out views of it,
so a forward copies only its own positions (SmolLM2-135M's 30 layers on the 2-core Intel machine, one position
added after 1,200 cached: 1.0 ms against 6.2; after 300, 1.0 against 2.1; `scripts/kernel_timings.py`). The
logits are the same, bit for bit. Rolling back stays a crop of the view.

Sliding-window layers (Mistral, Gemma 2 and 3, Qwen2 with use_sliding_window, ...) get the same full layer, which
keeps every position (rolling back may need any of them): the model's own mask, built from positions, applies the
window over it in the prefill and in a chain's verification, and a token tree's mask applies it too
(`tree_attention_mask` with the model's `sliding_layout`). Model types not checked that way
(PAST_WINDOW_MODEL_TYPES) are served inside their attention window only (`attention_window`), where a sliding
layer sees what full attention sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from specframe.errors import BadInputError

# Model types served past their sliding attention window: each one's forward applies a tree mask per layer type as
# `tree_attention_mask` gives it (one mask where every layer slides, else one per layer type: transformers' models
# with both kinds take {"full_attention": ..., "sliding_attention": ...}), and tiny models of each, generating well
# past a window of 8, give transformers' own output token for token with every proposer, trees included
# (tests/test_sliding_window.py). Other sliding-window models stop at their window (`context_limit`).
PAST_WINDOW_MODEL_TYPES = frozenset(
    {"mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma2", "gemma3_text", "starcoder2", "phi3", "olmo3"}
    | {"smollm3", "gpt_oss"}
)
# Of those, the types whose model gives every layer the one (sliding) mask whatever `layer_types` says, and so takes
# no mask per layer type (a dict: their forward fails on one). A config of one of these types with `layer_types`
# that are not all sliding (transformers warns "Detected Mistral model with layer_types") gets a cache whose layers
# disagree with the model's own masks (transformers' own generation fails past the window), so it is served inside
# its window only.
ONE_MASK_MODEL_TYPES = frozenset({"mistral", "mixtral", "starcoder2", "phi3"})


class SlidingLayout(NamedTuple):
    """What a tree's mask must know of a model served past its sliding window (`sliding_layout`)."""

    window: int  # its sliding layers' window: position i sees positions i - window + 1 to i
    every_layer: bool  # whether every layer slides (then one mask serves them all)


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache for `model`, refused (bad input: the user chose the model) when some layer could not be
    rolled back exactly. Cheap: the decoder and the draft proposer also call it when they are built.

    Full-attention and sliding-window layers get a `GrowingLayer`, which keeps every position: transformers'
    sliding-window layer drops the oldest ones and cannot be cropped back past them. The model's own mask (by
    position) decides what a forward sees, and a token tree's mask applies the window too (`tree_attention_mask`)."""
    return _checked_cache(model)[0]


def attention_window(model: torch.nn.Module) -> int | None:
    """The smallest sliding attention window of `model`'s layers, in positions (None: every layer attends to the
    whole sequence). A layer with window w lets position i see positions i - w + 1 to i: for every position
    below w, that is the whole sequence before it, exactly what a full-attention layer sees. Refuses what
    `new_cache` refuses."""
    windows = _checked_cache(model)[1]
    return min(windows, default=None)


def sliding_layout(model: torch.nn.Module) -> SlidingLayout | None:
    """How a token tree's mask applies `model`'s sliding window past it (`tree_attention_mask`); None where no layer
    slides, and where specframe serves the model only inside its window: a type not in PAST_WINDOW_MODEL_TYPES, or
    sliding layers of more than one window (a mask per layer type could not tell them apart), or a type that takes
    one mask for every layer (ONE_MASK_MODEL_TYPES) whose layer types are not all sliding."""
    _, windows, kinds = _checked_cache(model)
    return _layout(model, windows, kinds)


def _layout(model: torch.nn.Module, windows: list[int], kinds: list[str]) -> SlidingLayout | None:
    """`sliding_layout` from what `_checked_cache` read of `model`: its sliding layers' windows, its layer types."""
    model_type = getattr(model.config, "model_type", None)
    if not windows or len(set(windows)) > 1 or model_type not in PAST_WINDOW_MODEL_TYPES:
        return None
    every_layer = all(kind == "sliding_attention" for kind in kinds)
    if not every_layer and model_type in ONE_MASK_MODEL_TYPES:
        return None
    return SlidingLayout(windows[0], every_layer)


def context_window(model: torch.nn.Module) -> int:
    """The most tokens (prompt and generated) a sequence of `model` may reach in specframe: its
    max_position_embeddings, or its attention window where that is smaller and specframe serves the model only
    inside it (`sliding_layout`) (10**9 without either)."""
    return context_limit(model)[0]


def context_limit(model: torch.nn.Module) -> tuple[int, str]:
    """`context_window`, and what it is in words for messages: "sliding attention window" where that is what ends
    a sequence of `model`, else "context window". Such a model stops as at max_position_embeddings: a window
    counts the tokens a sequence may hold, so the last position fed is w - 2, one short of the last exact one,
    w - 1. Refuses what `new_cache` refuses."""
    positions = getattr(model.config, "max_position_embeddings", None) or 10**9
    _, windows, kinds = _checked_cache(model)  # (once: the cache is built to read them)
    window = min(windows, default=None)
    if window is not None and window <= positions and _layout(model, windows, kinds) is None:
        return window, "sliding attention window"
    return positions, "context window"


def _checked_cache(model: torch.nn.Module) -> tuple[DynamicCache, list[int], list[str]]:
    """`new_cache` and what `attention_window` and `sliding_layout` read: the cache, each sliding layer's window,
    and each layer's type."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)  # (transformers' own list of exceptions)
    if supports is not None and not supports():
        raise BadInputError(
            f"{type(model).__name__} keeps its own kind of cache or state, not a key/value cache that specframe "
            "can roll back; it cannot be used for speculative decoding (as the target or as a draft model)"
        )
    cache = DynamicCache(config=model.config)
    # (transformers gives chunked-attention layers a sliding-window cache layer too: their layer type tells them
    # apart, and they stay refused)
    kinds, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    windows = []
    for i, (layer, kind) in enumerate(zip(cache.layers, kinds, strict=False)):
        if type(layer) is DynamicSlidingWindowLayer and kind == "sliding_attention":
            windows.append(int(layer.sliding_window))
        elif type(layer) is not DynamicLayer:
            raise BadInputError(
                f"{type(model).__name__} uses a {type(layer).__name__} in layer {i} ({kind!r}: a chunked-attention, "
                "hybrid or recurrent cache); specframe can only roll back full-attention and sliding-window "
                "caches, so it refuses this model"
            )
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache, windows, list(kinds)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare room (when full, grown by half
    again, by GROWTH_MIN positions at least): a forward writes only its own positions. `crop` (DynamicLayer's) shortens
    the views; positions past them are overwritten by the next forward. Anything that replaces the views with
    tensors of its own (e.g. `batch_select_indices`, `offload`) is taken over: the buffers are made again."""

    GROWTH_MIN = 256

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        own = _views_into(self.keys, self.key_buffer) and _views_into(self.values, self.value_buffer)
        if not own or end > self.key_buffer.shape[-2] or self.key_buffer.shape[:-2] != key_states.shape[:-2]:
            room = end + max(self.GROWTH_MIN, end // 2)
            self.key_buffer = key_states.new_empty(*key_states.shape[:-2], room, key_states.shape[-1])
            self.value_buffer = value_states.new_empty(*value_states.shape[:-2], room, value_states.shape[-1])
            if length:
                self.key_buffer[..., :length, :] = self.keys
                self.value_buffer[..., :length, :] = self.values
        self.key_buffer[..., length:end, :] = key_states
        self.value_buffer[..., length:end, :] = value_states
        self.keys = self.key_buffer[..., :end, :]
        self.values = self.value_buffer[..., :end, :]
        return self.keys, self.values


def _views_into(view: torch.Tensor | None, buffer: torch.Tensor | None) -> bool:
    """Whether `view` is `buffer`'s first positions (the same start, strides and leading dimensions; `_base` is
    not kept for inference-mode views, so it cannot tell) and `buffer` may be written here (an inference-mode
    tensor only in inference mode)."""
    return (
        view is not None
        and buffer is not None
        and (torch.is_inference_mode_enabled() or not buffer.is_inference())  # (else not writable here)
        and view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and view.shape[:-2] == buffer.shape[:-2]
    )


def keep_positions(cache: DynamicCache, start: int, keep: list[int], n_new: int) -> None:
    """The last `n_new` cache positions start at `start`; keep only those at offsets `keep` (ascending).

    A prefix of the new positions (a chain) is a crop; anything else (a path through a tree) is a gather.
    """
    if keep == list(range(len(keep))):
        if n_new > len(keep):
            cache.crop(-(n_new - len(keep)))
        return
    index = torch.tensor(keep) + start
    on_device: dict[torch.device, torch.Tensor] = {}  # (a model split over devices has its cache split too)
    end = start + len(keep)
    for layer in cache.layers:  # move the kept rows down in place (O(kept), not O(sequence)), then crop
        device = layer.keys.device
        if device not in on_device:
            on_device[device] = index.to(device)
        rows = on_device[device]
        layer.keys[..., start:end, :] = layer.keys.index_select(-2, rows)
        layer.values[..., start:end, :] = layer.values.index_select(-2, rows)
    cache.crop(-(n_new - len(keep)))


def tree_visibility(parents: Sequence[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool (CPU): row r sees column c where c is r or an ancestor of r; row 0 is the root, row
    i + 1 the node whose parent index is `parents[i]` (-1: the root; parents come before their children)."""
    n = len(parents)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True  # everything descends from the root
    for i, parent in enumerate(parents):
        allowed[i + 1] = allowed[parent + 1]
        allowed[i + 1, i + 1] = True
    return allowed


def tree_attention_mask(
    parents: list[int],
    past: int,
    dtype: torch.dtype,
    device: torch.device,
    sliding: SlidingLayout | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive [1, 1, n + 1, past + n + 1] mask: the root and each node see the past, themselves, ancestors.

    With `sliding` (the target's `sliding_layout`), once the tree reaches past the window: a node at position
    p (past + its depth) sees, in sliding layers, only what sits at positions p - window + 1 to p, cached tokens and
    ancestors alike; that one mask where every layer slides, else {"full_attention": the mask above,
    "sliding_attention": that one}."""
    n = len(parents)
    visible = tree_visibility(parents)
    block = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)
    mask = torch.zeros(1, 1, n + 1, past + n + 1, dtype=dtype, device=device)  # (only the block is uploaded)
    mask[0, 0, :, past:] = block.to(device)
    if sliding is None:
        return mask
    depths = visible.sum(1) - 1  # (a row sees the root, its ancestors and itself: depth + 1 rows)
    if past + int(depths.max()) < sliding.window:  # (the window cuts nothing yet)
        return mask
    rows = past + depths.to(device)  # each row's position, then each column's: slots below past are positions
    columns = torch.cat([torch.arange(past, device=device), rows])
    windowed = mask.masked_fill(columns[None, :] <= rows[:, None] - sliding.window, torch.finfo(dtype).min)
    return windowed if sliding.every_layer else {"full_attention": mask, "sliding_attention": windowed}
