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


def test_a_sliding_window_target_is_refused_when_the_decoder_is_built():
    from transformers import MistralConfig, MistralForCausalLM

    from specframe import SpeculativeDecoder
    from specframe.decoder import target_info
    from specframe.proposers.none import NoneConfig, NoneProposer

    config = MistralConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
    )
    model = MistralForCausalLM(config)
    with pytest.raises(BadInputError, match="uses a DynamicSlidingWindowLayer in layer 0"):
        SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
