"""The target's forward without transformers' per-module machinery, for Llama models: the same results, bit for bit
(on specframe's CPU kernels, with q/k/v and gate/up each as one product: the same up to float rounding there).

A SmolLM2-135M forward on a few tokens runs ~400 modules of tiny work each; on a 2-core CPU, transformers' and
PyTorch's machinery around them (module calls and hooks, keyword plumbing, output recording) took 5-10 ms of a
55-110 ms forward (1-16 tokens after 300 cached, measured 2026-12-03 on the Intel Xeon machine,
docs/models.md). The engine's forwards, from the prefill to each verification, and a Llama draft model's, run
`lean_llama_forward` instead wherever it gives the same result (`lean_forward_applies`, and
`same_as_transformers` on first use): the same operations on the same tensors in the same order, through
transformers' own mask builder, rotary embedding, attention function and activation, and through each linear
layer's own `forward` (specframe's CPU kernels included); float32 RMS norms run as PyTorch's one `rms_norm` call,
the same operations in C++ (~10 us less each), and q and k are rotated by the rotary embedding as written here,
transformers' `apply_rotary_pos_emb` in fewer calls. What it leaves out is the module-call
machinery: so a model with hooks, a replaced `forward`, a written-out module of another class, or in training
mode keeps transformers' forward, as does every other model type.

On a model given specframe's CPU kernels (float32 on a CPU), each layer's three attention projections read the
same input, and so do the MLP's gate and up: one product over their weights stacked reads them as fast as the
larger layers and costs one call instead of three and two (`fused_projections`). The layers' weights become views
of the stacked buffers, so nothing is stored twice and both forwards read the same numbers (q and k, side by side
in the product's output, are then rotated as one tensor: the same elementwise operations, one call instead of two;
with the norms above, a SmolLM2 forward of one token took 25.7 ms instead of 27.0, AMD EPYC, 2026-12-04); only the
summation order of those products can differ (on SmolLM2-135M the logits were bit-identical on 4 tokens), so the
first-use check compares transformers' forward with the lean one's separate products, which copy it exactly."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specframe.block_weights import blocks_available, joined_blocks, remember_blocks, tensor_version, weight_blocks
from specframe.cpu_kernels import (
    ATTENTION,
    drop_derived_copies,
    fast_kernels_on,
    few_rows_linear,
    forget_outdated,
    is_rerouted,
    plan_layouts_now,
)


class LeanOutput(NamedTuple):
    """What the engine reads of a forward: as transformers' `CausalLMOutputWithPast` names it."""

    logits: torch.Tensor  # [batch, kept positions, vocab]
    hidden_states: tuple[torch.Tensor, ...] | None  # the embeddings, each layer's output, the last one normed


class FusedProjections(NamedTuple):
    """A decoder layer's products that read the same input, as one product each. The layer's own weights (and
    biases) are views of these buffers, so both read the same memory and an in-place change of a weight is seen
    by both; `fused_projections` keeps the addresses the views had when fused, so a weight replaced is seen."""

    qkv_weight: torch.Tensor  # [q; k; v] projection weights, one contiguous buffer
    qkv_bias: torch.Tensor | None  # their biases likewise, or None where the layer has none
    qkv_sizes: tuple[int, int, int]  # output features of q, k and v
    gate_up_weight: torch.Tensor  # [gate; up] of the MLP
    gate_up_bias: torch.Tensor | None
    gate_size: int  # output features of gate (= of up)


ATTENTIONS = ("eager", "sdpa", ATTENTION)  # attention implementations tested to give the same result


def lean_forward_applies(model: torch.nn.Module) -> bool:
    """Whether `lean_llama_forward` computes exactly what `model(...)` would: a transformers LlamaForCausalLM in
    eval mode, with eager or SDPA attention, whose model, decoder layers, attention and MLP modules (the ones
    it writes out) are of Llama's own classes, and no module of which has hooks (but the inert ones of
    `_records_outputs`) or a replaced `forward` (but a linear layer's by specframe's CPU kernels). The other
    modules (embeddings, norms, rotary embedding, linear layers, activations) it calls as they are."""
    from transformers.models.llama import modeling_llama as llama

    if type(model) is not llama.LlamaForCausalLM or model.training or _global_hooks():
        return False
    if model.config._attn_implementation not in ATTENTIONS or type(model.model) is not llama.LlamaModel:
        return False
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        if type(layer) is not llama.LlamaDecoderLayer:
            return False
        if type(layer.self_attn) is not llama.LlamaAttention or type(layer.mlp) is not llama.LlamaMLP:
            return False
    for module in model.modules():
        if module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return False
        if not all(map(_records_outputs, module._forward_hooks.values())):
            return False
        if "forward" in module.__dict__ and not is_rerouted(module):
            return False
    return True


