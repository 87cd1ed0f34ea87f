import copy
import io

import pytest
import torch

from specframe import block_weights, cpu_kernels
from specframe.cpu_kernels import (
    ATTENTION,
    FEW_ROWS,
    MAX_ROWS,
    MEASURED_ROWS,
    PACKED,
    PACKED_AVAILABLE,
    PACKED_MAX_ROWS,
    STOCK,
    fast_kernels_on,
    few_rows_linear,
    is_rerouted,
    layout_plan,
    measure_layouts,
    stock_kernels,
    use_fast_cpu_kernels,
    use_stock_kernels,
)
from specframe.testing.tiny import tiny_llama


def packed_rows(weight: torch.Tensor) -> set[int]:
    """The row counts `weight` has MKL-packed copies kept for."""
    kept = weight.__dict__.get(block_weights._KEPT, {})
    return {slot[1] for slot in kept if isinstance(slot, tuple) and slot[0] == "mkl-packed"}


@pytest.fixture(autouse=True)
def few_row_layout_everywhere(monkeypatch):
    """These tests check the few-row layout's results, so it runs at every row count whichever layout this
    machine measures faster (the tests of that choice below set it themselves)."""
    monkeypatch.setattr(cpu_kernels, "layout_choice", "few-rows")


class FakeLayouts:
    """Stand-ins for the three layouts on a fake clock: the stock one costs 1.0 a call, the few-row one
    `few_cost(rows, call)`, the packed one `packed_cost(rows)`; all compute x @ w.T. The packed one is offered
    whatever this PyTorch has; a timed call runs the weight alone."""

    def __init__(self, monkeypatch, few_cost, packed_cost=lambda rows: 2.0):
        self.now = 0.0
        self.calls = 0
        self.few_cost = few_cost
        self.packed_cost = packed_cost
        self.packed_rows = set()
        monkeypatch.setattr(cpu_kernels, "_stock_linear", self.stock)
        monkeypatch.setattr(cpu_kernels, "_few_rows_layout", self.few)
        monkeypatch.setattr(cpu_kernels, "_packed_layout", self.packed)
        monkeypatch.setattr(cpu_kernels, "PACKED_AVAILABLE", True)
        monkeypatch.setattr(cpu_kernels, "_cold_copies", lambda w: [w])  # (one call per timed call)

    def clock(self) -> float:
        return self.now

    def stock(self, x, w, b=None):
        self.now += 1.0
        return x @ w.T

    def few(self, x, w, b, rows):
        self.calls += 1
        self.now += self.few_cost(rows, self.calls)
        return x @ w.T

    def packed(self, x, w, b, rows):
        self.packed_rows.add(rows)
        self.now += self.packed_cost(rows)
        return x @ w.T


def test_each_row_count_gets_the_layout_measured_clearly_faster_there(monkeypatch):
    """Clearly faster (fastest call at most CLEAR_WIN of the stock one's) at 1, 2 and 16 rows: those, and 9-15
    (which follow 16), get the few-row layout; at 0.95 of the stock time (3, 4, 8, 32, 64 rows) stock stays."""
    fake = FakeLayouts(monkeypatch, lambda rows, call: 0.5 if rows in (1, 2, 16) else 0.95)
    plan = measure_layouts(torch.randn(40, 24), timer=fake.clock)
    assert len(plan) == MAX_ROWS + 1 and plan[0] == STOCK
    assert [r for r in range(1, MAX_ROWS + 1) if plan[r] == FEW_ROWS] == [1, 2, *range(9, 17)]
    assert set(plan[3:9]) == set(plan[17:]) == {STOCK}
    assert MEASURED_ROWS == (1, 2, 3, 4, 8, 16, 32, 64)


