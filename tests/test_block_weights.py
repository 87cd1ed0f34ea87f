"""Weights on a GGUF block grid, multiplied by their blocks: found only where exact, the float32 products."""

import copy
import ctypes
import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from specframe import block_weights, cpu_kernels, lean_forward
from specframe.block_weights import block_grid, block_kernel, block_kernel_problem, block_products, weight_blocks
from specframe.cpu_kernels import few_rows_linear, stock_kernels, use_fast_cpu_kernels
from specframe.kv_cache import new_cache
from specframe.lean_forward import engine_forward, fused_projections
from specframe.proposer import seeded
from specframe.testing.tiny import tiny_llama

GRIDS = {4: GGMLQuantizationType.Q4_1, 8: GGMLQuantizationType.Q8_0}

pytestmark = pytest.mark.skipif(block_kernel() is None, reason=f"no block kernel here: {block_kernel_problem()}")


def on_grid(shape, bits, seed=0, scale=1.0):
    """A float32 weight as transformers loads a GGUF one: quantised and dequantised by the `gguf` package."""
    x = (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)
    kind = GRIDS[bits]
    return torch.from_numpy(quants.dequantize(quants.quantize(x, kind), kind).copy())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_dequantised_gguf_weight_is_found_on_its_grid_exactly(bits):
    w = on_grid((24, 96), bits)
    blocks = block_grid(w)
    assert blocks is not None and blocks.bits == bits
    x = torch.eye(96)  # (each row picks one input: the product gives back the weight's numbers)
    back = torch.cat([block_products(x[i : i + 16], blocks) for i in range(0, 96, 16)]).t()
    assert torch.equal(back, w)


def test_a_weight_on_q8_0_whose_first_rows_are_also_on_q4_1_is_found_on_q8_0():
    # (zero rows are on both grids: the Q4_1 check of the first rows passed, the whole weight failed it, and Q8_0
    # was never tried)
    w = block_weights.q8_0_rounded(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)))
    w[: block_weights.FIRST_ROWS] = 0.0
    found = block_grid(w)
    assert found is not None and found.bits == 8
    assert torch.equal((found.scales[..., None] * found.quants.float()).reshape(w.shape), w)


def test_weights_off_a_grid_have_no_blocks():
    w = on_grid((8, 64), 4)
    assert block_grid(torch.randn(8, 64)) is None
    off = w.clone()
    off[5, 40] = torch.nextafter(off[5, 40], torch.tensor(9.0))  # one number off by one unit in the last place
    assert block_grid(off) is None
    assert block_grid(on_grid((8, 64), 4)[:, :40]) is None  # (40 inputs: not whole blocks)
    assert block_grid(w.double()) is None and block_grid(w[0]) is None
    late = w.clone()
    late[-1, 0] += 1e-3  # (past the first rows checked: the whole weight is checked too)
    assert block_grid(late) is None


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features", [13, 64])
def test_block_products_are_the_float32_products(bits, out_features):
    w = on_grid((out_features, 160), bits, seed=out_features)
    gen = torch.Generator().manual_seed(out_features + bits)
    bias = torch.randn(out_features, generator=gen)
    blocks = block_grid(w)
    for rows in range(1, block_weights.MAX_ROWS + 1):
        x = torch.randn(1, rows, 160, generator=gen)
        exact = (x.double() @ w.double().t() + bias.double()).float()
        got = block_products(x, blocks, bias)
        assert got.shape == (1, rows, out_features)
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
        # (F.linear rounds too, in its own order: the two may differ by twice as much as either from the exact)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features", [13, 64])
def test_a_rows_product_is_the_same_alone_or_with_other_rows(bits, out_features):
    """Every output is summed in the same order whichever pass of the kernel computes it (pairs of rows, a last
    three, a single row, a short tile), so a token's products do not depend on what is verified beside it."""
    blocks = block_grid(on_grid((out_features, 96), bits, seed=out_features))
    for rows in range(1, block_weights.MAX_ROWS + 1):
        x = torch.randn(rows, 96)
        together = block_products(x, blocks)
        assert all(torch.equal(together[i], block_products(x[i : i + 1], blocks)[0]) for i in range(rows)), rows


