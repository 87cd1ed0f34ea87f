"""Settings for the test runs from the repository's root (tests/ and plugins/*/tests/, as the README and CI run
them; `pytest plugins/<plugin>` on its own reads that plugin's pyproject.toml and not this file)."""

import importlib.util
import os
from pathlib import Path

import pytest

# Tests neither read nor keep this machine's timings on disk (specframe/measurements.py), their subprocesses
# included; the tests of that store turn it on in a temporary folder (tests/conftest.py, `kept_timings`).
os.environ["SPECFRAME_KEEP_TIMINGS"] = "0"

PLUGINS = Path(__file__).parent / "plugins"


def stale_plugins() -> dict[Path, str]:
    """The plugin folders whose module, as Python would import it, is a copy that differs from the source here
    (`pip install ./plugins/*`, as the README says, installs copies): {folder: what differs}. An editable
    install, or the folder first on PYTHONPATH, imports the source itself; a plugin not installed is left to
    its tests' imports."""
    stale = {}
    for folder in sorted(p.parent for p in PLUGINS.glob("*/pyproject.toml")):
        source = folder / (folder.name.replace("-", "_") + ".py")
        spec = importlib.util.find_spec(source.stem) if source.is_file() else None
        imported = Path(spec.origin) if spec is not None and spec.origin else None
        if imported is None or not imported.is_file() or imported.resolve() == source.resolve():
            continue
        if imported.read_bytes() != source.read_bytes():
            stale[folder] = f"{source.relative_to(PLUGINS.parent)} differs from the copy Python imports, {imported}"
    return stale


STALE = stale_plugins()  # (once per process: the workers of a parallel run each check)


def pytest_runtest_setup(item):
    """A test of a plugin whose source was edited since it was installed would test the old copy and pass: it
    fails instead, saying how to mend it (other tests run, with a note in the header)."""
    for folder, why in STALE.items():
        if folder in Path(str(item.path)).parents:
            pytest.fail(f"{why}: install the plugins again (.venv/bin/pip install ./plugins/*) to test this source",
                        pytrace=False)  # fmt: skip


def pytest_report_header(config):
    # (the core tests that use a plugin, e.g. union's n-gram member, use the installed copy)
    return [f"note: {why}; install the plugins again to test this source" for why in STALE.values()] or None
