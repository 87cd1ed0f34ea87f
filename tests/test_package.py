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


def test_every_data_file_of_the_package_is_in_its_package_data():
    # (a file the source tree has but pyproject's package-data misses works from a checkout and is absent from
    # an installed wheel: the C kernel source, py.typed, configs, shipped artifacts)
    from fnmatch import fnmatch

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

    root = Path(specframe.__file__).parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p: root / setuptools["package-dir"].get(p, p.replace(".", "/")) for p in setuptools["packages"]}
    for package, folder in folders.items():
        patterns = setuptools["package-data"].get(package, [])
        for path in folder.rglob("*"):
            relative = path.relative_to(folder).as_posix()
            inside = any(other in path.parents for other in folders.values() if other != folder)  # (a subpackage's)
            if path.is_file() and path.suffix not in (".py", ".pyc") and not inside:
                assert any(fnmatch(relative, p) for p in patterns), f"{package}: {relative} is not packaged"
    assert (root / "specframe" / "py.typed").is_file()  # (the package's annotations are for type checkers)