def test_the_packed_layout_is_chosen_where_it_is_fastest_and_only_up_to_its_row_limit(monkeypatch):
    """Packed at 0.4 of the stock time, few-rows at 0.5: packed wins where it is offered (up to
    PACKED_MAX_ROWS rows), few-rows above; at 3 rows the packed product is clearly slower and few-rows wins."""
    fake = FakeLayouts(monkeypatch, lambda rows, call: 0.5, packed_cost=lambda rows: 3.0 if rows == 3 else 0.4)
    plan = measure_layouts(torch.randn(40, 24), timer=fake.clock)
    assert plan[1 : PACKED_MAX_ROWS + 1] == (PACKED, PACKED, FEW_ROWS) + (PACKED,) * (PACKED_MAX_ROWS - 3)
    assert set(plan[PACKED_MAX_ROWS + 1 :]) == {FEW_ROWS}
    assert fake.packed_rows == {m for m in MEASURED_ROWS if m <= PACKED_MAX_ROWS}


def test_a_busy_moment_does_not_decide_the_layout(monkeypatch):
    """The fastest call counts, not the mean: a few calls slowed by other work (here every third few-row call
    takes 50x) leave the few-row layout chosen where it is faster."""
    fake = FakeLayouts(monkeypatch, lambda rows, call: 50.0 if call % 3 == 0 else 0.5)
    assert set(measure_layouts(torch.randn(40, 24), timer=fake.clock)[1:]) == {FEW_ROWS}


def test_the_layout_is_measured_once_per_shape_and_thread_count(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "layout_choice", "measure")
    monkeypatch.setattr(cpu_kernels, "_plans", {})
    measured = []

    def measure(weight):
        measured.append((tuple(weight.shape), torch.get_num_threads()))
        return (STOCK,) + (FEW_ROWS,) * MAX_ROWS

    monkeypatch.setattr(cpu_kernels, "measure_layouts", measure)
    layer = torch.nn.Linear(24, 40)
    use_fast_cpu_kernels(layer)  # (measured here, at load)
    assert measured == [((40, 24), torch.get_num_threads())]
    layer(torch.randn(3, 24))
    layout_plan(torch.randn(40, 24))
    assert len(measured) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        layer(torch.randn(3, 24))  # another thread count: measured again, when first used
    finally:
        torch.set_num_threads(threads)
    assert measured[1:] == [((40, 24), threads + 1)]


@pytest.fixture
def stored_layouts(monkeypatch, kept_timings):
    """Layout plans kept on disk (under a temporary cache root); a fresh process's memory; `measured` records
    each measurement (a stand-in that alternates two plans, so a measurement repeated shows)."""
    monkeypatch.setattr(cpu_kernels, "_announced", True)
    monkeypatch.setattr(cpu_kernels, "_plans", {})
    monkeypatch.setattr(cpu_kernels, "layout_choice", "measure")
    measured = []

    def measure(weight):
        measured.append(tuple(weight.shape))
        chosen = {rows: (FEW_ROWS, PACKED)[(len(measured) + i) % 2] for i, rows in enumerate(MEASURED_ROWS)}
        return (STOCK, *(chosen[next(m for m in MEASURED_ROWS if m >= r)] for r in range(1, MAX_ROWS + 1)))

    monkeypatch.setattr(cpu_kernels, "measure_layouts", measure)
    return measured


