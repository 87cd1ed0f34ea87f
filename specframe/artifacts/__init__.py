"""Trained artifacts shipped with specframe, each made by specframe's own training command (see its card)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# (proposer, target alias) -> (folder inside this package, the file that marks it complete)
SHIPPED = {
    ("draft", "smollm2-135m-instruct"): ("draft-smollm2-135m-instruct", "draft_config.json"),
    ("medusa", "smollm2-135m-instruct"): ("medusa-smollm2-135m-instruct", "medusa_config.json"),
    ("eagle", "smollm2-135m-instruct"): ("eagle-smollm2-135m-instruct", "eagle_config.json"),
}


def shipped(proposer: str, target_name: str) -> str | None:
    """Path of the artifact shipped for `proposer` on a target alias, or None when none ships (or it is absent)."""
    entry = SHIPPED.get((proposer, target_name))
    if entry is None:
        return None
    folder, marker = entry
    path = resources.files("specframe.artifacts") / folder
    return str(Path(str(path))) if (path / marker).is_file() else None


def shipped_draft(target_name: str) -> str | None:
    return shipped("draft", target_name)
