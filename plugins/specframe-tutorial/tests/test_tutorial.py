"""The tutorial cannot rot: docs/plugins.md quotes these files verbatim, and each stage works."""

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
from specframe_tutorial import RepeatLastProposer

from specframe.plugins import build_registry
from specframe.testing.conformance import run_suite

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parents[1]
DOC = REPO / "docs" / "plugins.md"
# <!-- file: plugins/... --> on its own line, then a fenced block that must equal that file.
QUOTE = re.compile(r"^<!-- file: (\S+) -->\n```[^\n]*\n(.*?)^```$", re.M | re.S)
MUST_QUOTE = {
    "plugins/specframe-tutorial/steps/step1_minimal.py",
    "plugins/specframe-tutorial/pyproject.toml",
    "plugins/specframe-tutorial/specframe_tutorial.py",
    "plugins/specframe-tutorial/tests/test_repeat_last.py",
}


def quotes() -> list[tuple[str, str]]:
    if not DOC.is_file():
        pytest.skip(f"{DOC} not found (run from a checkout of the specframe repository)")
    return QUOTE.findall(DOC.read_text())


def test_docs_quote_the_real_files_verbatim():
    found = quotes()
    assert MUST_QUOTE <= {path for path, _ in found}, "docs/plugins.md no longer quotes every tutorial file"
    for path, block in found:
        assert block == (REPO / path).read_text(), f"docs/plugins.md is out of sync with {path}: copy it again"


def test_step1_minimal_plugin_works():
    spec = importlib.util.spec_from_file_location("step1_minimal", PACKAGE / "steps" / "step1_minimal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = run_suite(module.RepeatLastProposer, devices=["cpu"], quick=True)
    assert report.passed, report.summary()


def test_installed_plugin_is_listed():
    try:
        version = importlib.metadata.version("specframe-tutorial")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("specframe-tutorial is not installed: pip install ./plugins/specframe-tutorial")
    entry = build_registry(autoload=True).get("repeat_last")
    assert entry.cls is RepeatLastProposer
    assert (entry.plugin, entry.distribution, entry.version) == ("repeat_last", "specframe-tutorial", version)
