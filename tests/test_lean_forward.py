"""The lean Llama forward: bit for bit transformers' forward, and used only where it is."""

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specframe import cpu_kernels, lean_forward
from specframe.cpu_kernels import use_fast_cpu_kernels
from specframe.decoder import target_info
from specframe.kv_cache import keep_positions, new_cache, tree_attention_mask
from specframe.lean_forward import engine_forward, lean_forward_applies, lean_llama_forward
from specframe.proposer import seeded
from specframe.testing.tiny import tiny_llama


def llama(attention: str = "sdpa", **overrides) -> LlamaForCausalLM:
    """A tiny Llama with grouped-query attention (4 heads, 2 key/value heads), 3 layers, a bias in attention."""
    fields = dict(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attention_bias=True, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation=attention,
    )  # fmt: skip
    with seeded(0):
        return LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).eval().requires_grad_(False)


class Scaled(torch.nn.Module):
    """Another module's output times 1.5 (as a library might wrap a model's embeddings)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1.5


def forwards(model, call):
    """Run the same prefill, one-token step, chain, tree (rolled back to a path) and chunk through `call` on a
    cache of its own; the outputs of each."""
    cache = new_cache(model)
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 32, (1, n), generator=g)  # noqa: E731
    outs = [call(input_ids=ids(9), cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)]
    outs.append(call(input_ids=ids(1), cache=cache, use_cache=True, output_hidden_states=True))
    past = cache.get_seq_length()
    outs.append(call(input_ids=ids(3), position_ids=torch.arange(past, past + 3)[None], cache=cache, use_cache=True))
    cache.crop(-2)
    past, parents = cache.get_seq_length(), [-1, -1, 0, 1, 2]
    mask = tree_attention_mask(parents, past, torch.float32, torch.device("cpu"))
    positions = (past + torch.tensor([0, 1, 1, 2, 2, 3]))[None]
    outs.append(
        call(
            input_ids=ids(6), position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
            output_hidden_states=True,
        )
    )  # fmt: skip
    keep_positions(cache, past, [0, 1, 3, 5], 6)
    outs.append(call(input_ids=ids(5), cache=cache, use_cache=True, output_hidden_states=True))
    return outs, cache


def assert_same(model):
    """The lean forward with the layers' own products gives transformers' results bit for bit. (With q/k/v and
    gate/up fused, on specframe's CPU kernels, it is the same up to float rounding in those products: equal on
    some CPUs, not on others, e.g. AVX-512 ones; `test_fused_projections_compute_the_separate_products`.)"""
    with torch.inference_mode():
        expected, expected_cache = forwards(model, model)
        got, got_cache = forwards(model, lambda **kw: lean_llama_forward(model, **kw, fuse_projections=False))
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want.logits, have.logits)
        if want.hidden_states is not None:
            assert len(want.hidden_states) == len(have.hidden_states) == model.config.num_hidden_layers + 1
            for a, b in zip(want.hidden_states, have.hidden_states, strict=True):
                assert torch.equal(a, b)
    for a, b in zip(expected_cache.layers, got_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_it_gives_transformers_logits_hidden_states_and_cache_bit_for_bit(attention):
    model = llama(attention)
    assert lean_forward_applies(model)
    assert_same(model)


@pytest.mark.parametrize("layout", ["few-rows", "stock"])
def test_it_gives_the_same_on_specframes_cpu_kernels(monkeypatch, layout):
    monkeypatch.setattr(cpu_kernels, "layout_choice", layout)
    model = llama()
    use_fast_cpu_kernels(model)
    assert model.config._attn_implementation == cpu_kernels.ATTENTION
    assert lean_forward_applies(model)  # (the rerouted linear layers are specframe's own)
    assert_same(model)


def test_it_follows_the_config_rope_scaling_and_activation():
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    model = llama(rope_parameters=rope, hidden_act="gelu", mlp_bias=True, head_dim=16)
    assert lean_forward_applies(model)
    assert_same(model)


def test_it_is_not_used_where_it_might_differ():
    assert lean_forward_applies(llama())
    model = llama()
    with torch.inference_mode():  # (transformers hooks the layers to record hidden states: those hooks are inert)
        model(input_ids=torch.tensor([[1, 2]]), output_hidden_states=True)
    assert any(layer._forward_hooks for layer in model.model.layers)
    assert lean_forward_applies(model)

    model = llama()
    model.train()
    assert not lean_forward_applies(model)  # (dropout)

    model = llama()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert not lean_forward_applies(model)  # (a hook would not run)
    handle.remove()
    assert lean_forward_applies(model)

    model = llama()
    model.model.layers[0].self_attn.q_proj.forward = lambda x: x  # (another library's override)
    assert not lean_forward_applies(model)

    model = llama()
    model.model.layers[2].mlp = torch.nn.Identity()  # (a module of another class where it writes one out)
    assert not lean_forward_applies(model)

    model = llama()  # (a module of another class that it calls as it is: fine)
    model.model.embed_tokens = Scaled(model.model.embed_tokens)
    assert lean_forward_applies(model)
    assert_same(model)

    model = llama()
    model.config._attn_implementation = "flash_attention_2"
    assert not lean_forward_applies(model)

    subclass = type("MyLlama", (LlamaForCausalLM,), {})
    model = llama()
    model.__class__ = subclass
    assert not lean_forward_applies(model)
    assert engine_forward(model) is model

    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not lean_forward_applies(llama())
    finally:
        handle.remove()


def test_it_needs_a_cache():
    model = llama()
    with pytest.raises(ValueError, match="runs with a cache"):
        lean_llama_forward(model, input_ids=torch.tensor([[1]]), cache=None)


def test_the_decoder_runs_it_and_decodes_the_same_tokens(monkeypatch):
    from specframe import SpeculativeDecoder
    from specframe.decoder import target_info
    from specframe.proposers.medusa import MedusaProposer

    calls = []
    lean = lean_forward.lean_llama_forward
    monkeypatch.setattr(lean_forward, "lean_llama_forward", lambda *a, **kw: calls.append(1) or lean(*a, **kw))
    outs = []
    for hooked in (False, True):
        model = tiny_llama(vocab_size=16, hidden_size=32)
        if hooked:  # (transformers' forward: a hook keeps the lean one out)
            model.model.register_forward_hook(lambda *a: None)
        proposer = MedusaProposer.random(target_info(model))  # (a tree, and the target's hidden states)
        assert proposer.hidden_state_layers and len(proposer.tree) > 1
        dec = SpeculativeDecoder(model, proposer, max_new_tokens=30)
        engine_forward(model)  # (its first-use check, outside the count)
        before = len(calls)
        result = dec.generate([1, 2, 3, 4])
        assert (len(calls) - before == result.stats["target_forwards"]) != hooked
        outs.append(result.token_ids)
    assert outs[0] == outs[1]


def test_the_decoder_checks_it_and_plans_the_stacked_products_when_built(monkeypatch):
    """The first-use check and the layout plans of the stacked q/k/v and gate/up products happen when the
    decoder is built, not inside the first generate call (whose tokens/s they would lower)."""
    from specframe import SpeculativeDecoder
    from specframe.proposers.none import NoneProposer

    monkeypatch.setattr(cpu_kernels, "layout_choice", "measure")
    monkeypatch.setattr(cpu_kernels, "_plans", {})
    measured = []

    def measure(weight):
        measured.append(tuple(weight.shape))
        return (cpu_kernels.STOCK,) + (cpu_kernels.FEW_ROWS,) * cpu_kernels.MAX_ROWS

    monkeypatch.setattr(cpu_kernels, "measure_layouts", measure)
    model = llama()
    use_fast_cpu_kernels(model)
    checks = []
    same = lean_forward.same_as_transformers
    monkeypatch.setattr(lean_forward, "same_as_transformers", lambda m: checks.append(1) or same(m))
    dec = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=4)
    assert checks == [1] and {(32 + 2 * 16, 32), (2 * 48, 32)} <= set(measured)  # (q+k+v and gate+up rows)
    before = list(measured)
    dec.generate([1, 2, 3])
    assert checks == [1] and measured == before


def test_it_is_checked_against_transformers_once_on_first_use(monkeypatch):
    model = llama()
    assert isinstance(engine_forward(model), functools.partial)  # (the same on this model: used)
    checks = []
    monkeypatch.setattr(lean_forward, "same_as_transformers", lambda m: checks.append(m) or True)
    engine_forward(model)
    assert checks == []  # (checked once per device, dtype and attention)
    model.config._attn_implementation = "eager"
    engine_forward(model)
    assert checks == [model]

    # A transformers version whose Llama code the lean forward no longer follows: found, and not used.
    monkeypatch.undo()
    lean = lean_forward.lean_llama_forward

    def drifted(*args, **kwargs):
        out = lean(*args, **kwargs)
        return out._replace(logits=out.logits + 1e-6)

    monkeypatch.setattr(lean_forward, "lean_llama_forward", drifted)
    model = llama()
    assert not lean_forward.same_as_transformers(model)
    assert engine_forward(model) is model


def test_a_lean_forward_that_fails_on_a_model_leaves_it_to_transformers(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a Llama variant it does not know")

    monkeypatch.setattr(lean_forward, "lean_llama_forward", broken)
    model = llama()
    assert engine_forward(model) is model


def lean_outputs(model, **kw):
    with torch.inference_mode():
        outs, cache = forwards(model, lambda **call: lean_llama_forward(model, **call, **kw))
    return [o.logits for o in outs] + [h for o in outs for h in o.hidden_states or ()], cache


@pytest.mark.parametrize("layout", ["measure", "few-rows", "stock"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_projections_compute_the_separate_products(monkeypatch, layout, bias):
    monkeypatch.setattr(cpu_kernels, "layout_choice", layout)
    model = llama(attention_bias=bias, mlp_bias=bias)
    use_fast_cpu_kernels(model)
    separate, separate_cache = lean_outputs(model, fuse_projections=False)
    fused, fused_cache = lean_outputs(model)
    layers = lean_forward.fused_projections(model)
    assert len(layers) == 3 and all(layer is not None for layer in layers)
    for layer, both in zip(model.model.layers, layers, strict=True):  # (the layers' weights are views of them)
        attn, mlp = layer.self_attn, layer.mlp
        assert torch.equal(both.qkv_weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        assert attn.k_proj.weight.data_ptr() == both.qkv_weight[32:].data_ptr()
        assert mlp.up_proj.weight.data_ptr() == both.gate_up_weight[48:].data_ptr()
        assert (both.qkv_bias is None) != bias and (both.gate_up_bias is None) != bias
    for a, b in zip(separate, fused, strict=True):  # (one product or three: float rounding at most)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(separate_cache.layers, fused_cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        assert_same(model)  # (transformers' forward reads the fused buffers through the views: the same weights)


def test_fused_projections_follow_weights_changed_in_place_or_replaced():
    model = llama()
    use_fast_cpu_kernels(model)
    lean_outputs(model)  # (fused)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)  # (in place: the fused buffer is the same memory)
        attn.q_proj.weight = torch.nn.Parameter(torch.randn(32, 32), requires_grad=False)  # (replaced: fused again)
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([[1, 2, 3]]), cache=new_cache(model), use_cache=True).logits
        have = lean_llama_forward(model, input_ids=torch.tensor([[1, 2, 3]]), cache=new_cache(model)).logits
    torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    both = engine_forward(model).keywords["fused"][1]  # (what the engine runs: checked once per generation)
    assert (
        torch.equal(both.qkv_weight[:32], attn.q_proj.weight)
        and attn.q_proj.weight.data_ptr() == both.qkv_weight.data_ptr()
    )


def test_projections_are_fused_only_on_specframes_cpu_kernels_and_compatible_layers(monkeypatch):
    model = llama()
    assert lean_forward.fused_projections(model) is None  # (stock kernels: transformers' products as they are)
    use_fast_cpu_kernels(model)
    model.model.layers[0].self_attn.k_proj.bias = None  # (q and v have biases, k none: not one product)
    gate = model.model.layers[0].mlp.gate_proj.weight
    layers = lean_forward.fused_projections(model)
    assert layers[0] is None and layers[1] is not None
    # (the layer that cannot fuse keeps all its weights as they were, and is not tried again while they stay)
    assert gate.data_ptr() == model.model.layers[0].mlp.gate_proj.weight.data_ptr()
    monkeypatch.setattr(lean_forward, "_fuse_layer", lambda layer: pytest.fail("fused again"))
    assert lean_forward.fused_projections(model)[0] is None
    with cpu_kernels.stock_kernels(model):
        assert lean_forward.fused_projections(model) is None


def test_a_model_with_fused_projections_saves_and_loads_its_weights(tmp_path):
    model = llama()
    use_fast_cpu_kernels(model)
    lean_outputs(model)
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_its_rotary_embedding_and_norms_are_transformers_bit_for_bit(tokens):
    """The fused path rotates q and k as one tensor, and float32 norms run as one `rms_norm` call: both give
    exactly what transformers' `apply_rotary_pos_emb` and `LlamaRMSNorm.forward` give, on the strided views that
    a fused q/k/v product hands them."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    with seeded(tokens):
        qkv = torch.randn(2, tokens, (6 + 2 + 2) * 8) * 3  # 6 query heads, 2 key/value heads, head_dim 8
        cos, sin = torch.randn(2, tokens, 8), torch.randn(2, tokens, 8)
        norm = LlamaRMSNorm(80, eps=1e-5)
        norm.weight.data.normal_()
    heads = (2, tokens, -1, 8)
    query, key = (qkv[..., a:b].view(heads).transpose(1, 2) for a, b in ((0, 48), (48, 64)))
    expected = apply_rotary_pos_emb(query, key, cos, sin)
    both = lean_forward._rotated(qkv[..., :64].view(heads).transpose(1, 2), cos, sin).split((6, 2), dim=1)
    assert all(torch.equal(a, b) for a, b in zip(expected, both, strict=True))
    assert torch.equal(lean_forward._rms_norm(norm, qkv[..., :80]), norm.forward(qkv[..., :80]))
    half = norm.to(torch.bfloat16)  # (another dtype: the module's own forward)
    assert torch.equal(lean_forward._rms_norm(half, qkv.bfloat16()[..., :80]), half.forward(qkv.bfloat16()[..., :80]))
