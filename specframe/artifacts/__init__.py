"""Trained artifacts shipped with specframe, each made by specframe's own training command (see its card)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# target alias -> folder (inside this package) of the draft trained for it
SHIPPED_DRAFTS = {"smollm2-135m-instruct": "draft-smollm2-135m-instruct"}


def shipped_draft(target_name: str) -> str | None:
    """Path of the shipped draft for a target alias, or None when none ships (or it is not installed)."""
    folder = SHIPPED_DRAFTS.get(target_name)
    if folder is None:
        return None
    path = resources.files("specframe.artifacts") / folder
    return str(Path(str(path))) if (path / "draft_config.json").is_file() else None
