"""Exceptions. The CLI maps `BadInputError` (and subclasses) to exit code 2, anything else to 1."""

from __future__ import annotations

import dataclasses
import numbers
import os
import sys
import tempfile
from pathlib import Path


def is_count(value: object, minimum: int = 1) -> bool:
    """Whether `value` is an integer >= `minimum` (a bool is not one, though Python counts it as an int): the
    check behind every "must be an integer >= 1" (or >= 0) error."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_integer(value: object) -> bool:
    """An integer, Python's or a library's (NumPy's): not a bool, though Python counts it as one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number of any library (NumPy's, a 0-d tensor's); not a bool (True is not a temperature) nor text."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    torch = sys.modules.get("torch")  # (a tensor means torch is loaded; not imported here for its sake)
    return (
        torch is not None
        and isinstance(value, torch.Tensor)
        and value.ndim == 0
        and value.dtype != torch.bool
        and not value.is_complex()
    )


def is_flag(value: object) -> bool:
    """True or False, Python's or NumPy's."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


_PLAIN_TYPES = {  # a field's annotation -> (what a value must be, how errors say it)
    "bool": (is_flag, "true or false"),
    "int": (is_integer, "an integer"),
    "float": (is_number, "a number"),
}


def check_field_types(config: object, prefix: str) -> None:
    """Raise ConfigError naming the first field of dataclass `config` annotated with a flag or a number (bool,
    int, float; optionally `| None`) whose value is not one. A config built from YAML or overrides is typed by
    OmegaConf already; this is the same check for one built in Python, where a string for a flag would be
    truthy and True would count as 1. Range checks come after it. (Text fields are not checked: paths,
    torch.device and torch.dtype objects stand for text where specframe reads them.)"""
    for f in dataclasses.fields(config):
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        kinds = [k.strip() for k in annotation.split("|")]
        value = getattr(config, f.name)
        plain = [k for k in kinds if k != "None"]
        if (value is None and "None" in kinds) or len(plain) != 1 or plain[0] not in _PLAIN_TYPES:
            continue
        fits, words = _PLAIN_TYPES[plain[0]]
        if not fits(value):
            unset = " or unset" if "None" in kinds else ""
            raise ConfigError(f"{prefix}{f.name} must be {words}{unset}, got {value!r}")


def brief(e: BaseException, limit: int | None = None, lines: int | None = None, typed: bool = False) -> str:
    """An exception's message on one line (some embed multi-line reprs): its first `lines` non-empty lines if
    given (OmegaConf's and transformers' errors add lines of context after the message), at most `limit`
    characters if given; after its type's name with `typed`; the type's name alone when it has no message."""
    kept = [line for line in str(e).splitlines() if line.strip()][:lines]
    text = " ".join(" ".join(kept).split())
    text = (f"{type(e).__name__}: {text}" if typed else text) if text else type(e).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


class SpecframeError(Exception):
    """Base class of every error specframe raises on purpose."""


class BadInputError(SpecframeError):
    """Bad usage, bad config or bad input: the user can fix it. CLI exit code 2."""


class ConfigError(BadInputError):
    """A config key is unknown, has the wrong type, or a value is out of range."""


class ModelLoadError(BadInputError):
    """A model, tokenizer or adapter could not be loaded from what the user named."""


class TrainingError(SpecframeError):
    """Training that cannot go on (a loss that is not finite): exit status 1, nothing more saved."""


class ProposerError(SpecframeError):
    """A proposer (built-in or plugin) raised or returned a malformed proposal."""


class PluginError(SpecframeError):
    """A plugin could not be loaded or registered."""


def check_output_path(path: str | Path, what: str, folder: bool) -> None:
    """Raise BadInputError naming `what` (e.g. "--out") when `path` cannot be written as a folder (`folder`) or
    as a file: it exists as the other kind, or the nearest existing parent is a file. Checked before a long job
    starts, so that the job's results are not lost at the end."""
    p = Path(path)
    try:
        if p.is_symlink() and not p.exists():
            raise BadInputError(f"{what} '{path}' is a link to nothing")
        if folder and p.exists() and not p.is_dir():
            raise BadInputError(f"{what} '{path}' is a file; it must name a folder")
        if not folder and p.is_dir():
            raise BadInputError(f"{what} '{path}' is a folder; it must name a file")
        parent = next((q for q in p.absolute().parents if q.exists()), None)
    except OSError as e:  # (e.g. a folder on the way that may not be read)
        raise BadInputError(f"{what} '{path}' cannot be checked: {e}") from e
    if parent is not None and not parent.is_dir():
        raise BadInputError(f"{what} '{path}' lies under '{parent}', which is a file")
    # Whether the job can write there (permissions, a read-only disk): an existing file (written in place) opened to
    # append, which changes nothing; else an empty folder made and removed where its files would be made.
    where = p if p.exists() else parent
    try:
        if not folder and p.exists():
            open(p, "ab").close()
        elif where is not None:
            os.rmdir(tempfile.mkdtemp(prefix=".specframe-write-check-", dir=where))
    except OSError as e:
        raise BadInputError(f"{what} '{path}' cannot be written: {e.strerror or e} (in '{where}')") from e


def user_path(path: str) -> str:
    """`path` with a leading `~` or `~user` read as the home folder, as a shell would (a `--out=~/x`, a YAML value
    or a Python string reach specframe unexpanded); anything else unchanged."""
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path
