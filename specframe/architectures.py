"""What the engine must know about a target model's architecture: whether its attention applies a token tree's
mask, where it reads positions from, where a LongRoPE rotary embedding switches factors, and which ids end its
generation."""

from __future__ import annotations

from typing import Any

import torch

from specframe.cpu_kernels import ATTENTION
from specframe.errors import BadInputError

TREE_ATTENTION = ("eager", "sdpa", ATTENTION)  # attention implementations that apply a 4-D float mask


def check_tree_attention(model: torch.nn.Module) -> None:
    """Tree verification needs the target's attention to apply an arbitrary 4-D mask (others, e.g. flash
    attention, would silently attend across branches) and to see positions only through `position_ids`."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None and impl not in TREE_ATTENTION:
        raise BadInputError(
            f"the target's attention implementation '{impl}' cannot apply a token tree's attention mask: load it "
            "with attn_implementation='sdpa' (or 'eager') to verify trees"
        )
    why = slot_positions(config)
    if why:
        raise BadInputError(
            f"the target (model type '{getattr(config, 'model_type', '?')}') {why}, so the nodes of a token tree, "
            "which sit side by side in the cache, would be scored at the wrong distances: use a proposer that "
            "drafts chains (e.g. draft, or eagle with proposer.tree=false)"
        )


# Model types whose transformers generation drops the KV cache and recomputes the whole sequence, with the long
# factors, when it reaches original_max_position_embeddings + 1 tokens (their prepare_inputs_for_generation).
RECOMPUTE_AT_LONGROPE_SWITCH = ("phi3", "phimoe", "phi4_multimodal")


def longrope_switch(config: Any) -> int | None:
    """The position from which a `longrope` target (Phi-3 style) rotates with its long factors, else None.
    transformers picks the short or long factors once per forward, for every row, by the forward's largest
    position: a verification whose drafts reach this position would rotate the rows before it (and the keys it
    caches for them) with the long factors, where plain decoding uses the short ones. So the engine never
    verifies across it: until the root reaches it, drafts stop short of it (for RECOMPUTE_AT_LONGROPE_SWITCH
    models the step whose root is at it drafts nothing and recomputes the sequence, as their generation does)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    per_layer_type = "rope_type" not in params and "type" not in params  # ({layer type: its parameters})
    found = [p for p in params.values() if isinstance(p, dict)] if per_layer_type else [params]
    switches = [
        p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        for p in found
        if (p.get("rope_type") or p.get("type")) in ("longrope", "su")  # ("su": its name in older Phi-3 configs)
    ]
    switches = [int(s) for s in switches if s]
    return min(switches) if switches else None


def slot_positions(config: Any) -> str | None:
    """How a model reads positions from cache slots rather than from `position_ids` (None when it does not):
    ALiBi biases (Bloom, MPT, Falcon with `alibi`) and GPT-Neo's local-attention windows are computed from
    slots, which equal positions in a chain but not in a tree."""
    model_type = getattr(config, "model_type", None)
    if model_type in ("bloom", "mpt") or getattr(config, "alibi", False):  # (MPT adds ALiBi whatever its config says)
        return "adds ALiBi attention biases by cache slot"
    if model_type == "gpt_neo" and "local" in (getattr(config, "attention_layers", None) or []):
        return "applies its local-attention window by cache slot"
    return None


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """The ids that end generation: the model's generation_config EOS ids and the tokenizer's EOS (transformers'
    `generate` reads only the former; a chat model whose turns end with the tokenizer's EOS would otherwise run
    past its answer where the config leaves it out)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(t) for t in source)
    return ids
