"""Rounding a proposer's own weights to GGUF's Q8_0 grid (`proposer.quantize`): on the grid, close, exact output."""

import pytest
import torch

from specframe.block_weights import block_grid, q8_0_rounded, round_linears_to_q8_0
from specframe.errors import ConfigError
from specframe.models import quantize_proposer
from specframe.proposer import seeded


def test_rounded_weights_are_on_the_q8_0_grid_and_within_half_a_scale():
    with seeded(0):
        w = torch.randn(40, 96) * torch.rand(40, 1) * 3
    w[3, 32:64] = 0.0  # (an all-zero block stays zero)
    rounded = q8_0_rounded(w)
    blocks = block_grid(rounded)
    assert blocks is not None and blocks.bits == 8  # (found again, and it gives back every number)
    scales = blocks.scales.repeat_interleave(32, dim=1)
    assert torch.all((rounded - w).abs() <= scales / 2 * (1 + 1e-6))
    assert torch.equal(blocks.scales, blocks.scales.half().float())  # 16-bit scales, as llama.cpp stores them
    assert torch.all(rounded[3, 32:64] == 0) and not torch.equal(rounded, w)
    assert torch.equal(q8_0_rounded(rounded), rounded)  # (a weight on the grid stays where it is)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_rounded(torch.randn(4, 40))


def test_scales_keep_eleven_bits_at_any_magnitude():
    """The scales are 16-bit floats' numbers where those reach (so the weights land where GGUF's would), and keep
    the same 11 bits beyond their range: blocks of tiny or huge numbers are still on the grid, never zero or NaN."""
    with seeded(2):
        w = torch.randn(4, 128)
    assert torch.equal(block_grid(q8_0_rounded(w)).scales, (w.reshape(4, 4, 32).abs().amax(-1) / 127).half().float())
    for magnitude in (1e-30, 1e-6, 3e-3, 1e6, 1e30):  # (16-bit floats: subnormal below ~7.8e-3 / 127, inf past 65504)
        rounded = q8_0_rounded(w * magnitude)
        blocks = block_grid(rounded)
        assert blocks is not None and blocks.bits == 8, magnitude
        assert torch.isfinite(rounded).all() and torch.all(rounded.abs().reshape(4, 4, 32).amax(-1) > 0)
        assert torch.all((rounded - w * magnitude).abs() <= blocks.scales.repeat_interleave(32, 1) / 2 * (1 + 1e-6))
    bad = w.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        q8_0_rounded(bad)
    layer = torch.nn.Linear(128, 4, bias=False)
    layer.weight.data = bad
    assert round_linears_to_q8_0(layer) == 0 and torch.equal(layer.weight, bad)  # (left as it is)


def test_linear_layers_are_rounded_in_place_except_those_that_cannot_or_need_not_be():
    with seeded(0):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 32),  # rounded (its bias is not)
            torch.nn.Linear(32, 40),  # rounded
            torch.nn.Linear(40, 64),  # input size not a multiple of 32: kept
        )
        on_grid = torch.nn.Linear(32, 8, bias=False)
    q = torch.randint(0, 16, (8, 32))
    q[:, :2] = torch.tensor([0, 15])  # (each block spans 0..15: scale 0.25, min -1, as Q4_1 finds them)
    on_grid.weight.data = q.float() * 0.25 - 1.0
    model.append(on_grid)
    before = [m.weight.detach().clone() for m in model]
    bias = model[0].bias.detach().clone()
    assert round_linears_to_q8_0(model) == 2
    assert all(block_grid(model[i].weight.detach()) is not None for i in (0, 1, 3))
    assert not torch.equal(model[0].weight, before[0]) and torch.equal(model[0].bias, bias)
    assert torch.equal(model[2].weight, before[2]) and torch.equal(model[3].weight, before[3])
    assert block_grid(model[3].weight.detach()).bits == 4  # (not moved to the coarser 8-bit grid)
    half = torch.nn.Linear(64, 32).to(torch.bfloat16)
    assert round_linears_to_q8_0(half) == 0


def test_a_tied_weight_is_rounded_once_for_both_modules():
    embed = torch.nn.Embedding(48, 64)
    head = torch.nn.Linear(64, 48, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    assert round_linears_to_q8_0(model) == 1
    assert head.weight is embed.weight and block_grid(embed.weight.detach()) is not None


def test_the_quantize_option(monkeypatch):
    def fresh():
        with seeded(1):
            return torch.nn.Sequential(torch.nn.Linear(64, 32))

    monkeypatch.setattr("specframe.block_weights.blocks_available", lambda: True)
    assert quantize_proposer(fresh(), "none", fast_cpu_kernels=True) == 0
    assert quantize_proposer(fresh(), "auto", fast_cpu_kernels=False) == 0  # (the target runs stock kernels)
    assert quantize_proposer(fresh(), "auto", fast_cpu_kernels=True) == 1
    assert quantize_proposer(fresh().to(torch.bfloat16), "auto", fast_cpu_kernels=True) == 0
    assert quantize_proposer(fresh(), "q8_0", fast_cpu_kernels=False) == 1  # (asked for: rounded anywhere)
    with pytest.raises(ConfigError, match="quantize=q8_0 rounds float32 weights; the proposer's are torch.bfloat16"):
        quantize_proposer(fresh().to(torch.bfloat16), "q8_0", fast_cpu_kernels=True)
    assert quantize_proposer(fresh().to("meta"), "auto", fast_cpu_kernels=True) == 0  # (not on the CPU: kept)
    monkeypatch.setattr("specframe.block_weights.blocks_available", lambda: False)
    assert quantize_proposer(fresh(), "auto", fast_cpu_kernels=True) == 0  # (no block kernel: nothing gained)
