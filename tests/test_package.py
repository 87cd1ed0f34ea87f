"""`import specframe`: cheap, with every public name there when used."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import specframe


def test_public_names_are_imported_when_first_used():
    code = (
        "import sys, specframe\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported eagerly'\n"
        "from specframe import hookimpl\n"
        "assert 'torch' not in sys.modules\n"
        "names = [getattr(specframe, n) for n in specframe.__all__]\n"
        "assert 'torch' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_every_exported_name_resolves_and_others_do_not():
    assert sorted(specframe.__all__) == sorted(specframe._EXPORTS)
    # What type checkers read (the `if TYPE_CHECKING:` imports) lists the same names from the same modules.
    tree = ast.parse(Path(specframe.__file__).read_text())
    checked = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
    typed = {alias.asname: node.module for node in checked[0].body for alias in node.names}
    assert typed == specframe._EXPORTS
    for name in specframe.__all__:
        assert getattr(specframe, name) is getattr(sys.modules[specframe._EXPORTS[name]], name)
        assert name in dir(specframe)
    from specframe.decoder import SpeculativeDecoder

    assert specframe.SpeculativeDecoder is SpeculativeDecoder
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        specframe.nothing_here  # noqa: B018


def test_submodules_are_there_after_import_specframe():
    code = "import specframe\nprint(specframe.errors.SpecframeError.__name__, specframe.measurements.KEEP_ENV)\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split() == ["SpecframeError", "SPECFRAME_KEEP_TIMINGS"], run.stderr
