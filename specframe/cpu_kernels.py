"""Faster CPU kernels for the few-token forwards of decoding and verification (float32).

Decoding runs the target on one token, verifying a proposal on 2-64. How well PyTorch's default kernels handle
those shapes depends on the CPU, so what is used is measured on the machine:

1. `linear` on 1-64 rows. On this project's 2-core AMD EPYC machines (torch 2.13, MKL) a one-row `linear` is a
   matrix-vector product that reads the weights at about a third of the bandwidth that a two-column matrix
   product gets; on 2-64 rows, `X @ W.T` is slower again than `W @ X.T` with a contiguous X; and 10-15 rows cost
   more than 16. The *few-row layout* computes `W @ X.T`, one row duplicated into two columns and 10-15 rows
   padded to 16 (padding rows are copies, dropped after). On its 2-core Intel Xeon machines (AMX, the same
   torch) the stock products are the fast ones: the few-row layout is 2-5x slower on one to four rows of a
   layer's weight. So each float32 CPU `nn.Linear` of a model given these kernels, and each few-row product of
   a proposer (`few_rows_linear`), uses the few-row layout only at the row counts where it is clearly faster on
   this machine: both are timed once per weight shape and thread count (`measure_layouts`, at load for a
   model's layers: 0.01-0.7 s a shape, ~1 s for SmolLM2-135M) and the stock product is kept where they are close.
2. transformers' `sdpa` attention copies the key/value heads of grouped-query attention (`repeat_kv`, a copy
   of the whole cache per layer) whenever a mask is given, that is on every multi-token forward; PyTorch's SDPA
   does grouped-query attention itself (`enable_gqa`) with a mask on CPU (on the Intel machine, SDPA alone at
   300-1200 cached: 2-4x faster). `specframe_sdpa` does that on CPU and is transformers' own `sdpa` otherwise
   (for the model types in FAST_ATTENTION_MODEL_TYPES only).

SmolLM2-135M, median ms per forward, stock and these kernels interleaved in one run per context length
(`scripts/kernel_timings.py`, `CONTEXT=1200` for the second of each machine). AMD EPYC, 2026-11 (before the
layout was measured; the few-row layout was then used at every row count, which these timings say the
measurement picks there too):

    tokens in the forward          1     2     3     4     5     6     8    12    16
    300 cached, stock kernels     55    90   111    80    73    78    80    84    91
    300 cached, these kernels     34    31    41    40    47    54    60    80    78
    1200 cached, stock kernels    58   101   125    94    89    95    92   101   110
    1200 cached, these kernels    38    37    49    46    55    62    67    91    90

Intel Xeon with AMX, 2026-12-03, the layout measured (it kept the stock product on one to four rows for every
weight shape, and chose the few-row one for some shapes at 8-32 rows); the few-row layout everywhere, as
before, took 100 ms for one token at 300 cached:

    tokens in the forward          1     2     3     4     5     6     8    12    16
    300 cached, stock kernels     68    82    80   101   116   116   134   157   153
    300 cached, these kernels     69    74    76    96   103   115   125   162   138
    1200 cached, stock kernels    76    99   110   137   135   130   159   181   179
    1200 cached, these kernels    72    78    86   106   112   122   127   161   157

The outputs of the few-row layout are made row-major again: a column-major query sends SDPA to its slow math
path (measured on the AMD machine: 2 tokens at 1200 cached took 49 ms without that copy, 37 with it).

The results differ from the stock kernels only by float rounding (summation order), and so do a token's
logits computed in a chunk rather than alone (as with the stock float32 kernels), so chunked verification
reproduces one-token decoding except at exact near-ties. As the layout is measured per process, two runs may
round differently where the two layouts' times are close. Models loaded by `specframe.models.load_model` get
these kernels unless `target.fast_cpu_kernels` is false; the benchmark runs transformers' baselines on the stock
kernels (`stock_kernels`), as a transformers user gets them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # longer inputs (prefills) keep PyTorch's own path
PAD_ROWS = {1: 2, **{n: 16 for n in range(10, 16)}}  # row counts computed as a larger, faster product
ATTENTION = "specframe_sdpa"
# Row counts at which the two layouts are timed against each other; a count between two of them follows the
# larger one (5-8 rows follow 8).
MEASURED_ROWS = (1, 2, 3, 4, 8, 16, 32, 64)
# The few-row layout is used where its fastest call takes at most this fraction of the stock one's (a clear
# win: on a noisy machine the choice should not flip between processes).
CLEAR_WIN = 0.9
MEASURE_BUDGET_S = 0.4  # about the most the timing of one weight shape takes (a large one; a small one less)
MIN_CALLS, MAX_CALLS = 2, 9  # timed calls of each layout per measured row count
# "measure" (default): per weight shape and thread count, the layout measured faster on this machine at that
# row count; "few-rows": always the few-row layout; "stock": never (tests pin the layout with this).
layout_choice = "measure"
LAYOUT_CHOICES = ("measure", "few-rows", "stock")
_plans: dict[tuple[int, int, int], tuple[bool, ...]] = {}  # (out, in, threads) -> few-row layout wins, by rows
_stock_linear = F.linear  # (by this name, so that a test can time a stand-in)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the few-row layout for float32 CPU inputs of 1-64 rows where that
    layout is the faster one on this machine (`layout_plan`)."""
    rows = x.numel() // weight.shape[1] if x.dim() else 0
    if not (1 <= rows <= MAX_ROWS and x.is_cpu and x.dtype == torch.float32) or layout_choice == "stock":
        return _stock_linear(x, weight, bias)
    if layout_choice == "measure":
        if not layout_plan(weight)[rows]:
            return _stock_linear(x, weight, bias)
    return _few_rows_layout(x, weight, bias, rows)


