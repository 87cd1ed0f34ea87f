"""Timings of this machine kept on disk, so that later processes read them instead of timing again.

What specframe times at load (which product layout is fastest per weight shape, `specframe.cpu_kernels`; what
verifying a few more tokens costs the target, `specframe.step_costs`) depends on the CPU, the software and the
code that runs, not on the process. Timing it again in every process cost ~11 s of a ~21 s `specframe generate`
on a 2-core machine, and let two processes choose differently where two options' times were close. So each kind
of measurement is kept in one JSON file per machine and software under specframe's cache root
(`~/.cache/specframe/<kind>/`, `$SPECFRAME_HOME` where set): its name hashes what describes the machine (the
CPU's name, family, model, stepping and instruction-set flags, the logical CPU count, the architecture) and the
software (PyTorch's version, its CPU capability and MKL) and the source of the code that the timings measured,
so a change to any of them makes a new file. Delete the folder to time again (e.g. after timing on a busy
machine), or set `SPECFRAME_KEEP_TIMINGS=0` to neither read nor keep timings: these choices change speed, and
at most float rounding, never the output's distribution (a proposal shape chosen from the timings does change
which random numbers a sampled run draws, so the tokens one seed gives). A damaged file is timed again and
rewritten; where the cache cannot be read or written, each process times for itself, as before. Two processes
timing at once may both write: the last one's file wins, and what the other kept is timed again when next needed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

KEEP_ENV = "SPECFRAME_KEEP_TIMINGS"  # 0 (false, no, off): timings are neither read from nor written to disk
_OFF = ("0", "false", "no", "off")
# Failures of the cache that leave a process to time for itself (RuntimeError: no home directory to expand;
# RecursionError: a damaged file of deeply nested brackets).
_CACHE_ERRORS = (OSError, ValueError, RuntimeError, RecursionError)


def keeping() -> bool:
    """Whether timings are read from and written to disk: unless `$SPECFRAME_KEEP_TIMINGS` is 0 (or false, no,
    off)."""
    return os.environ.get(KEEP_ENV, "1").strip().lower() not in _OFF


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows of it."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache
def machine_key() -> str:
    """What identifies this machine and its PyTorch for timings: the CPU's name, the cpuinfo lines that tell
    one CPU from another (family, model, stepping, flags; ARM's implementer, part, variant and revision;
    POWER's cpu and revision), the logical CPU count,
    the architecture, PyTorch's version, its CPU capability and whether it has MKL."""
    telling = (  # x86, ARM (implementer, part, variant, revision), POWER (cpu, revision)
        "cpu family", "model\t", "model :", "stepping", "flags", "features", "cpu implementer", "cpu part",
        "cpu variant", "cpu revision", "cpu\t", "revision",
    )  # fmt: skip
    first_cpu: list[str] = []
    for line in _cpuinfo_lines():
        if not line.strip():
            break  # (the first processor's lines tell it all)
        if line.lower().startswith(telling):
            first_cpu.append(" ".join(line.split()))
    parts = [
        cpu_name(),
        *first_cpu,
        str(os.cpu_count()),
        platform.machine(),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        str(torch.backends.mkl.is_available()),
    ]
    return "\0".join(parts)


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def stored_file(kind: str, sources: Sequence[Path]) -> Path:
    """The file that keeps timings of `kind` taken on this machine with this software and `sources`."""
    from specframe.models import cache_dir

    key = hashlib.sha256(b"\0".join([machine_key().encode(), *(Path(s).read_bytes() for s in sources)]))
    return cache_dir() / kind / f"{key.hexdigest()[:16]}.json"


def stored(kind: str, sources: Sequence[Path]) -> dict[str, Any]:
    """The timings kept in `stored_file(kind, sources)`, by name ({} when none are, or the file cannot be
    read: the caller checks each value it reads)."""
    if not keeping():
        return {}
    try:
        kept = json.loads(stored_file(kind, sources).read_text())
    except _CACHE_ERRORS:
        return {}
    found = kept.get("measurements") if isinstance(kept, dict) else None
    return found if isinstance(found, dict) else {}


def store(kind: str, sources: Sequence[Path], name: str, value: Any) -> None:
    """Keep `value` (JSON, finite numbers) as timing `name` of `kind`, beside the others (written aside, then
    renamed). Nothing is kept where the cache cannot be written."""
    if not keeping():
        return
    try:
        path = stored_file(kind, sources)
        kept = {
            "cpu": cpu_name(),
            "logical_cpus": os.cpu_count(),
            "torch": torch.__version__,
            "measurements": {**stored(kind, sources), name: value},
        }
        text = json.dumps(kept, indent=1, allow_nan=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            aside = Path(work) / path.name
            aside.write_text(text)
            os.replace(aside, path)
    except (*_CACHE_ERRORS, TypeError):  # (TypeError: a value that is not JSON)
        pass


def kept_folder(kind: str, sources: Sequence[Path]) -> Path | None:
    """The folder timings of `kind` are kept in (made here), for messages; None where they are not kept or it
    cannot be made."""
    if not keeping():
        return None
    try:
        folder = stored_file(kind, sources).parent
        folder.mkdir(parents=True, exist_ok=True)
    except _CACHE_ERRORS:
        return None
    return folder