def _records_outputs(hook: Callable[..., Any]) -> bool:
    """Whether a forward hook is one transformers puts on layers at their first forward to record their outputs
    (`output_hidden_states`): it does nothing outside transformers' own forward, so the lean forward can skip it."""
    return (
        getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
        and getattr(hook, "__name__", None) == "output_capturing_hook"
    )


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_module_registration_hooks
    )


def engine_forward(model: torch.nn.Module) -> Callable[..., Any]:
    """The function to run `model`'s forwards with: `lean_llama_forward` on it where that gives the same result
    (`lean_forward_applies`, and `same_as_transformers` on first use), else the model itself; both take the
    keywords of `lean_llama_forward` and return `.logits` and `.hidden_states`."""
    if fast_kernels_on(model):
        forget_outdated_copies(model)
    if not lean_forward_applies(model):
        return model
    weight = model.get_input_embeddings().weight
    checked = model.__dict__.setdefault(_CHECKED, {})
    where = (weight.device, weight.dtype, model.config._attn_implementation)
    if where not in checked:
        try:
            checked[where] = same_as_transformers(model)
        except Exception:  # (the lean forward failing where transformers' works: that one is used)
            checked[where] = False
    if not checked[where]:
        return model
    # (the fused products checked against the layers' weights here, once per call, not in every forward)
    return functools.partial(lean_llama_forward, model, fused=fused_projections(model))


_CHECKED = "_specframe_lean_forward_checked"  # a model's attribute: (device, dtype, attention) -> checked the same


def same_as_transformers(model: torch.nn.Module) -> bool:
    """Whether `lean_llama_forward` and `model(...)` give the same logits and hidden states, bit for bit, on a
    short prefill and then a two-node tree (a check of this transformers version's Llama code on this model and
    device: the lean forward copies that code)."""
    from specframe.kv_cache import new_cache, tree_attention_mask

    weight = model.get_input_embeddings().weight
    device, dtype = weight.device, weight.dtype
    ids = torch.arange(6, device=device)[None] % model.config.vocab_size
    mask = tree_attention_mask([-1, -1], 3, dtype, device)
    positions = torch.tensor([[3, 4, 4]], device=device)
    outputs = []
    with torch.inference_mode():
        for run in (model, functools.partial(lean_llama_forward, model, fuse_projections=False)):
            cache = new_cache(model)
            prefill = run(input_ids=ids[:, :3], cache=cache, use_cache=True, output_hidden_states=True)
            tree = run(
                input_ids=ids[:, 3:], position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                output_hidden_states=True,
            )  # fmt: skip
            outputs.append([out.logits for out in (prefill, tree)] + [*prefill.hidden_states, *tree.hidden_states])
    return all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))


