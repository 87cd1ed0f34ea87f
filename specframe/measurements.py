"""Timings of this machine kept on disk, so that later processes read them instead of timing again.

What specframe times at load (which product layout is fastest per weight shape, `specframe.cpu_kernels`; what
verifying a few more tokens costs the target, `specframe.step_costs`) depends on the CPU, the software and the
code that runs, not on the process. Timing it again in every process cost ~11 s of a ~21 s `specframe generate`
on a 2-core machine, and let two processes choose differently where two options' times were close. So each kind
of measurement is kept in one JSON file per machine and software under specframe's cache root
(`~/.cache/specframe/<kind>/`, `$SPECFRAME_HOME` where set): its name hashes the CPU's model name, the logical
CPU count, PyTorch's version and the source of the code that the timings measured, so a change to any of them
makes a new file. Delete the folder to time again (e.g. after timing on a busy machine): these choices change
speed, and at most rounding, never what is computed. A damaged file is timed again and rewritten; where the
cache cannot be written, each process times for itself, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

keep = True  # whether measurements are read from and written to disk (tests turn this off)


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def stored_file(kind: str, sources: Sequence[Path]) -> Path:
    """The file that keeps measurements of `kind` taken on this machine with this software and `sources`."""
    from specframe.models import cache_dir

    machine = "\0".join([cpu_name(), str(os.cpu_count()), torch.__version__]).encode()
    key = hashlib.sha256(b"\0".join([machine, *(Path(s).read_bytes() for s in sources)])).hexdigest()[:16]
    return cache_dir() / kind / f"{key}.json"


def stored(kind: str, sources: Sequence[Path]) -> dict[str, Any]:
    """The measurements kept in `stored_file(kind, sources)`, by name ({} when none are, or it is unreadable:
    the caller checks each value it reads)."""
    if not keep:
        return {}
    try:
        kept = json.loads(stored_file(kind, sources).read_text())
    except (OSError, ValueError):
        return {}
    found = kept.get("measurements") if isinstance(kept, dict) else None
    return found if isinstance(found, dict) else {}


def store(kind: str, sources: Sequence[Path], name: str, value: Any) -> None:
    """Keep `value` (JSON) as measurement `name` of `kind`, beside the others (written aside, then renamed;
    processes may race, the last one wins). Nothing is kept where the cache cannot be written."""
    if not keep:
        return
    path = stored_file(kind, sources)
    kept = {
        "cpu": cpu_name(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "measurements": {**stored(kind, sources), name: value},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            aside = Path(work) / path.name
            aside.write_text(json.dumps(kept, indent=1))
            os.replace(aside, path)
    except OSError:
        pass
