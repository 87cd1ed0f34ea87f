import pytest
import torch

from specframe.cpu_gemm import MAX_ROWS, undo_small_batch_gemm, use_small_batch_gemm
from specframe.testing.tiny import tiny_llama


@pytest.mark.parametrize("rows", [1, 2, 5, MAX_ROWS, MAX_ROWS + 1])
def test_small_batch_layout_computes_the_same_linear(rows):
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(1, rows, 24)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert use_small_batch_gemm(layer) == 1
    y = layer(x)
    assert y.shape == expected.shape
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_linears_are_rerouted_and_undo_restores_them():
    model = tiny_llama(vocab_size=16, hidden_size=32)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert use_small_batch_gemm(model) == n_linear
    assert use_small_batch_gemm(tiny_llama(vocab_size=16, dtype=torch.bfloat16)) == 0
    undo_small_batch_gemm(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)


def test_rerouted_target_verifies_the_same_tokens():
    from specframe import SpeculativeDecoder
    from specframe.decoder import target_info
    from specframe.proposers.medusa import MedusaProposer

    plain = tiny_llama(vocab_size=16, hidden_size=32)
    fast = tiny_llama(vocab_size=16, hidden_size=32)
    use_small_batch_gemm(fast)
    outs = []
    for model in (plain, fast):
        dec = SpeculativeDecoder(model, MedusaProposer.random(target_info(model)), max_new_tokens=40)
        outs.append(dec.generate([1, 2, 3, 4]).token_ids)
    assert outs[0] == outs[1]


def test_load_model_applies_it_unless_told_not_to(tiny_dirs):
    from specframe.models import load_model

    on = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True).model
    off = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True, small_batch_gemm=False).model
    assert "forward" in on.lm_head.__dict__ and "forward" not in off.lm_head.__dict__