def _few_rows_layout(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """`F.linear` as `W @ X.T` with a contiguous X (1 row duplicated, 10-15 padded to 16), output row-major."""
    in_features, out_features = weight.shape[1], weight.shape[0]
    flat = x.reshape(rows, in_features)
    padded = PAD_ROWS.get(rows, rows)
    if padded > rows:  # materialised copies of the last row (an expanded view is slower still), in one copy
        flat = flat.expand(padded, -1) if rows == 1 else torch.cat([flat, flat[-1:].expand(padded - rows, -1)])
    flat = flat.contiguous()  # a strided X is ~1.7x slower (no copy when it is contiguous already)
    y = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # row-major out: SDPA needs it
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


def layout_plan(weight: torch.Tensor) -> tuple[bool, ...]:
    """Whether the few-row layout is used for `weight`'s shape at each row count 0..MAX_ROWS, with PyTorch's
    current thread count: measured once per process (on `weight` itself) by `measure_layouts`."""
    key = (weight.shape[0], weight.shape[1], torch.get_num_threads())
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = measure_layouts(weight)
    return plan


def measure_layouts(weight: torch.Tensor, timer: Callable[[], float] = time.perf_counter) -> tuple[bool, ...]:
    """Time `F.linear` against the few-row layout on `weight` (float32, CPU) at each of MEASURED_ROWS, the calls
    of the two alternating, and return for every row count 0..MAX_ROWS whether the few-row layout wins clearly
    (fastest call at most CLEAR_WIN of the stock one's; the fastest, as a busy machine only adds time) at the
    nearest measured count at or above it. At most MAX_CALLS timed pairs per count, fewer (MIN_CALLS) once
    ~MEASURE_BUDGET_S / len(MEASURED_ROWS) is spent: an LM head's product takes milliseconds."""
    wins = {}
    gen = torch.Generator().manual_seed(0)

    def timed(x: torch.Tensor, few_rows: bool) -> float:
        t0 = timer()
        _few_rows_layout(x, weight, None, x.shape[0]) if few_rows else _stock_linear(x, weight)
        return timer() - t0

    with torch.no_grad():
        for rows in MEASURED_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen)
            # (a warm-up call of each before the first count's, not kept but spent from its budget)
            spent = timed(x, False) + timed(x, True) if rows == MEASURED_ROWS[0] else 0.0
            stock: list[float] = []
            few: list[float] = []
            while len(stock) < MAX_CALLS:
                stock.append(timed(x, False))
                few.append(timed(x, True))
                spent += stock[-1] + few[-1]
                if len(stock) >= MIN_CALLS and spent >= MEASURE_BUDGET_S / len(MEASURED_ROWS):
                    break
            wins[rows] = min(few) <= CLEAR_WIN * min(stock)
    return (False, *(wins[next(m for m in MEASURED_ROWS if m >= r)] for r in range(1, MAX_ROWS + 1)))


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
    measured here for each weight shape; a layer whose shape keeps the stock product at every row count is left
    as it is, so it costs nothing) and, where the model uses `sdpa` attention and its type is in
    FAST_ATTENTION_MODEL_TYPES, `specframe_sdpa`; returns how many linear layers were rerouted."""
    if layout_choice not in LAYOUT_CHOICES:
        raise ValueError(f"specframe.cpu_kernels.layout_choice must be one of {LAYOUT_CHOICES}, got {layout_choice!r}")
    n = eligible = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            if module.weight.dtype == torch.float32 and ("forward" not in module.__dict__ or is_rerouted(module)):
                eligible += 1
                if layout_choice == "measure" and not any(layout_plan(module.weight)):  # (timed now, at load)
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
