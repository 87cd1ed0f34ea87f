"""Faster CPU kernels for the few-token forwards of decoding and verification (float32).

Decoding runs the target on one token, verifying a proposal on 2-64. How well PyTorch's default kernels handle
those shapes depends on the CPU, so what is used is measured on the machine:

1. `linear` on 1-64 rows. On this project's 2-core AMD EPYC machines (torch 2.13, MKL) a one-row `linear` is a
   matrix-vector product that reads the weights at about a third of the bandwidth that a two-column matrix product
   gets; on 2-64 rows, `X @ W.T` is slower again than `W @ X.T` with a contiguous X; and 3, 7 and 10-15 rows cost
   more than 4, 8 and 16 (e.g. 576x576: 111 µs on 3 rows, 90 on 4; the 49152-row LM head 7.7 ms against 6.0;
   2026-12-03). The *few-row layout* computes `W @ X.T`, one row duplicated into two columns, 3 rows padded to 4,
   7 to 8 and 10-15 to 16 (padding rows are copies, dropped after). On its 2-core Intel Xeon machines (AMX, the
   same torch) the stock products are the fast ones on 1-3 rows, and the few-row layout is 2-5x slower there; from
   4 rows on, the stock product repacks the weight on every call, and MKL's *packed layout* (the weight reordered
   once by `mkl::_mkl_reorder_linear_weight` for a row count, kept beside the weight, and multiplied by
   `mkl::_mkl_linear`) is faster; so is it for the 113 MB LM head on one row (5.3 against 8.4 ms). So each float32
   CPU `nn.Linear` of a model given these kernels, and each few-row product of a proposer (`few_rows_linear`),
   uses at each row count the layout that is clearly fastest on this machine: the three are timed once per weight
   shape and thread count (`measure_layouts`, at load for a model's layers; on copies of the weight taken in turn,
   so that it comes from memory as in a forward: ~1 s a shape, ~9 s for SmolLM2-135M and the EAGLE drafter) once
   per machine, the choices kept on disk for later processes (`specframe.measurements`), and the stock product
   is kept where they are close. The packed layout keeps one copy of the weight per row count it is used at (1-16
   rows; counts between the measured ones are padded up to the next), so memory grows by a copy of those weights
   for each such count.
2. transformers' `sdpa` attention copies the key/value heads of grouped-query attention (`repeat_kv`, a copy
   of the whole cache per layer) whenever a mask is given, that is on every multi-token forward; PyTorch's SDPA
   does grouped-query attention itself (`enable_gqa`) with a mask on CPU (on the Intel machine, SDPA alone at
   300-1200 cached: 2-4x faster). `specframe_sdpa` does that on CPU and is transformers' own `sdpa` otherwise
   (for the model types in FAST_ATTENTION_MODEL_TYPES only).
3. A weight that is exactly a GGUF Q4_1 or Q8_0 block grid (the default target's, dequantised from its GGUF; a
   proposer's own, rounded at load by `proposer.quantize`) is multiplied on 1-16 rows by its blocks instead of by
   any of the layouts above (`specframe.block_weights`: the same float32 numbers, a fifth to a quarter of the
   bytes read), unless `layout_choice` is "stock".

SmolLM2-135M, median ms per forward, stock and these kernels interleaved in one run per context length
(`scripts/kernel_timings.py`, `CONTEXT=1200` for the second of each machine). AMD EPYC, 2026-11 (before the
layout was measured; the few-row layout was then used at every row count, which these timings say the
measurement picks there too):

    tokens in the forward          1     2     3     4     5     6     8    12    16
    300 cached, stock kernels     55    90   111    80    73    78    80    84    91
    300 cached, these kernels     34    31    41    40    47    54    60    80    78
    1200 cached, stock kernels    58   101   125    94    89    95    92   101   110
    1200 cached, these kernels    38    37    49    46    55    62    67    91    90

Intel Xeon with AMX, 2026-12-03, the layouts measured (the three, chosen per weight shape: stock on 1-3 rows
except the LM head, packed from 4 or 8 rows on), with specframe's cache (`specframe.kv_cache`) against
transformers' `DynamicCache`; a slow hour of that machine (the same script gave 68 ms for one stock token at 300
cached in the morning):

    tokens in the forward          1     2     3     4     5     6     8    12    16
    300 cached, stock kernels     82    97   105   136   143   154   162   196   215
    300 cached, these kernels     85    89    99   107   127   121   121   149   138
    1200 cached, stock kernels    94   137   147   182   193   207   216   241   239
    1200 cached, these kernels    93   100   114   126   127   130   135   164   168

AMD EPYC, 2026-12-03, the layouts measured (few-row on 2-64 rows, packed for the LM head and the MLP's up
products on one row), 3 and 7 rows padded to 4 and 8, specframe's cache against `DynamicCache` (before the
padding, the same script gave 62 ms for 3 tokens with these kernels and the lean forward):

    tokens in the forward          1     2     3     4     5     6     8    12    16
    300 cached, stock kernels     60    89   107    98   100   102   112   123   130
    300 cached, these kernels     53    55    57    54    66    74    78    94    94
    the same + the lean forward   49    52    53    51    63    71    74    89    90

The outputs of the few-row layout are made row-major again: a column-major query sends SDPA to its slow math
path (measured on the AMD machine: 2 tokens at 1200 cached took 49 ms without that copy, 37 with it).

The results differ from the stock kernels only by float rounding (summation order), and so do a token's
logits computed in a chunk rather than alone (as with the stock float32 kernels), so chunked verification
reproduces one-token decoding except at exact near-ties. As the layout is measured once per machine (and
again when its timings are deleted, or not kept: `specframe.measurements`), runs on two machines, or before and
after a new measurement, may round differently where the two layouts' times are close. Models loaded by
`specframe.models.load_model` get these kernels unless `target.fast_cpu_kernels` is false; the benchmark runs
transformers' baselines on the stock kernels (`stock_kernels`), as a transformers user gets them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specframe import block_weights as blocks_module
from specframe import measurements
from specframe.block_weights import (
    block_products,
    blocks_available,
    copies_outdated,
    drop_derived_copies,
    kept_copy,
    weight_blocks,
)

MAX_ROWS = 64  # longer inputs (prefills) keep PyTorch's own path
PAD_ROWS = {1: 2, 3: 4, 7: 8, **{n: 16 for n in range(10, 16)}}  # row counts computed as a larger, faster product
ATTENTION = "specframe_sdpa"
# Row counts at which the layouts are timed against each other; a count between two of them follows the
# larger one (5-8 rows follow 8; the packed layout pads them to 8 rows).
MEASURED_ROWS = (1, 2, 3, 4, 8, 16, 32, 64)
# The three layouts of a product (`LAYOUTS`): PyTorch's own `F.linear`; `W @ X.T` ("few-rows"); MKL's packed
# product ("packed": the weight reordered once for a row count by MKL, kept beside the weight, one copy per
# row count used, only up to PACKED_MAX_ROWS rows and where this PyTorch has MKL).
STOCK, FEW_ROWS, PACKED = "stock", "few-rows", "packed"
LAYOUTS = (STOCK, FEW_ROWS, PACKED)
PACKED_MAX_ROWS = 16  # (each row count packed is another copy of the weights: the count of copies stays small)
# Another layout is used where its fastest call takes at most this fraction of the stock one's (a clear
# win: on a noisy machine the choice should not flip between processes).
CLEAR_WIN = 0.9
MEASURE_BUDGET_S = 0.6  # about the most the timing of one weight shape takes
MIN_CALLS, MAX_CALLS = 2, 9  # timed calls of each layout per measured row count
COLD_BYTES, MAX_COPIES = 96 * 2**20, 127  # weights timed in turn: more than the CPU caches hold (`_cold_copies`)
# "measure" (default): per weight shape and thread count, the layout measured fastest on this machine at that
# row count; "few-rows" or "packed": that layout wherever it applies; "stock": never another (tests pin the
# layout with these).
layout_choice = "measure"
LAYOUT_CHOICES = ("measure", FEW_ROWS, PACKED, STOCK)
_plans: dict[tuple[int, int, int], tuple[str, ...]] = {}  # (out, in, threads) -> layout, by rows 0..MAX_ROWS
_stock_linear = F.linear  # (by this name, so that a test can time a stand-in)


def _mkl_packing() -> bool:
    try:
        return bool(torch._C.has_mkl) and callable(torch.ops.mkl._mkl_reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


PACKED_AVAILABLE = _mkl_packing()


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, for float32 CPU inputs of 1-64 rows: through the weight's blocks where it is on
    a GGUF block grid (`specframe.block_weights`: 1-16 rows), else through the layout that is fastest on this
    machine at that row count for that weight shape (`layout_plan`)."""
    rows = x.numel() // weight.shape[1] if x.dim() else 0
    if not (1 <= rows <= MAX_ROWS and x.is_cpu and x.dtype == torch.float32) or layout_choice == STOCK:
        return _stock_linear(x, weight, bias)
    if _blocks_here(x, weight, rows):
        blocks = weight_blocks(weight)
        if blocks is not None:
            return block_products(x, blocks, bias)
    layout = layout_plan(weight)[rows] if layout_choice == "measure" else layout_choice
    if layout == PACKED:
        if _packs_here(x, weight, rows):
            return _packed_layout(x, weight, bias, rows)
        layout = STOCK
    if layout == FEW_ROWS:
        return _few_rows_layout(x, weight, bias, rows)
    return _stock_linear(x, weight, bias)


