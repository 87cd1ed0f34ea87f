"""Settings for the test runs from the repository's root (tests/ and plugins/*/tests/, as the README and CI run
them; `pytest plugins/<plugin>` on its own reads that plugin's pyproject.toml and not this file)."""

import importlib.metadata
import os
from pathlib import Path

import pytest

# Tests neither read nor keep this machine's timings on disk (specframe/measurements.py), their subprocesses
# included; the tests of that store turn it on in a temporary folder (tests/conftest.py, `kept_timings`).
os.environ["SPECFRAME_KEEP_TIMINGS"] = "0"


def pytest_configure(config):
    """The plugins are installed as copies (`pip install ./plugins/*`, as the README says): tests of a plugin
    whose source was edited since would test the old copy and pass. Refused instead, saying how to mend it."""
    stale = []
    for folder in sorted(p.parent for p in (Path(__file__).parent / "plugins").glob("*/pyproject.toml")):
        source = folder / (folder.name.replace("-", "_") + ".py")
        try:
            installed = Path(importlib.metadata.distribution(folder.name).locate_file(source.name))
        except importlib.metadata.PackageNotFoundError:
            continue  # (not installed: its tests fail on the import, saying so)
        if source.is_file() and installed.is_file() and installed.read_bytes() != source.read_bytes():
            stale.append(f"{source.relative_to(folder.parent.parent)} differs from its installed copy {installed}")
    if stale:
        pytest.exit(
            "; ".join(stale) + ": install the plugins again (.venv/bin/pip install ./plugins/*) so their tests "
            "test this source",
            returncode=4,
        )