def test_measured_layouts_are_kept_for_later_processes(stored_layouts, monkeypatch):
    weight = torch.randn(40, 24)
    plan = layout_plan(weight)
    assert stored_layouts == [(40, 24)]
    monkeypatch.setattr(cpu_kernels, "_plans", {})  # (a later process)
    assert layout_plan(weight) == plan and layout_plan(torch.randn(40, 24)) == plan
    assert stored_layouts == [(40, 24)]
    other = layout_plan(torch.randn(24, 40))  # another shape: measured, and kept beside the first
    monkeypatch.setattr(cpu_kernels, "_plans", {})
    assert layout_plan(torch.randn(24, 40)) == other and layout_plan(weight) == plan
    assert stored_layouts == [(40, 24), (24, 40)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        layout_plan(weight)  # another thread count: measured again
    finally:
        torch.set_num_threads(threads)
    assert stored_layouts == [(40, 24), (24, 40), (40, 24)]


@pytest.mark.parametrize(
    "kept",
    [
        {"1": "stock"},  # rows missing
        {str(rows): "fast" if rows == 1 else "stock" for rows in MEASURED_ROWS},  # not a layout
        ["stock"] * (MAX_ROWS + 1),
    ],
)
def test_a_kept_plan_that_is_not_one_is_measured_again(stored_layouts, kept):
    from specframe import measurements

    name = f"40x24 threads={torch.get_num_threads()}"
    measurements.store(cpu_kernels.LAYOUTS_KEPT, cpu_kernels._LAYOUT_SOURCES, name, kept)
    plan = layout_plan(torch.randn(40, 24))
    assert stored_layouts == [(40, 24)]
    assert measurements.stored(cpu_kernels.LAYOUTS_KEPT, cpu_kernels._LAYOUT_SOURCES)[name] == {
        str(rows): plan[rows] for rows in MEASURED_ROWS
    }


def test_a_layer_whose_shape_never_gains_keeps_its_own_forward(monkeypatch):
    """Measured: only layers whose shape has a row count where the few-row layout wins are rerouted (here the LM
    head, 24 x 32); the others keep nn.Linear's forward and its cost. The attention is renamed all the same."""
    monkeypatch.setattr(cpu_kernels, "layout_choice", "measure")
    monkeypatch.setattr(cpu_kernels, "_plans", {})
    head_wins = (STOCK, FEW_ROWS) + (STOCK,) * (MAX_ROWS - 1)
    monkeypatch.setattr(cpu_kernels, "measure_layouts", lambda w: head_wins if w.shape[0] == 24 else (STOCK,) * 65)
    stock = tiny_llama(vocab_size=24, hidden_size=32)
    model = copy.deepcopy(stock)
    assert use_fast_cpu_kernels(model) == 1
    assert is_rerouted(model.lm_head) and "forward" not in model.model.layers[0].mlp.up_proj.__dict__
    assert model.config._attn_implementation == ATTENTION and fast_kernels_on(model)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(cpu_kernels, "layout_choice", "few-rows")
    assert use_fast_cpu_kernels(model) == sum(type(m) is torch.nn.Linear for m in model.modules())
    monkeypatch.setattr(cpu_kernels, "layout_choice", "measure")
    assert use_fast_cpu_kernels(model) == 1  # (again measured: the layers put back as they were)
    assert "forward" not in model.model.layers[0].mlp.up_proj.__dict__


def test_a_misspelt_layout_choice_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "layout_choice", "fewrows")
    with pytest.raises(ValueError, match="layout_choice must be one of .*'fewrows'"):
        use_fast_cpu_kernels(torch.nn.Linear(24, 40))


@pytest.mark.parametrize("choice", ["stock", "few-rows", "measure"])
def test_the_layout_choice_routes_a_rerouted_layer(monkeypatch, choice):
    """`layout_choice` "stock" never takes the few-row layout, "few-rows" always (1-64 rows), "measure" where
    the plan says so; the results agree up to rounding."""
    monkeypatch.setattr(cpu_kernels, "layout_choice", choice)
    plan = (STOCK, FEW_ROWS, STOCK) * 21 + (FEW_ROWS, FEW_ROWS)  # rows 1, 4, 7, ...
    monkeypatch.setattr(cpu_kernels, "_plans", {(40, 24, torch.get_num_threads()): plan})
    taken = []
    real = cpu_kernels._few_rows_layout
    monkeypatch.setattr(cpu_kernels, "_few_rows_layout", lambda *a: taken.append(a[3]) or real(*a))
    layer = torch.nn.Linear(24, 40)
    cpu_kernels.use_fast_cpu_kernels(layer)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
    assert taken == {"stock": [], "few-rows": [1, 2, 3, 4], "measure": [1, 4]}[choice]