def lean_llama_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: Any,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    output_hidden_states: bool = False,
    logits_to_keep: int = 0,
    use_cache: bool = True,
    fuse_projections: bool = True,
    fused: Sequence[FusedProjections | None] | None = None,
) -> LeanOutput:
    """`model(input_ids=..., cache=..., ...)` for a LlamaForCausalLM that `lean_forward_applies` to, written out
    as transformers 5's LlamaModel, decoder layer, attention and MLP compute it (the hidden states as
    `output_hidden_states=True` returns them). With `fuse_projections`, on a model given specframe's CPU kernels,
    each layer's q, k and v products run as one, and so do the MLP's gate and up (`fused_projections`): the
    same weights, so the same result up to float rounding in those products. `fused`: what `fused_projections`
    returned for the model, if no weight was replaced since (`engine_forward` passes it; checking every layer's
    weights costs ~1 ms, so it is done once per generation, not per forward); None: checked here."""
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if not use_cache or cache is None:
        raise ValueError("lean_llama_forward runs with a cache (use_cache=True and a cache)")
    inner, config = model.model, model.config
    hidden = inner.embed_tokens.forward(input_ids)
    if position_ids is None:
        position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + cache.get_seq_length())[None]
    mask = create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache, position_ids=position_ids
    )
    cos, sin = inner.rotary_emb.forward(hidden, position_ids=position_ids)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    states = [hidden] if output_hidden_states else None
    batch_shape = hidden.shape[:-1]
    if not fuse_projections:
        fused = None
    elif fused is None:
        fused = fused_projections(model)
    for i, layer in enumerate(inner.layers[: config.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        both = fused[i] if fused is not None else None
        residual = hidden
        hidden = _rms_norm(layer.input_layernorm, hidden)
        heads_shape = (*batch_shape, -1, attn.head_dim)
        if both is None:
            qkv = (attn.q_proj.forward(hidden), attn.k_proj.forward(hidden), attn.v_proj.forward(hidden))
            query, key, value = (projected.view(heads_shape).transpose(1, 2) for projected in qkv)
            query, key = _rotated(query, cos, sin), _rotated(key, cos, sin)
        else:
            qkv = few_rows_linear(hidden, both.qkv_weight, both.qkv_bias)
            q_size, k_size, _ = both.qkv_sizes
            value = qkv[..., q_size + k_size :].view(heads_shape).transpose(1, 2)
            # q and k rotated as one tensor (their heads side by side): the same operations on every element
            query_key = _rotated(qkv[..., : q_size + k_size].view(heads_shape).transpose(1, 2), cos, sin)
            query, key = query_key.split((q_size // attn.head_dim, k_size // attn.head_dim), dim=1)
        key, value = cache.update(key, value, attn.layer_idx)
        out, _ = attention(
            attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling, position_ids=position_ids, use_cache=True
        )
        hidden = residual + attn.o_proj.forward(out.reshape(*batch_shape, -1).contiguous())
        residual = hidden
        hidden = _rms_norm(layer.post_attention_layernorm, hidden)
        if both is None:
            gate, up = mlp.gate_proj.forward(hidden), mlp.up_proj.forward(hidden)
        else:
            gate, up = few_rows_linear(hidden, both.gate_up_weight, both.gate_up_bias).split(both.gate_size, dim=-1)
        hidden = mlp.down_proj.forward(mlp.act_fn(gate) * up)
        hidden = residual + hidden
        if states is not None:
            states.append(hidden)
    hidden = _rms_norm(inner.norm, hidden)
    if states is not None:
        states[-1] = hidden  # (transformers returns the last layer's output after the final norm)
    kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    return LeanOutput(model.lm_head.forward(kept), tuple(states) if states is not None else None)


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`norm.forward(hidden)` for a LlamaRMSNorm: on float32 as PyTorch's one `rms_norm` call, which computes the
    same operations in the same order (mean of squares, plus eps, reciprocal square root, times the input, times
    the weight; `same_as_transformers` checks it) without a Python-level call for each (~10 us less a norm)."""
    if type(norm) is LlamaRMSNorm and hidden.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return torch.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.forward(hidden)


def _rotated(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `heads` ([batch, heads, tokens, head_dim]) as transformers' Llama
    `apply_rotary_pos_emb` computes it for q and for k: `x * cos + rotate_half(x) * sin` (the separate products'
    path uses it too, so `same_as_transformers` checks it against the installed transformers)."""
    half = heads.shape[-1] // 2
    rotated_half = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    return heads * cos.unsqueeze(1) + rotated_half * sin.unsqueeze(1)


_FUSED = "_specframe_fused_projections"  # a model's attribute: its layers' FusedProjections (or None each)


def fused_projections(model: torch.nn.Module) -> list[FusedProjections | None] | None:
    """Each decoder layer's FusedProjections, for a model given specframe's CPU kernels (else None): made on first
    use, and made again for a layer whose weights were replaced since (another tensor, dtype or device). A layer
    fuses where its five weights are float32 CPU tensors with the same input size and q, k, v (and gate, up)
    all have biases or none (else None: it runs the separate products). Fusing makes the layers' weights views of
    the new buffers (`param.data`), so it costs no memory after the copy; on SmolLM2-135M one product instead of
    three and of two was 7-13% faster on a few rows (AMD EPYC, 2026-12-04, docs/models.md)."""
    if not fast_kernels_on(model):
        return None
    layers = model.model.layers[: model.config.num_hidden_layers]
    known = model.__dict__.get(_FUSED)
    if known is None or len(known) != len(layers):
        known = model.__dict__[_FUSED] = [((), None)] * len(layers)
    for i, layer in enumerate(layers):
        if known[i][0] != _layer_ptrs(layer):  # (a layer that cannot fuse is remembered too, by its weights)
            both = _fuse_layer(layer)
            known[i] = (_layer_ptrs(layer), both)
    return [both for _, both in known]


def forget_outdated_copies(model: torch.nn.Module) -> int:
    """Drop what specframe's CPU kernels derived from `model`'s weights and buffers (blocks, MKL-packed copies, the
    lean forward's stacked layers) where the numbers changed since, also where no version counter shows it (through
    `.data`, as PEFT's `merge_and_unload` adds its update; a new tensor put in a weight's place): a sample of each
    weight's numbers, and of each stacked buffer's, against the one taken when its copies were made. Returns how
    many weights and buffers had changed. Generation calls it for the target at every start (~4 ms for
    SmolLM2-135M); call it after such a change before running the model through its own `forward`."""
    fused = model.__dict__.get(_FUSED) or []
    stacked = [t for _, both in fused if both is not None for t in (both.qkv_weight, both.gate_up_weight)]
    changed = forget_outdated([*model.parameters(), *model.buffers(), *stacked])  # (EAGLE's head is a buffer)
    if changed:  # (a stacked buffer, or a weight it was stacked from, holds other numbers now: stacked again)
        model.__dict__.pop(_FUSED, None)
    return changed


def _layer_ptrs(layer: torch.nn.Module) -> tuple[int, ...]:
    """The addresses and version counters of a decoder layer's q, k, v, gate and up weights and biases (0 for
    none). The versions matter: a fused weight is a view of the layer's buffer with a counter of its own, so a
    change through it in place (`load_state_dict`, an optimizer step, `mul_` under no_grad) leaves the buffer's
    counter, and so its blocks and packed copies, as they were: the layer is fused again instead."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    tensors = [t for m in linears for t in (m.weight, m.bias)]
    return tuple(n for t in tensors for n in ((t.data_ptr(), tensor_version(t)) if t is not None else (0, 0)))


def _fuse_layer(layer: torch.nn.Module) -> FusedProjections | None:
    attn, mlp = layer.self_attn, layer.mlp
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
    if not all(map(_fusable, groups)):  # (both or neither: a layer's weights are left as they are)
        return None
    qkv, gate_up = (_fuse(group) for group in groups)
    sizes = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
    return FusedProjections(*qkv, sizes, *gate_up, mlp.gate_proj.out_features)


def _fusable(linears: tuple[torch.nn.Linear, ...]) -> bool:
    """Whether `linears` can share one product: float32 CPU weights of one input size, all with biases or none."""
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if not all(w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 for w in weights):
        return False
    if len({w.shape[1] for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return False
    return biases[0] is None or all(b.dtype == torch.float32 and b.device.type == "cpu" for b in biases)


def _fuse(linears: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight buffer (and bias buffer) for `linears` (`_fusable`), their own weights (biases) made views of it."""
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    blocks = [weight_blocks(w) if blocks_available() else None for w in weights]
    with torch.inference_mode(False), torch.no_grad():  # (plain tensors: a model may be trained after)
        weight = torch.cat([w.detach() for w in weights])
        bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        sizes = [w.shape[0] for w in weights]
        joined, blocks = joined_blocks(blocks)
        for m, w, found in zip(linears, weight.split(sizes), blocks, strict=True):
            drop_derived_copies(m.weight)  # (packed copies made again for the view where used)
            m.weight.data = w
            remember_blocks(m.weight, found)  # (the same numbers: the same blocks, now views of the joined ones)
        remember_blocks(weight, joined)
        if bias is not None:
            for m, b in zip(linears, bias.split(sizes), strict=True):
                m.bias.data = b
    plan_layouts_now(weight)  # (as a layer's own are planned at load, not inside the first forwards' time)
    return weight, bias
