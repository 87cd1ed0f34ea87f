"""The target's KV cache and its rollback: keep exactly the accepted path after each verification."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specframe.errors import BadInputError


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache for `model`, refused (bad input: the user chose the model) when some layer could not be
    rolled back exactly. Cheap: the decoder and the draft proposer also call it when they are built."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)  # (transformers' own list of exceptions)
    if supports is not None and not supports():
        raise BadInputError(
            f"{type(model).__name__} keeps its own kind of cache or state, not a key/value cache that specframe "
            "can roll back; it cannot be used for speculative decoding (as the target or as a draft model)"
        )
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise BadInputError(
                f"{type(model).__name__} uses a {type(layer).__name__} in layer {i} (sliding-window, hybrid or "
                "recurrent cache); specframe can only roll back full-attention caches, so it refuses this model"
            )
    return cache


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


def tree_attention_mask(parents: list[int], past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, n + 1, past + n + 1] mask: the root and each node see the past, themselves, ancestors."""
    n = len(parents)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True  # everything descends from the root
    for i, parent in enumerate(parents):
        allowed[i + 1] = allowed[parent + 1]
        allowed[i + 1, i + 1] = True
    mask = torch.zeros(1, 1, n + 1, past + n + 1, dtype=dtype)
    mask[0, 0, :, past:] = torch.where(allowed, 0.0, torch.finfo(dtype).min)
    return mask.to(device)