@pytest.mark.parametrize("rows", [1, 2, 5, 10, 15, 16, MAX_ROWS, MAX_ROWS + 1])
def test_few_row_layout_computes_the_same_linear(rows):
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(1, rows, 24)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert use_fast_cpu_kernels(layer) == 1
    y = layer(x)
    assert y.shape == expected.shape
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS + 1])
def test_few_rows_linear_without_a_module_is_x_times_w_transposed(rows):
    weight = torch.randn(40, 24)
    x = torch.randn(rows, 24)
    torch.testing.assert_close(few_rows_linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    half = x.bfloat16()
    assert torch.equal(few_rows_linear(half, weight.bfloat16()), torch.nn.functional.linear(half, weight.bfloat16()))


def test_few_row_layout_accepts_strided_inputs():
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(24, 3).t()[None]  # [1, 3, 24], not contiguous
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    use_fast_cpu_kernels(layer)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_a_row_alone_equals_it_in_a_chunk_up_to_rounding():
    """Padding copies never leak into the real rows: a row computed alone (padded to two) or inside a chunk of
    13 (padded to 16) gives the same result up to float rounding."""
    layer = torch.nn.Linear(24, 40)
    use_fast_cpu_kernels(layer)
    x = torch.randn(13, 24)
    together = layer(x)
    for i in (0, 6, 12):
        torch.testing.assert_close(layer(x[i : i + 1]), together[i : i + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 7, 13])
def test_padded_row_counts_compute_the_larger_product_and_keep_only_the_real_rows(monkeypatch, rows):
    """1, 3, 7 and 10-15 rows go through the few-row layout as 2, 4, 8 and 16 (PAD_ROWS): the product is taken
    on that many rows, and what comes back is `F.linear` of the real rows alone."""
    weight, bias = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(1, rows, 24)
    widths = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: widths.append(b.shape[1]) or real_mm(a, b))
    out = cpu_kernels._few_rows_layout(x, weight, bias, rows)
    assert widths == [{1: 2, 3: 4, 7: 8, 13: 16}[rows]]
    assert out.shape == (1, rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_linears_are_rerouted_and_stock_kernels_restore_them():
    model = tiny_llama(vocab_size=16, hidden_size=32)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert use_fast_cpu_kernels(model) == n_linear
    assert model.config._attn_implementation == ATTENTION
    assert use_fast_cpu_kernels(tiny_llama(vocab_size=16, dtype=torch.bfloat16)) == 0
    with stock_kernels(model):
        assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)
        assert model.config._attn_implementation == "sdpa"
    assert "forward" in model.lm_head.__dict__ and model.config._attn_implementation == ATTENTION
    use_stock_kernels(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)
    assert model.config._attn_implementation == "sdpa"


@torch.no_grad()
def test_gqa_attention_with_masks_matches_transformers_sdpa():
    """On a grouped-query target (2 heads, 1 key/value head), with a cache: a causal chunk and a tree mask."""
    from transformers import DynamicCache

    from specframe.kv_cache import tree_attention_mask

    stock = tiny_llama(vocab_size=16, hidden_size=32)
    fast = tiny_llama(vocab_size=16, hidden_size=32)
    use_fast_cpu_kernels(fast)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    chunk = torch.tensor([[6, 7, 8, 9]])
    mask = tree_attention_mask([-1, -1, 0], 5, torch.float32, torch.device("cpu"))
    results = []
    for model in (stock, fast):
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, cache=cache, use_cache=True)
        causal = model(input_ids=chunk, cache=cache, use_cache=True).logits
        cache.crop(-4)
        tree = model(
            input_ids=chunk, cache=cache, use_cache=True, attention_mask=mask, position_ids=torch.tensor([[5, 6, 6, 7]])
        ).logits
        results.append((causal, tree))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fast_kernels_verify_the_same_tokens():
    from specframe import SpeculativeDecoder
    from specframe.decoder import target_info
    from specframe.proposers.medusa import MedusaProposer

    plain = tiny_llama(vocab_size=16, hidden_size=32)
    fast = tiny_llama(vocab_size=16, hidden_size=32)
    use_fast_cpu_kernels(fast)
    outs = []
    for model in (plain, fast):
        dec = SpeculativeDecoder(model, MedusaProposer.random(target_info(model)), max_new_tokens=40)
        outs.append(dec.generate([1, 2, 3, 4]).token_ids)
    assert outs[0] == outs[1]


def test_load_model_applies_them_unless_told_not_to(tiny_dirs):
    from specframe.models import load_model

    on = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True).model
    off = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True, fast_cpu_kernels=False).model
    assert "forward" in on.lm_head.__dict__ and "forward" not in off.lm_head.__dict__
    assert on.config._attn_implementation == ATTENTION and off.config._attn_implementation == "sdpa"