def test_the_few_row_products_use_the_blocks_and_follow_the_weight(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "layout_choice", cpu_kernels.FEW_ROWS)
    w = torch.nn.Parameter(on_grid((32, 64), 4), requires_grad=False)
    x = torch.randn(3, 64)
    used = []
    monkeypatch.setattr(cpu_kernels, "block_products", lambda *a: used.append(1) or block_products(*a))
    torch.testing.assert_close(few_rows_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert used and weight_blocks(w) is not None
    with torch.no_grad():
        w.mul_(1.001)  # changed in place: off the grid now, so the float32 weights again
    assert weight_blocks(w) is None
    torch.testing.assert_close(few_rows_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    w.data = on_grid((32, 64), 8)  # replaced: its own blocks
    assert weight_blocks(w).bits == 8
    torch.testing.assert_close(few_rows_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    used.clear()
    few_rows_linear(torch.randn(17, 64), w)  # (more rows than the kernel takes: the float32 layouts)
    w.requires_grad_(True)
    few_rows_linear(x, w)  # (a gradient wanted: the float32 weights, whose product has one)
    monkeypatch.setattr(block_weights, "use_blocks", False)
    few_rows_linear(x, w.detach())
    assert not used


def tiny_on_grid(bits=4):
    """A tiny Llama (widths multiples of 32) whose linear layers are quantised and dequantised as a GGUF's."""
    model = tiny_llama(vocab_size=64, seed=0, hidden_size=64)
    with torch.no_grad():
        for i, module in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            module.weight.copy_(on_grid(tuple(module.weight.shape), bits, seed=i, scale=0.3))
    return model


def test_blocks_are_not_looked_for_where_the_stock_layout_is_chosen(monkeypatch):
    """`layout_choice` "stock" never multiplies by blocks, so loading does not spend time and memory finding them."""
    monkeypatch.setattr(cpu_kernels, "layout_choice", cpu_kernels.STOCK)
    model = tiny_on_grid()
    use_fast_cpu_kernels(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not any(block_weights.BLOCKS_SLOT in m.weight.__dict__.get(block_weights._KEPT, {}) for m in linears)


def test_a_model_on_a_grid_runs_its_blocks_and_gives_the_float32_logits(monkeypatch):
    model = tiny_on_grid()
    reference = copy.deepcopy(model)
    assert use_fast_cpu_kernels(model) > 0
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(weight_blocks(m.weight) is not None for m in linears)
    forward = engine_forward(model)
    assert forward is not model  # (the lean forward, with fused projections on blocks joined from the layers')
    for layer, both in zip(model.model.layers, fused_projections(model), strict=True):
        own = weight_blocks(layer.self_attn.k_proj.weight)  # (a view of the joined blocks: kept once)
        assert own.quants.data_ptr() == weight_blocks(both.qkv_weight).quants[64:].data_ptr()
        assert torch.equal(block_products(torch.eye(64), weight_blocks(both.qkv_weight)).t(), both.qkv_weight)
        assert torch.equal(block_products(torch.eye(64), weight_blocks(both.gate_up_weight)).t(), both.gate_up_weight)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache, stock_cache = new_cache(model), new_cache(reference)
        for step in (ids[:, :8], ids[:, 8:11], ids[:, 11:]):  # (a prefill, a three-token step, one token)
            got = forward(input_ids=step, cache=cache, use_cache=True).logits
            want = reference(input_ids=step, cache=stock_cache, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocks_are_not_pickled_or_copied_with_a_weight():
    model = tiny_on_grid(bits=8)
    use_fast_cpu_kernels(model)
    weight = model.lm_head.weight
    assert weight_blocks(weight) is not None
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not other.lm_head.weight.__dict__.get(block_weights._KEPT)
        assert weight_blocks(other.lm_head.weight).bits == 8  # (found again for the copy)
        # (an unpickled weight's empty sample was read as one: KeyError 'numbers' when a decoder was built)
        assert lean_forward.forget_outdated_copies(other) == 0
        ids = torch.tensor([[1, 2, 3]])
        with torch.inference_mode():
            got = engine_forward(other)(input_ids=ids, cache=new_cache(other), use_cache=True).logits
            want = model(input_ids=ids, cache=new_cache(model), use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_products_use_the_float32_weights(monkeypatch, tmp_path):
    used = []
    monkeypatch.setattr(cpu_kernels, "block_products", lambda *a: used.append(1) or block_products(*a))
    block_weights._kernel_or_problem.cache_clear()
    try:
        with monkeypatch.context() as no_compiler:
            no_compiler.setenv("CC", str(tmp_path / "no-such-compiler"))
            no_compiler.setenv("SPECFRAME_HOME", str(tmp_path))
            assert block_kernel() is None and "no C compiler" in block_kernel_problem()
            w = on_grid((32, 64), 4)
            x = torch.randn(2, 64)
            torch.testing.assert_close(few_rows_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
            assert not used
            with pytest.raises(RuntimeError, match="block kernel is not available: no C compiler"):
                block_products(x, block_grid(w))
    finally:
        block_weights._kernel_or_problem.cache_clear()
    assert block_kernel() is not None


def test_a_cache_folder_that_cannot_hold_the_kernel_leaves_it_off(monkeypatch, tmp_path):
    # (before: "[Errno 20] Not a directory", and every float32 CPU run failed, exit 1)
    (tmp_path / "a-file").write_text("")
    block_weights._kernel_or_problem.cache_clear()
    try:
        with monkeypatch.context() as unusable:
            unusable.setenv("SPECFRAME_HOME", str(tmp_path / "a-file"))
            assert block_kernel() is None
            assert "cannot be kept in " in block_kernel_problem() and "$SPECFRAME_HOME" in block_kernel_problem()
    finally:
        block_weights._kernel_or_problem.cache_clear()


def test_the_kernel_is_built_once_per_source_and_compiler(monkeypatch, tmp_path):
    block_weights._kernel_or_problem.cache_clear()
    try:
        with monkeypatch.context() as elsewhere:
            elsewhere.setenv("SPECFRAME_HOME", str(tmp_path))
            assert block_kernel() is not None
            built = list((tmp_path / "kernels").glob("block_weights-*.so"))
            digest = built[0].with_suffix(".sha256")  # (its digest beside it, and nothing else left there)
            assert len(built) == 1 and sorted((tmp_path / "kernels").iterdir()) == sorted([built[0], digest])
            block_weights._kernel_or_problem.cache_clear()
            stamp = built[0].stat().st_mtime_ns
            assert block_kernel() is not None and built[0].stat().st_mtime_ns == stamp  # (not built again)
    finally:
        block_weights._kernel_or_problem.cache_clear()


@pytest.mark.parametrize("damage", ["cut short", "garbage", "no digest"])
def test_a_damaged_kept_kernel_is_built_again(monkeypatch, tmp_path, damage):
    # (before: a truncated library killed the process with SIGBUS when loaded, and a garbled one raised
    # "OSError: file too short" from load_model)
    block_weights._kernel_or_problem.cache_clear()
    try:
        with monkeypatch.context() as elsewhere:
            elsewhere.setenv("SPECFRAME_HOME", str(tmp_path))
            assert block_kernel() is not None
            (library,) = (tmp_path / "kernels").glob("block_weights-*.so")
            whole = library.read_bytes()
            damaged = {"cut short": whole[:4000], "garbage": b"\0" * len(whole), "no digest": whole}[damage]
            (tmp_path / "damaged").write_bytes(damaged)  # (put in by a rename: this process has the library mapped)
            os.replace(tmp_path / "damaged", library)
            if damage == "no digest":
                library.with_suffix(".sha256").unlink()
            block_weights._kernel_or_problem.cache_clear()
            assert block_kernel() is not None and block_kernel_problem() is None
            assert library.read_bytes() == whole
            w, x = on_grid((32, 64), 8), torch.randn(2, 64)
            torch.testing.assert_close(block_products(x, block_grid(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)
    finally:
        block_weights._kernel_or_problem.cache_clear()


def test_a_kernel_that_multiplies_wrongly_is_not_used():
    kernel = block_kernel()
    assert block_weights._products_right(kernel)

    def off_by_a_little(x, rows, in_features, quants, bits, scales, mins, out, y, threads):
        failed = kernel(x, rows, in_features, quants, bits, scales, mins, out, y, threads)
        ctypes.c_float.from_address(y).value += 1e-3  # (one number of the output wrong)
        return failed

    assert not block_weights._products_right(off_by_a_little)
    assert not block_weights._products_right(lambda *args: 0)  # (wrote nothing)
    assert not block_weights._products_right(lambda *args: 1)  # (said it failed)


def test_a_compiler_command_with_arguments_builds_the_kernel(monkeypatch, tmp_path):
    block_weights._kernel_or_problem.cache_clear()
    try:
        with monkeypatch.context() as elsewhere:
            elsewhere.setenv("SPECFRAME_HOME", str(tmp_path))
            elsewhere.setenv("CC", "env cc")  # (as CC="ccache gcc": was "no C compiler")
            assert block_kernel() is not None, block_kernel_problem()
            block_weights._kernel_or_problem.cache_clear()
            elsewhere.setenv("CC", "false")
            assert block_kernel() is None
            assert "compiling block_weights.c failed (exit status 1): nothing said" in block_kernel_problem()
    finally:
        block_weights._kernel_or_problem.cache_clear()


def test_block_products_are_float32_whatever_the_default_dtype():
    w, x = on_grid((32, 64), 4), torch.randn(2, 64)
    want = F.linear(x, w)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # (the output was made in it: float32 numbers read as float64)
    try:
        got = block_products(x, block_grid(w))
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_weight_off_the_grid_is_found_out_by_its_first_rows(monkeypatch):
    checked = []
    for name in ("_q4_1", "_q8_0"):
        grid = getattr(block_weights, name)
        monkeypatch.setattr(block_weights, name, lambda w, grid=grid: checked.append(w.shape[0]) or grid(w))
    with seeded(0):
        assert block_grid(torch.randn(4096, 1024)) is None
    assert checked == [block_weights.FIRST_ROWS] * 2  # (the whole weight is not checked)


def greedy_of(model, prompt, n):
    """transformers' greedy tokens of a copy of `model` on the stock kernels (nothing derived from its weights)."""
    fresh = copy.deepcopy(model)  # (`model` itself left as the decoder runs it)
    with stock_kernels(fresh):
        return fresh.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("layout", ["blocks", cpu_kernels.PACKED])
@pytest.mark.parametrize("change", ["load_state_dict", "through .data", "replaced"])
@pytest.mark.parametrize("between", ["nothing", "a forward", "a check by hand"])
def test_generation_follows_weights_changed_between_calls(monkeypatch, layout, change, between):
    """The blocks and packed copies made from a weight are made again when it changes between generations: in
    place through a fused layer's weight (a view of the layer's buffer, with its own version counter), through
    `.data` (as PEFT's merge adds its update; no counter moves) or replaced by another tensor; also after the
    model's own forward made copies of the new numbers for other row counts (which once took a new sample and
    hid the change from the next generation), or a `forget_outdated_copies` by hand (which once left the
    stacked layers as they were)."""
    from specframe.decoder import SpeculativeDecoder, target_info
    from specframe.proposers.none import NoneConfig, NoneProposer

    if layout == cpu_kernels.PACKED:
        if not cpu_kernels.PACKED_AVAILABLE:
            pytest.skip("no MKL packed products in this PyTorch")
        monkeypatch.setattr(cpu_kernels, "layout_choice", cpu_kernels.PACKED)
        monkeypatch.setattr(block_weights, "use_blocks", False)
    model, other = tiny_on_grid(bits=8), tiny_on_grid(bits=4)  # (both on a grid: blocks for each)
    with torch.no_grad():
        for module in other.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(-1.0)  # (still on the grid, and far from `model`'s)
    use_fast_cpu_kernels(model)
    decoder = SpeculativeDecoder(model, NoneProposer.from_config(NoneConfig(), target_info(model)), max_new_tokens=20)
    prompt = [1, 2, 3, 4]
    assert decoder.generate(prompt).token_ids == greedy_of(model, prompt, 20)
    assert fused_projections(model)[0] is not None
    pairs = [(m, o) for m, o in zip(model.modules(), other.modules(), strict=True) if isinstance(m, torch.nn.Linear)]
    if change == "load_state_dict":
        model.load_state_dict(other.state_dict())
    elif change == "through .data":
        for mine, theirs in pairs:
            mine.weight.data += theirs.weight - mine.weight  # (no version counter moves)
    else:
        for mine, theirs in pairs:
            mine.weight.data = theirs.weight.detach().clone()
    assert greedy_of(model, prompt, 20) == greedy_of(other, prompt, 20)
    if between == "a forward":  # (the model's own: new copies for 2, 5, 9 and 13 rows)
        with torch.inference_mode():
            for rows in (2, 5, 9, 13):
                model(input_ids=torch.arange(rows)[None] % 64, use_cache=False)
    elif between == "a check by hand":
        assert lean_forward.forget_outdated_copies(model) > 0 or change != "through .data"
    assert decoder.generate(prompt).token_ids == greedy_of(other, prompt, 20)
    assert lean_forward.forget_outdated_copies(model) == 0  # (all made again from the new numbers)


@pytest.mark.parametrize(
    ("proposer", "layout"),
    [("eagle", "blocks"), ("eagle", cpu_kernels.PACKED), ("draft", cpu_kernels.PACKED), ("medusa", cpu_kernels.PACKED)],
)
def test_a_proposers_model_changed_through_data_drafts_from_its_new_numbers(monkeypatch, proposer, layout):
    """A proposer's own weights on specframe's CPU kernels (EAGLE's drafter and its LM-head rows, a draft model,
    Medusa's LM-head rows; their 8-bit blocks and MKL-packed copies) follow a change that moves no version
    counter (through `.data`, as PEFT's merge adds its update) at the next generation's start, as the target's
    do. (The random draft, and the target's rows the others take, are on no grid: no blocks.)"""
    from specframe.decoder import target_info
    from specframe.proposers.draft import DraftConfig, DraftProposer
    from specframe.proposers.eagle import EagleConfig, EagleProposer
    from specframe.proposers.medusa import MedusaProposer
    from specframe.testing.replay import fresh_proposal

    if layout == cpu_kernels.PACKED:
        if not cpu_kernels.PACKED_AVAILABLE:
            pytest.skip("no MKL packed products in this PyTorch")
        monkeypatch.setattr(cpu_kernels, "layout_choice", cpu_kernels.PACKED)
        monkeypatch.setattr(block_weights, "use_blocks", False)
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=3)
    use_fast_cpu_kernels(target)
    info = target_info(target)

    def made():  # (a proposer, and the weights of its own that its kernels use)
        if proposer == "eagle":
            p = EagleProposer.random(info, EagleConfig(depth=3, top_k=2, total_tokens=6), seed=3)
            return p, [*p.drafter.parameters(), p.drafter.head]
        if proposer == "medusa":
            p = MedusaProposer.random(info, seed=3)
            return p, [p.lm_rows]
        p = DraftProposer.random(info, DraftConfig(num_speculative_tokens=4), seed=3)
        use_fast_cpu_kernels(p.model)  # (as loading a draft does where the target has them)
        return p, [m.weight for m in p.model.modules() if isinstance(m, torch.nn.Linear)]

    def proposal(p):
        found = fresh_proposal(p, target, torch.tensor([1, 2, 3, 4, 5, 6]))
        return found.tokens.tolist(), found.parents.tolist()

    (mine, my_weights), (theirs, their_weights) = made(), made()
    with torch.no_grad():
        for w in their_weights:
            if w.dim() == 2:
                w.mul_(-1.0)  # (on the grid still, where it was, and far from `mine`'s)
    before = proposal(mine)
    with torch.no_grad():
        for a, b in zip(my_weights, their_weights, strict=True):
            a.data += b - a  # (no version counter moves)
    assert proposal(mine) == proposal(theirs) != before
