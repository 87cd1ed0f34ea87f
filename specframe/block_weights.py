"""Products with weights that are exactly a GGUF block grid, read in their 4- or 8-bit form (float32, CPU).

The default target is SmolLM2-135M-Instruct from a Q4_1 GGUF (its embeddings, the tied LM head, in Q8_0),
dequantised to float32 on load: a forward on a few tokens reads 537 MB of float32 weights, and on this project's
2-core machines that reading was most of its time (~28 of ~45 ms, docs/models.md). Those float32 weights hold no
more than the file did: every block of 32 along a row is `scale * q + min`, with a 16-bit float scale and min and
a 4-bit q (Q4_1), or `scale * q` with an 8-bit q (Q8_0). `block_grid` finds that form again in a float32 weight,
and accepts it only where it gives back every number of the weight exactly; `block_products` then multiplies by
the blocks, 0.19x (4-bit, with float32 scales and mins) or 0.28x (8-bit) of the bytes, each block turned back into
exactly the float32 numbers of the weight (`scale * q` is exact in float32, and the min is added with one
rounding, as the dequantisation did) and multiplied in float32. So the product is the float32 model's, summed in
another order (as the few-row layout's is: `specframe.cpu_kernels`).

The kernel (`block_weights.c`, AVX2 and FMA, threads from PyTorch's own OpenMP runtime) is compiled on first use
with the machine's C compiler (`$CC`, else `cc`) into specframe's cache; where there is no compiler, the CPU lacks
AVX2 or the build fails, `block_kernel()` is None, `block_kernel_problem()` says why, and products use the float32
weights. The blocks of a weight are found once and kept beside it (0.19x or 0.28x its bytes, not pickled or copied),
and found again after the weight changes in place (its version counter), is replaced, or changes where no counter
shows it (through `.data`: a sample of its numbers, compared at the start of each generation, `copies_outdated`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specframe.fingerprint import file_sha256

BLOCK = 32  # weights per block along a row, in GGUF's Q4_1 and Q8_0
MAX_ROWS = 16  # input rows multiplied by the blocks; more (a prefill) use the float32 weights
FIRST_ROWS = 8  # weight rows checked before the whole weight (most weights are on no grid: found out early)
SOURCE = Path(__file__).with_name("block_weights.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
use_blocks = True  # False: products always use the float32 weights (tests compare the two with it)


class BlockWeights(NamedTuple):
    """A [out, in] weight as blocks of BLOCK along each row: w[n, k] = scales[n, k // 32] * q[n, k] (+ mins[...])."""

    bits: int  # 4 (Q4_1: q in 0..15, with mins) or 8 (Q8_0: q in -128..127, no mins)
    quants: torch.Tensor  # 4: uint8 [out, in // 32, 16], byte j = q[j] | q[j + 16] << 4; 8: int8 [out, in // 32, 32]
    scales: torch.Tensor  # float32 [out, in // 32]
    mins: torch.Tensor | None  # float32 [out, in // 32] for bits 4, else None


def block_grid(weight: torch.Tensor) -> BlockWeights | None:
    """`weight` (float32 CPU [out, in], `in` a multiple of 32) as Q4_1 or Q8_0 blocks that give back each of its
    numbers exactly, or None where it is on neither grid. The Q4_1 min is a block's least number (q = 0) and its
    scale the range over 15 rounded to a 16-bit float (as llama.cpp quantises); Q8_0's scale is the largest
    magnitude over 127. What decides is the check that the blocks give back the weight, bit for bit."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or not weight.is_cpu or weight.shape[1] % BLOCK:
        return None
    with torch.no_grad():
        w = weight.detach()
        head = w[:FIRST_ROWS]
        for grid in (_q4_1, _q8_0):  # (the whole weight only where its first rows are on the grid; rows that are
            found = grid(w) if grid(head) is not None else None  # on both, zeros say, try the next grid)
            if found is not None:
                return found
    return None


def _q4_1(w: torch.Tensor) -> BlockWeights | None:
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    mins = blocks.amin(-1)
    scales = ((blocks.amax(-1) - mins) / 15).half().float()
    q = torch.round((blocks - mins[..., None]) / torch.where(scales == 0, 1.0, scales)[..., None]).clamp_(0, 15)
    if not torch.equal(scales[..., None] * q + mins[..., None], blocks):
        return None
    q = q.to(torch.uint8)
    return BlockWeights(4, (q[..., :16] | (q[..., 16:] << 4)).contiguous(), scales, mins)


def _q8_0(w: torch.Tensor) -> BlockWeights | None:
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    scales = blocks.abs().amax(-1) / 127
    q = torch.round(blocks / torch.where(scales == 0, 1.0, scales)[..., None]).clamp_(-128, 127)
    if not torch.equal(scales[..., None] * q, blocks):
        return None
    return BlockWeights(8, q.to(torch.int8).contiguous(), scales, None)


def q8_0_rounded(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in], finite, `in` a multiple of 32) rounded to GGUF's Q8_0 grid, as float32: each block of
    32 along a row becomes `scale * q`, with `scale` its largest magnitude over 127 kept to 11 significant bits
    (the precision of GGUF's 16-bit scales; the same numbers as a 16-bit float in its normal range, without its
    range limits) and q = round(w / scale) in -127..127 (the largest magnitude at +-127). The products are exact in
    float32, so `block_grid` finds these blocks again; each number moves by at most half a scale."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"Q8_0 rounds [out, in] weights with `in` a multiple of {BLOCK}, not {list(weight.shape)}")
    with torch.no_grad():
        blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
        if not torch.isfinite(blocks).all():
            raise ValueError("Q8_0 rounds finite weights; this one holds inf or NaN")
        mantissas, exponents = torch.frexp(blocks.abs().amax(-1, keepdim=True) / 127)  # (mantissas in [0.5, 1))
        scales = torch.ldexp(torch.round(mantissas * 2048) / 2048, exponents)  # 11 significant bits, to nearest
        q = torch.round(blocks / torch.where(scales == 0, 1.0, scales)).clamp_(-127, 127)
        return (scales * q).reshape(weight.shape)


def round_linears_to_q8_0(module: torch.nn.Module) -> int:
    """Round, in place, the float32 weight of each `nn.Linear` in `module` whose input size is a multiple of 32
    to the Q8_0 grid (`q8_0_rounded`), except weights already on a block grid (e.g. rows of a GGUF model's head,
    which may be on the finer Q4_1 one) and weights holding inf or NaN; returns how many were rounded. A weight
    tied to another module (an embedding) is rounded for both."""
    rounded = 0
    for linear in {id(m): m for m in module.modules() if type(m) is torch.nn.Linear}.values():
        weight = linear.weight
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
            continue
        if not torch.isfinite(weight).all() or block_grid(weight.detach().cpu()) is not None:
            continue
        with torch.no_grad():
            weight.copy_(q8_0_rounded(weight))
        rounded += 1
    return rounded


def block_products(x: torch.Tensor, blocks: BlockWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the weight `w` that `blocks` holds (x float32 on the CPU, at most MAX_ROWS rows
    once flattened), through `block_kernel()` (which must be there)."""
    kernel = block_kernel()
    if kernel is None:
        raise RuntimeError(f"the block kernel is not available: {block_kernel_problem()}")
    out_features, in_features = blocks.scales.shape[0], blocks.scales.shape[1] * BLOCK
    flat = x.reshape(-1, in_features).contiguous()
    y = torch.empty(flat.shape[0], out_features, dtype=torch.float32)  # (not the default dtype: the kernel's)
    mins = blocks.mins.data_ptr() if blocks.mins is not None else None
    failed = kernel(
        flat.data_ptr(), flat.shape[0], in_features, blocks.quants.data_ptr(), blocks.bits, blocks.scales.data_ptr(),
        mins, out_features, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("block_products: a thread's buffer for the dequantised weight rows could not be allocated")
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


def blocks_available() -> bool:
    """Whether products may use weights' blocks: `use_blocks` and the kernel built (`block_kernel`)."""
    return use_blocks and block_kernel() is not None


def block_kernel() -> ctypes._CFuncPtr | None:
    """The compiled `block_products` of block_weights.c (built once per source, compiler and flags, in
    `<specframe cache>/kernels/`), or None where it cannot be had here (`block_kernel_problem`)."""
    kernel = _kernel_or_problem()
    return None if isinstance(kernel, str) else kernel


def block_kernel_problem() -> str | None:
    """Why `block_kernel()` is None (no compiler, no AVX2, the build failed), else None."""
    kernel = _kernel_or_problem()
    return kernel if isinstance(kernel, str) else None


@functools.cache
def _kernel_or_problem() -> ctypes._CFuncPtr | str:
    """The kernel, or why there is none: found once per process (`cache_clear()` to look again). A kept library
    that does not load is built again once; one whose products fail a small check is not used (built again from
    the same source by the same compiler, it would fail the same way)."""
    why = ""
    for rebuild in (False, True):
        try:
            path = _built_library(rebuild)
        except _NoKernel as no:
            return str(no)
        try:  # (a library that failed to load is not kept by the loader: built again, it loads at that path)
            function = ctypes.CDLL(str(path)).block_products
        except (OSError, AttributeError) as e:
            why = f"the built kernel {path} did not load ({e})"
            continue
        function.restype = ctypes.c_int
        pointer, count = ctypes.c_void_p, ctypes.c_long
        integer = ctypes.c_int
        function.argtypes = [pointer, count, count, pointer, integer, pointer, pointer, count, pointer, integer]
        if _products_right(function):
            return function
        return f"the built kernel {path} gave wrong products on a small check"
    return why


def _products_right(function: ctypes._CFuncPtr) -> bool:
    """Whether `function` multiplies small random 8-bit and 4-bit blocks as float32 products by the weights they
    stand for do (to rounding)."""
    gen = torch.Generator().manual_seed(0)
    out, groups, rows = 5, 2, 3
    x = torch.randn(rows, groups * BLOCK, generator=gen, dtype=torch.float32)  # (whatever the default dtype)
    scales = torch.rand(out, groups, generator=gen, dtype=torch.float32) / 8
    for bits in (8, 4):
        if bits == 8:
            q = torch.randint(-127, 128, (out, groups, BLOCK), generator=gen)
            quants, mins = q.to(torch.int8), None
            weight = (scales[..., None] * q).reshape(out, -1)
        else:
            q = torch.randint(0, 16, (out, groups, BLOCK), generator=gen)
            quants = (q[..., :16] | q[..., 16:] << 4).to(torch.uint8)
            mins = torch.randn(out, groups, generator=gen, dtype=torch.float32)
            weight = (scales[..., None] * q + mins[..., None]).reshape(out, -1)
        y = torch.empty(rows, out, dtype=torch.float32)
        failed = function(
            x.data_ptr(), rows, groups * BLOCK, quants.data_ptr(), bits, scales.data_ptr(),
            mins.data_ptr() if mins is not None else None, out, y.data_ptr(), 1,
        )  # fmt: skip
        if failed or not torch.allclose(y, x @ weight.T, rtol=1e-5, atol=1e-5):
            return False
    return True


class _NoKernel(Exception):
    pass


def _built_library(rebuild: bool = False) -> Path:
    """The kernel library built for this source, compiler and flags: from the cache when it is there whole (its
    digest, written beside it, matches), else (or with `rebuild`) built now."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise _NoKernel(f"the CPU lacks AVX2 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})")
    compiler = shlex.split(os.environ.get("CC") or "cc")  # (e.g. CC="ccache gcc")
    if not compiler or shutil.which(compiler[0]) is None:
        raise _NoKernel(f"no C compiler ({os.environ.get('CC') or 'cc'!r} not found; set $CC)")
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _NoKernel(f"the C compiler {shlex.join(compiler)!r} did not run: {e}") from e
    made_by = "\0".join([SOURCE.read_text(), shlex.join(compiler), version, *FLAGS])
    key = hashlib.sha256(made_by.encode()).hexdigest()[:16]
    from specframe.models import cache_dir

    path = cache_dir() / "kernels" / f"block_weights-{key}.so"
    digest = path.with_suffix(".sha256")  # (a library cut short, say by a full disk, would crash the process)
    try:
        if not rebuild and path.exists() and digest.read_text().strip() == file_sha256(path):
            return path
    except OSError:
        pass  # (no digest, or unreadable: built again)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:  # (built aside, then renamed: processes may race)
            built = Path(work) / path.name
            try:
                run = subprocess.run(
                    [*compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=300
                )
            except (OSError, subprocess.SubprocessError) as e:
                raise _NoKernel(f"compiling {SOURCE.name} failed: {e}") from e
            if run.returncode != 0:
                said = (run.stderr.strip() or run.stdout.strip() or "nothing said")[-500:]
                raise _NoKernel(f"compiling {SOURCE.name} failed (exit status {run.returncode}): {said}")
            (Path(work) / digest.name).write_text(file_sha256(built) + "\n")
            os.replace(built, path)
            os.replace(Path(work) / digest.name, digest)
    except OSError as e:  # (an unusable cache folder: the kernel is optional, so the run goes on without it)
        raise _NoKernel(
            f"it cannot be kept in {path.parent} ({e.strerror or e}; $SPECFRAME_HOME chooses the cache folder)"
        ) from e
    return path


class DerivedCopies(dict):
    """What is derived from a weight and kept beside it (its blocks, its MKL-packed copies): not pickled or
    deep-copied with it (a copy of the weight derives its own when used)."""

    def __reduce__(self):
        return (type(self), ())

    def __deepcopy__(self, memo):
        return type(self)()


def tensor_version(t: torch.Tensor) -> int:
    """`t._version`, or -1 for an inference-mode tensor (which has no version counter)."""
    try:
        return t._version
    except RuntimeError:
        return -1


# A weight's attributes holding what is derived from it (DerivedCopies each): its copies by slot {slot: ((address,
# version), copy)} (`kept_copy`: its blocks under BLOCKS_SLOT, its MKL-packed copies by row count,
# `specframe.cpu_kernels`); and a sample of the numbers they were all made from {"numbers": ...} (`note_numbers`).
_KEPT = "_specframe_kept"
BLOCKS_SLOT = "blocks"
_NOTED_NUMBERS = "_specframe_copied_from"
SAMPLE_SIDE = 16  # a weight's sampled numbers: at most this many rows and columns, spread over it


def content_sample(weight: torch.Tensor) -> torch.Tensor:
    """A view of a sample of `weight`'s numbers, at most SAMPLE_SIDE x SAMPLE_SIDE spread over its rows and
    columns (any layout, nothing copied): what `copies_outdated` compares to see whether the numbers changed."""
    w = weight.detach()
    if w.dim() != 2:
        w = w.reshape(w.shape[0], -1) if w.dim() else w.reshape(1, 1)
    return w[:: -(-w.shape[0] // SAMPLE_SIDE), :: -(-w.shape[1] // SAMPLE_SIDE)]


def noted_sample(weight: torch.Tensor) -> torch.Tensor | None:
    """The sample of the numbers `weight`'s copies were made from (`note_numbers`), or None (no copies, or a
    weight unpickled without them)."""
    noted = weight.__dict__.get(_NOTED_NUMBERS)
    return None if noted is None else noted.get("numbers")


def samples_unchanged(weights: list[torch.Tensor]) -> bool:
    """Whether every one of `weights` (each with a noted sample) is still where its sample was taken and gives
    the same numbers: all compared at once (one concatenation each side, not a comparison per weight)."""
    noted = [noted_sample(w) for w in weights]
    if any(w.device != n.device or w.dtype != n.dtype for w, n in zip(weights, noted, strict=True)):
        return False
    now = [content_sample(w) for w in weights]
    if any(a.shape != b.shape for a, b in zip(now, noted, strict=True)):
        return False
    # (compared as bytes: NaNs in the same places are the same numbers, and `torch.equal` took 12 ms here for
    # SmolLM2-135M's 54k sampled numbers on a busy 2-core machine, the bytes 0.03 ms)
    flat = (torch.cat([t.reshape(-1) for t in ts]).cpu().numpy().tobytes() for ts in (now, noted))
    return next(flat) == next(flat)


def copies_outdated(weight: torch.Tensor) -> bool:
    """Whether copies were made from `weight` and its numbers have changed since, also where its version counter
    cannot tell: a change through `.data` (PEFT's merge adds its update to `weight.data`), a new tensor put in by
    `weight.data = ...` (which may reuse the old one's address), a move to another device. A sample of the
    numbers is compared: a change to a few rows only may go unseen (`drop_derived_copies` then)."""
    return noted_sample(weight) is not None and not samples_unchanged([weight])


def before_copying(weight: torch.Tensor) -> None:
    """Call before a copy is made from `weight`: where its numbers changed since its other copies were made,
    those are dropped (so every copy kept, and the noted sample, are of the same numbers)."""
    if copies_outdated(weight):
        drop_derived_copies(weight)


def note_numbers(weight: torch.Tensor) -> None:
    """Call after a copy was made from `weight`: take the sample of its numbers, unless its other copies' is
    there (taken from the same numbers: `before_copying`)."""
    if noted_sample(weight) is None:
        setattr(weight, _NOTED_NUMBERS, DerivedCopies(numbers=content_sample(weight).clone()))


def drop_derived_copies(weight: torch.Tensor) -> None:
    """Free `weight`'s blocks and MKL-packed copies (made again when next used), and its noted sample."""
    for name in (_KEPT, _NOTED_NUMBERS):
        weight.__dict__.pop(name, None)


def kept_copy(weight: torch.Tensor, slot: Hashable, make: Callable[[], Any]) -> Any:
    """`make()`, a copy derived from `weight` (e.g. its MKL-packed layout for some row count), kept beside it
    under `slot`: made on first use, and again once the weight's address or version counter changed (a change
    neither shows: `forget_outdated` in `specframe.cpu_kernels`)."""
    key = (weight.data_ptr(), tensor_version(weight))
    entry = weight.__dict__.get(_KEPT, {}).get(slot)
    if entry is None or entry[0] != key:
        before_copying(weight)
        copies = weight.__dict__.setdefault(_KEPT, DerivedCopies())
        entry = copies[slot] = (key, make())
        note_numbers(weight)
    return entry[1]


def weight_blocks(weight: torch.Tensor) -> BlockWeights | None:
    """`block_grid(weight)`, kept beside the weight and found again once its address or version changed."""
    return kept_copy(weight, BLOCKS_SLOT, lambda: block_grid(weight))


def remember_blocks(weight: torch.Tensor, blocks: BlockWeights | None) -> None:
    """Keep `blocks` as `weight`'s (they must hold its numbers: e.g. a weight's own, once it became a view of a
    buffer with the same numbers, or its parts' blocks joined by `joined_blocks` for a stacked buffer)."""
    copies = weight.__dict__.setdefault(_KEPT, DerivedCopies())
    copies[BLOCKS_SLOT] = ((weight.data_ptr(), tensor_version(weight)), blocks)
    note_numbers(weight)


def joined_blocks(parts: list[BlockWeights | None]) -> tuple[BlockWeights | None, list[BlockWeights | None]]:
    """The blocks of the weights `parts` hold, stacked along their output rows, and each part's as a view of
    those (so that they are kept once); (None, `parts`) unless all have blocks of one kind."""
    if any(p is None for p in parts) or len({p.bits for p in parts}) != 1:
        return None, parts
    tensors = [[p.quants for p in parts], [p.scales for p in parts], [p.mins for p in parts]]
    stacked = [torch.cat(ts) if ts[0] is not None else None for ts in tensors]
    sizes = [p.scales.shape[0] for p in parts]
    views = zip(*(t.split(sizes) if t is not None else [None] * len(parts) for t in stacked), strict=True)
    return BlockWeights(parts[0].bits, *stacked), [BlockWeights(parts[0].bits, *fields) for fields in views]