def test_a_model_type_that_reads_its_attention_name_keeps_sdpa():
    """DeepSeek-V3.2 applies its sparse indexer's top-k mask only under "eager" or "sdpa": renamed, it would
    attend densely and be another model. Only listed model types get `specframe_sdpa`; the others keep the
    stock logits (up to the linear layers' rounding)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, n_group=1,
        topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
        qk_nope_head_dim=8, head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1,
        max_position_embeddings=128, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    stock = DeepseekV32ForCausalLM(cfg).eval()
    fast = copy.deepcopy(stock)
    assert use_fast_cpu_kernels(fast) > 0
    assert fast.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fast(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_a_model_on_these_kernels_pickles():
    model = tiny_llama(vocab_size=16, hidden_size=32)
    use_fast_cpu_kernels(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert fast_kernels_on(back) and back.lm_head.forward.args[0] is back.lm_head  # (its own layer, not the old)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_stock_kernels_put_back_exactly_what_they_took_also_through_a_wrapper():
    """transformers' assisted generation gets the draft's layers inside another model (bench.hf_assistant):
    the stock kernels reach them there, and afterwards the draft has its own kernels back and nothing more."""
    draft = tiny_llama(vocab_size=16, hidden_size=32)
    use_fast_cpu_kernels(draft)
    wrapper = tiny_llama(vocab_size=16, hidden_size=32)  # (its own head and config, the draft's layers)
    wrapper.model = draft.model
    with stock_kernels(wrapper):
        assert not any("forward" in m.__dict__ for m in wrapper.modules() if type(m) is torch.nn.Linear)
        assert draft.config._attn_implementation == "sdpa"  # (the layers read their own config)
        assert "forward" in draft.lm_head.__dict__ and fast_kernels_on(draft)  # (not in the wrapper)
    assert all("forward" in m.__dict__ for m in draft.modules() if type(m) is torch.nn.Linear)
    assert draft.config._attn_implementation == ATTENTION and fast_kernels_on(draft)
    assert "forward" not in wrapper.lm_head.__dict__ and not fast_kernels_on(wrapper)


@pytest.mark.parametrize("fast", [True, False])
def test_the_proposers_own_models_follow_the_target(tiny_dirs, fast, monkeypatch):
    """`target.fast_cpu_kernels=false` means the stock kernels everywhere: in a draft model, an EAGLE drafter
    and the few-row products of Medusa and EAGLE (float32, where the two differ)."""
    from specframe import SpeculativeDecoder
    from specframe.decoder import target_info
    from specframe.models import load_model
    from specframe.proposers.draft import DraftConfig, DraftProposer
    from specframe.proposers.eagle import EagleProposer
    from specframe.proposers.medusa import MedusaProposer

    loaded = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True, fast_cpu_kernels=fast)
    info = target_info(loaded.model, loaded.tokenizer)
    assert info.fast_cpu_kernels is fast
    draft = DraftProposer.from_config(DraftConfig(model=str(tiny_dirs["draft"]), dtype="float32"), info)
    assert fast_kernels_on(draft.model) is fast and ("forward" in draft.model.lm_head.__dict__) is fast
    eagle = EagleProposer.random(info)
    assert fast_kernels_on(eagle.drafter) is fast
    used = []

    def spy(*args):
        used.append(args)
        return few_rows_linear(*args)

    monkeypatch.setattr("specframe.proposers.medusa.few_rows_linear", spy)
    monkeypatch.setattr("specframe.proposers.eagle.few_rows_linear", spy)
    for proposer in (MedusaProposer.random(info), EagleProposer.random(info)):
        used.clear()
        SpeculativeDecoder(loaded.model, proposer, max_new_tokens=4).generate([1, 2, 3])
        assert bool(used) is fast, proposer.name


def test_a_pickled_model_runs_in_a_new_process(tmp_path):
    """The attention's name is registered when specframe.cpu_kernels is imported, which unpickling does."""
    import subprocess
    import sys

    model = tiny_llama(vocab_size=16, hidden_size=32)
    use_fast_cpu_kernels(model)
    torch.save(model, tmp_path / "model.pt")
    ids = torch.tensor([[1, 2, 3]])
    torch.save(model(input_ids=ids).logits, tmp_path / "logits.pt")
    script = (
        "import sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
        "assert m.config._attn_implementation == 'specframe_sdpa'; "
        "torch.testing.assert_close(m(input_ids=torch.tensor([[1, 2, 3]])).logits, torch.load(sys.argv[2]))"
    )
    argv = [sys.executable, "-c", script, str(tmp_path / "model.pt"), str(tmp_path / "logits.pt")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_another_librarys_forward_override_is_left_alone():
    """A hook installed as an instance `forward` (as accelerate does) is neither replaced by these kernels nor
    dropped by `stock_kernels`."""
    model = tiny_llama(vocab_size=16, hidden_size=32)
    head = model.lm_head
    hooked = head.forward  # (the class's forward, bound: stands for a hook's wrapper)
    head.forward = hooked
    use_fast_cpu_kernels(model)
    assert head.__dict__["forward"] is hooked and not is_rerouted(head)
    assert is_rerouted(model.model.layers[0].mlp.up_proj)
    with stock_kernels(model):
        assert head.__dict__["forward"] is hooked and not is_rerouted(model.model.layers[0].mlp.up_proj)
    assert head.__dict__["forward"] is hooked and is_rerouted(model.model.layers[0].mlp.up_proj)


needs_mkl = pytest.mark.skipif(not PACKED_AVAILABLE, reason="this PyTorch has no MKL packed products")


@needs_mkl
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, PACKED_MAX_ROWS + 1])
def test_packed_layout_computes_the_same_linear(monkeypatch, rows):
    """Packed for its row count (5 rows padded to 8, 9 to 16: the copies never leak into the real rows);
    above PACKED_MAX_ROWS the stock product. With a bias, a batch dimension and a strided input."""
    monkeypatch.setattr(cpu_kernels, "layout_choice", PACKED)
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(24, rows).t()[None]  # [1, rows, 24], not contiguous
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    use_fast_cpu_kernels(layer)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == expected.shape
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert packed_rows(layer.weight) == ({cpu_kernels._measured_rows(rows)} if rows <= PACKED_MAX_ROWS else set())


