"""Rolling the target's KV cache back to the accepted path of a token tree."""

import pytest
import torch
from transformers import DynamicCache

from specframe.errors import BadInputError
from specframe.kv_cache import keep_positions, new_cache
from specframe.testing.tiny import tiny_llama


def cache_of(devices, length=6):
    """A cache whose layer i (on devices[i]) holds position p's key and value as the number 10 * i + p."""
    cache = DynamicCache()
    for i, device in enumerate(devices):
        rows = (10 * i + torch.arange(length, dtype=torch.float32)).reshape(1, 1, length, 1).to(device)
        cache.update(rows, rows.clone(), i)
    return cache


def test_a_tree_path_is_gathered_and_the_rest_cropped():
    cache = cache_of(["cpu", "cpu"])
    keep_positions(cache, start=2, keep=[0, 2, 3], n_new=4)  # positions 2..5 were verified; 2, 4, 5 accepted
    for i, layer in enumerate(cache.layers):
        assert layer.keys.flatten().tolist() == [10 * i + p for p in (0, 1, 2, 4, 5)]
        assert layer.values.flatten().tolist() == [10 * i + p for p in (0, 1, 2, 4, 5)]


def test_a_cache_split_over_devices_is_gathered_on_each_device():
    # (a model spread over devices keeps each layer's cache on its own device; "meta" stands in for a GPU here)
    cache = cache_of(["meta", "cpu"])
    keep_positions(cache, start=2, keep=[0, 3], n_new=4)
    assert cache.layers[0].keys.shape[-2] == 4 and cache.layers[0].keys.device.type == "meta"
    assert cache.layers[1].keys.flatten().tolist() == [10, 11, 12, 15]
    assert cache.layers[1].values.flatten().tolist() == [10, 11, 12, 15]


def test_a_model_without_a_key_value_cache_is_refused():
    # transformers marks models whose state is not a DynamicCache (RWKV, xLSTM, XLNet, ...) by class name
    model = tiny_llama(vocab_size=8, seed=0)
    assert new_cache(model).layers  # a Llama's cache rolls back
    model.__class__ = type("TinyRwkvForCausalLM", (type(model),), {})
    with pytest.raises(BadInputError, match="TinyRwkvForCausalLM keeps its own kind of cache"):
        new_cache(model)


def test_a_chunked_attention_target_is_refused_when_the_decoder_is_built_and_by_distill_and_training(tmp_path):
    # (distilling or training for a target that the decoder refuses would make data and weights never used;
    # transformers gives chunked-attention layers, Llama 4's, the cache layer class of sliding-window ones, which
    # specframe serves: the layer type tells them apart)
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from specframe import SpeculativeDecoder
    from specframe.data import distill
    from specframe.decoder import target_info
    from specframe.proposers.none import NoneConfig, NoneProposer
    from specframe.training.common import start_run
    from specframe.training.eagle import EagleTrainConfig

    config = Llama4TextConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, intermediate_size_mlp=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, attention_chunk_size=8, num_local_experts=1,
    )  # fmt: skip
    model = Llama4ForCausalLM(config)
    refused = r"uses a DynamicSlidingWindowLayer in layer 0 \('chunked_attention': a chunked-attention"
    with pytest.raises(BadInputError, match=refused):
        SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
    with pytest.raises(BadInputError, match=refused):
        distill(model, None, [{"id": "p", "text": "hi"}], tmp_path / "d.jsonl", quiet=True)
    assert not (tmp_path / "d.jsonl").exists()
    (tmp_path / "d.jsonl").write_text('{"id": "p", "prompt_ids": [1], "response_ids": [2, 3]}\n')
    with pytest.raises(BadInputError, match=refused):
        start_run(EagleTrainConfig(data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o")), model, None)


def test_the_growing_cache_writes_in_place_and_matches_the_dynamic_one():
    """`new_cache`'s layers grow a buffer: a forward writes only its own positions (the buffer is kept until
    full), a crop or a kept tree path shortens the view, and the logits equal those with transformers' own
    concatenating cache, through prefill, chunks, crops, a tree gather and a regrowth."""
    from specframe.kv_cache import GrowingLayer

    model = tiny_llama(vocab_size=16, hidden_size=32)
    ours, theirs = new_cache(model), DynamicCache(config=model.config)
    assert all(type(layer) is GrowingLayer for layer in ours.layers)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # (as the decoder runs: views there keep no `_base`)
        for step, (n, drop) in enumerate([(5, 0), (3, 2), (1, 0), (4, 1), (300, 0), (2, 2)]):
            ids = torch.randint(0, 16, (1, n), generator=gen)
            logits = [model(input_ids=ids, cache=c, use_cache=True).logits for c in (ours, theirs)]
            torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
            if step == 1:
                buffer = ours.layers[0].key_buffer
            if step == 3:
                assert ours.layers[0].key_buffer is buffer  # (not reallocated while there was room)
                for c in (ours, theirs):
                    keep_positions(c, start=c.get_seq_length() - n, keep=[0, 2], n_new=n)
            elif drop:
                ours.crop(-drop)
                theirs.crop(-drop)
            assert ours.get_seq_length() == theirs.get_seq_length()
            for a, b in zip(ours.layers, theirs.layers, strict=True):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert ours.layers[0].key_buffer is not buffer  # (300 more positions: grown)


def test_the_growing_cache_takes_over_keys_replaced_from_outside():
    """A layer whose views were replaced by tensors of their own (here `batch_repeat_interleave`) makes its
    buffers again from them, on the next update."""
    model = tiny_llama(vocab_size=16, hidden_size=32)
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
        cache.batch_repeat_interleave(2)
        out = model(input_ids=torch.tensor([[4], [4]]), cache=cache, use_cache=True).logits
        alone = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits[:, -1:]
    torch.testing.assert_close(out, alone.expand(2, -1, -1), rtol=1e-5, atol=1e-5)
    layer = cache.layers[0]
    assert layer.keys.shape[0] == 2 and layer.keys.data_ptr() == layer.key_buffer.data_ptr()


def test_a_cache_filled_in_inference_mode_goes_on_outside_it():
    """Buffers made in inference mode cannot be written outside it: a forward there makes them again."""
    model = tiny_llama(vocab_size=16, hidden_size=32)
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[4]]), cache=cache, use_cache=True).logits
        alone = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits[:, -1:]
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
    assert not cache.layers[0].key_buffer.is_inference()