def _few_rows_layout(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """`F.linear` as `W @ X.T` with a contiguous X (padded to PAD_ROWS' counts), output row-major."""
    out_features = weight.shape[0]
    flat = _padded_rows(x, weight.shape[1], rows, PAD_ROWS.get(rows, rows))  # (a strided X is ~1.7x slower)
    y = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # row-major out: SDPA needs it
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


def _padded_rows(x: torch.Tensor, in_features: int, rows: int, padded: int) -> torch.Tensor:
    """`x` as a contiguous [padded, in_features] matrix: its `rows` rows, then copies of the last one
    (materialised: an expanded view is slower still; one copy in all, none when `x` is contiguous and unpadded)."""
    flat = x.reshape(rows, in_features)
    if padded > rows:
        flat = torch.cat([flat, flat[-1:].expand(padded - rows, -1)])
    return flat.contiguous()


def _packs_here(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether the packed layout can compute this product: MKL present, a float32 CPU weight, at most
    PACKED_MAX_ROWS rows, and no gradient wanted (MKL's packed product has none)."""
    return (
        PACKED_AVAILABLE
        and rows <= PACKED_MAX_ROWS
        and weight.is_cpu
        and weight.dtype == torch.float32
        and not _gradient_wanted(x, weight)
    )


def _gradient_wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd would record a product of `x` and `weight` (the packed and block kernels have no backward)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def _blocks_here(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether a product may use the weight's blocks (`specframe.block_weights`) if it has any: the kernel
    built, at most its MAX_ROWS rows, and no gradient wanted."""
    return rows <= blocks_module.MAX_ROWS and not _gradient_wanted(x, weight) and blocks_available()


def _measured_rows(rows: int) -> int:
    """The nearest of MEASURED_ROWS at or above `rows`: the count whose measured layout a product of `rows` rows
    follows, and the count the packed layout packs and computes it for."""
    return next(m for m in MEASURED_ROWS if m >= rows)


def _packed_layout(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """`F.linear` through MKL's packed product: the weight reordered once for `_measured_rows(rows)` rows (kept
    beside it, `_packed_weight`); fewer rows are padded with copies of the last row, dropped after."""
    packed_rows = _measured_rows(rows)
    flat = _padded_rows(x, weight.shape[1], rows, packed_rows)
    y = torch.ops.mkl._mkl_linear(flat, _packed_weight(weight, packed_rows), weight, bias, packed_rows)
    return y[:rows].reshape(*x.shape[:-1], weight.shape[0])


def _packed_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` packed by MKL for products of `rows` rows: made on first use, made again when the weight has
    changed since (`kept_copy`)."""
    return kept_copy(
        weight, ("mkl-packed", rows), lambda: torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
    )


def forget_outdated(weights: list[torch.Tensor]) -> int:
    """Drop the blocks and packed copies of each of `weights` whose numbers changed since they were made, also
    where no version counter shows it (`copies_outdated`: through `.data`, as PEFT's merge adds its update, or a
    new tensor put in its place); returns how many. All samples compared at once (~4 ms for SmolLM2-135M's
    weights and stacked buffers)."""
    noted = [w for w in weights if blocks_module.noted_sample(w) is not None]
    if not noted or blocks_module.samples_unchanged(noted):  # (the common case)
        return 0
    outdated = [w for w in noted if copies_outdated(w)]
    for w in outdated:
        drop_derived_copies(w)
    return len(outdated)


def layout_plan(weight: torch.Tensor) -> tuple[str, ...]:
    """The layout used for `weight`'s shape at each row count 0..MAX_ROWS (one of LAYOUTS), with PyTorch's
    current thread count: measured (on `weight` itself) by `measure_layouts` once on this machine, and kept
    (`specframe.measurements`, as the layout at each of MEASURED_ROWS) for later processes."""
    key = (weight.shape[0], weight.shape[1], torch.get_num_threads())
    plan = _plans.get(key)
    if plan is None:
        name = f"{key[0]}x{key[1]} threads={key[2]}"
        plan = _plan_from(measurements.stored(LAYOUTS_KEPT, _LAYOUT_SOURCES).get(name))
        if plan is None:
            if not _announced:
                _announce_measuring()
            plan = measure_layouts(weight)
            measurements.store(LAYOUTS_KEPT, _LAYOUT_SOURCES, name, {str(r): plan[r] for r in MEASURED_ROWS})
        _plans[key] = plan
    return plan


def plan_layouts_now(weight: torch.Tensor) -> None:
    """Measure (or read) the layout plan of a weight made after load (the lean forward's stacked products) now,
    where `few_rows_linear` would otherwise measure it inside its first product."""
    if layout_choice == "measure" and weight.is_cpu and weight.dtype == torch.float32:
        layout_plan(weight)


LAYOUTS_KEPT = "layouts"  # the kind of measurement kept (`specframe.measurements`)
_LAYOUT_SOURCES = (Path(__file__),)  # the code whose layouts are timed
_announced = False  # (whether this process said that it measures layouts)


def _announce_measuring() -> None:
    """Say once per process, where timings are kept, that they are taken (where they are not, every process
    takes them, as tests do: nothing said)."""
    global _announced
    _announced = True
    folder = measurements.kept_folder(LAYOUTS_KEPT, _LAYOUT_SOURCES)
    if folder is not None:
        print(
            "specframe: timing this CPU's matrix products for the model's weight shapes (about 1 s each, once per "
            f"machine; kept in {folder})",
            file=sys.stderr,
            flush=True,
        )


def _plan_from(kept: Any) -> tuple[str, ...] | None:
    """A plan from its kept form, the layout at each of MEASURED_ROWS; None unless it is exactly that."""
    by_rows = {str(rows) for rows in MEASURED_ROWS}
    if not isinstance(kept, dict) or set(kept) != by_rows or not all(c in LAYOUTS for c in kept.values()):
        return None
    return (STOCK, *(kept[str(_measured_rows(r))] for r in range(1, MAX_ROWS + 1)))


def measure_layouts(weight: torch.Tensor, timer: Callable[[], float] = time.perf_counter) -> tuple[str, ...]:
    """Time `F.linear`, the few-row layout and (where it applies) the packed one on `weight` (float32, CPU) at
    each of MEASURED_ROWS, their calls alternating, and return for every row count 0..MAX_ROWS the layout that
    wins clearly at the nearest measured count at or above it: the faster of the other two where its fastest
    call (the fastest, as a busy machine only adds time) takes at most CLEAR_WIN of the stock one's, else the
    stock one. A timed call runs the product on `_cold_copies(weight)` in turn, as a forward reads each layer's
    weights from memory, not from cache. At most MAX_CALLS timed rounds per count, fewer (MIN_CALLS) once
    ~MEASURE_BUDGET_S / len(MEASURED_ROWS) is spent: an LM head's product takes milliseconds."""
    chosen = {}
    gen = torch.Generator().manual_seed(0)
    weights = _cold_copies(weight)
    calls = {
        STOCK: lambda x, w: _stock_linear(x, w),
        FEW_ROWS: lambda x, w: _few_rows_layout(x, w, None, x.shape[0]),
        PACKED: lambda x, w: _packed_layout(x, w, None, x.shape[0]),
    }

    def timed(layout: str, x: torch.Tensor) -> float:
        t0 = timer()
        for w in weights:
            calls[layout](x, w)
        return timer() - t0

    with torch.no_grad():
        for rows in MEASURED_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen)
            layouts = LAYOUTS if _packs_here(x, weight, rows) else (STOCK, FEW_ROWS)
            # (a warm-up call of each before the first count's, and of a new packed copy, not kept but spent
            # from its budget)
            warm = layouts if rows == MEASURED_ROWS[0] else (PACKED,) if PACKED in layouts else ()
            spent = sum(timed(layout, x) for layout in warm)
            times: dict[str, list[float]] = {layout: [] for layout in layouts}
            while len(times[STOCK]) < MAX_CALLS:
                for layout in layouts:
                    times[layout].append(timed(layout, x))
                    spent += times[layout][-1]
                if len(times[STOCK]) >= MIN_CALLS and spent >= MEASURE_BUDGET_S / len(MEASURED_ROWS):
                    break
            best = min((min(times[layout]), layout) for layout in layouts if layout != STOCK)
            chosen[rows] = best[1] if best[0] <= CLEAR_WIN * min(times[STOCK]) else STOCK
            for w in weights:  # (the copies made for the timing; `weight`'s own are made again when used)
                drop_derived_copies(w)
    return (STOCK, *(chosen[_measured_rows(r)] for r in range(1, MAX_ROWS + 1)))


def _cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and copies of it, COLD_BYTES in all (at most MAX_COPIES copies): run through in turn, they
    leave the products no weights in the CPU's caches, as in a forward of a model larger than them."""
    count = min(MAX_COPIES, max(0, COLD_BYTES // max(1, weight.numel() * weight.element_size()) - 1))
    with torch.no_grad():
        return [weight.detach(), *(weight.detach().clone() for _ in range(count))]


def _linear_few_rows(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_rows_linear(x, module.weight, module.bias)


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa` attention, except that masked grouped-query attention on CPU skips `repeat_kv`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and not kwargs.get("output_attentions") and not kwargs.get("softcap")
    if query.device.type == "cpu" and attention_mask is not None and groups > 1 and plain:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _sdpa_gqa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks transformers builds for `sdpa`


_register_attention()  # (at import: a model saved with the name, e.g. pickled, finds it in a new process)

# Model types whose attention may be renamed `specframe_sdpa`: checked to give the stock logits up to rounding.
# Some model code tests the name itself (DeepSeek-V3.2's sparse indexer applies its top-k mask only under
# "eager" or "sdpa"), so a model type not listed here keeps transformers' `sdpa` (and only the linear layers).
FAST_ATTENTION_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "phi3", "granite", "olmo2", "stablelm", "cohere",
     "gpt2", "opt", "gpt_neox"}
)  # fmt: skip
_MARK = "_specframe_fast_cpu_kernels"  # set on a model that `use_fast_cpu_kernels` was given


def fast_kernels_on(model: torch.nn.Module) -> bool:
    """Whether `model` was given specframe's CPU kernels (by `load_model`, unless `fast_cpu_kernels` was false):
    a proposer's own models follow the target in this."""
    return bool(getattr(model, _MARK, False))


def use_fast_cpu_kernels(model: torch.nn.Module) -> int:
    """Give `model`'s float32 CPU `nn.Linear` layers the few-row layout where it is faster (`layout_plan`,
    measured here for each weight shape) and their blocks where their weights are on a GGUF block grid
    (`specframe.block_weights`, found here; a layer with neither is left as it is, so it costs nothing) and,
    where the model uses `sdpa` attention and its type is in FAST_ATTENTION_MODEL_TYPES, `specframe_sdpa`;
    returns how many linear layers were rerouted."""
    if layout_choice not in LAYOUT_CHOICES:
        raise ValueError(f"specframe.cpu_kernels.layout_choice must be one of {LAYOUT_CHOICES}, got {layout_choice!r}")
    n = eligible = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            if module.weight.dtype == torch.float32 and ("forward" not in module.__dict__ or is_rerouted(module)):
                eligible += 1
                on_blocks = layout_choice != STOCK and blocks_available() and weight_blocks(module.weight) is not None
                if layout_choice == "measure" and set(layout_plan(module.weight)) == {STOCK} and not on_blocks:
                    module.__dict__.pop("forward", None)  # (rerouted before, e.g. with another thread count)
                    continue
                module.forward = functools.partial(_linear_few_rows, module)  # (picklable, unlike a bound method)
                n += 1
    config = getattr(model, "config", None)
    if (
        eligible
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and getattr(config, "model_type", None) in FAST_ATTENTION_MODEL_TYPES
        and hasattr(model, "set_attn_implementation")
    ):
        model.set_attn_implementation(ATTENTION)
    setattr(model, _MARK, True)
    return n


def is_rerouted(module: torch.nn.Module) -> bool:
    """Whether `module` is an `nn.Linear` that `use_fast_cpu_kernels` gave the few-row layout."""
    forward = module.__dict__.get("forward")
    return (
        type(module) is torch.nn.Linear and isinstance(forward, functools.partial) and forward.func is _linear_few_rows
    )


def use_stock_kernels(model: torch.nn.Module) -> Callable[[], None]:
    """Undo `use_fast_cpu_kernels` in `model` and every module in it (a wrapper's inner model too); returns a
    function that puts back exactly what was undone (modules shared with other models included)."""
    modules = list(model.modules())
    linears = {m: m.__dict__["forward"] for m in modules if is_rerouted(m)}  # (another library's override stays)
    configs = {
        id(c): c for m in modules if getattr(c := getattr(m, "config", None), "_attn_implementation", None) == ATTENTION
    }
    marked = [m for m in modules if fast_kernels_on(m)]
    for module in linears:
        del module.forward
    for config in configs.values():  # (attention layers read the name off their config)
        config._attn_implementation = "sdpa"
    for module in marked:
        setattr(module, _MARK, False)

    def restore() -> None:
        for module, forward in linears.items():
            module.forward = forward
        for config in configs.values():
            config._attn_implementation = ATTENTION
        for module in marked:
            setattr(module, _MARK, True)

    return restore


@contextlib.contextmanager
def stock_kernels(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` on PyTorch's and transformers' own kernels for the duration (e.g. a transformers baseline)."""
    restore = use_stock_kernels(model)
    try:
        yield
    finally:
        restore()