@needs_mkl
def test_a_packed_copy_follows_the_weight_and_gradients_take_the_stock_product(monkeypatch):
    """An in-place change of the weight (an optimiser step, `load_state_dict`) packs it again; an input that
    wants a gradient goes through a product that has one."""
    monkeypatch.setattr(cpu_kernels, "layout_choice", PACKED)
    layer = torch.nn.Linear(24, 40)
    use_fast_cpu_kernels(layer)
    x = torch.randn(4, 24)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, -1), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packed_copies_are_not_pickled_or_deep_copied(monkeypatch):
    """They are made again when used: a saved model stays the size of its weights."""
    monkeypatch.setattr(cpu_kernels, "layout_choice", PACKED)
    model = tiny_llama(vocab_size=16, hidden_size=32)
    use_fast_cpu_kernels(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert packed_rows(model.lm_head.weight)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert not packed_rows(other.lm_head.weight)
        with torch.no_grad():
            torch.testing.assert_close(other(input_ids=ids).logits, logits)


@needs_mkl
def test_the_timing_runs_on_copies_and_keeps_none_of_their_packed_copies(monkeypatch):
    """Timed cold (`_cold_copies`: COLD_BYTES of copies in turn); the packed copies made for the timing are all
    freed, the weight's own too (made again when used)."""
    made = []
    real = cpu_kernels._packed_weight
    monkeypatch.setattr(cpu_kernels, "_packed_weight", lambda w, rows: made.append(w) or real(w, rows))
    monkeypatch.setattr(cpu_kernels, "MAX_COPIES", 3)
    weight = torch.randn(40, 24)
    plan = measure_layouts(weight)
    assert set(plan) <= {STOCK, FEW_ROWS, PACKED}
    assert len({id(w) for w in made}) == 4 and all(not packed_rows(w) for w in made)
    assert len(cpu_kernels._cold_copies(torch.randn(2**20))) == 1 + min(3, cpu_kernels.COLD_BYTES // 2**22 - 1)
