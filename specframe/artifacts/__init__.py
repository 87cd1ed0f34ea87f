"""Trained artifacts shipped with specframe, each made by specframe's own training command (see its card)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

# (proposer, target alias) -> (folder inside this package, the file that marks it complete)
SHIPPED = {
    ("draft", "smollm2-135m-instruct"): ("draft-smollm2-135m-instruct", "draft_config.json"),
    ("medusa", "smollm2-135m-instruct"): ("medusa-smollm2-135m-instruct", "medusa_config.json"),
    ("eagle", "smollm2-135m-instruct"): ("eagle-smollm2-135m-instruct", "eagle_config.json"),
}


def shipped(proposer: str, target_name: str, model: torch.nn.Module | None = None) -> str | None:
    """Path of the artifact shipped for `proposer` on a target alias, or None when none ships (or it is absent).
    A target given by another name (a local copy of the default model: the folder `specframe models list` shows)
    is matched by `model`'s weights, against the fingerprint each shipped artifact records of its target."""
    from specframe.fingerprint import fingerprint_mismatch

    for (kind, alias), (folder, marker) in SHIPPED.items():
        if kind != proposer:
            continue
        path = resources.files("specframe.artifacts") / folder
        if not (path / marker).is_file():
            continue
        if alias == target_name:
            return str(Path(str(path)))
        if model is not None:
            saved = json.loads((path / marker).read_text()).get("target")
            if fingerprint_mismatch(saved, model, adapter=False) is None:
                return str(Path(str(path)))
    return None
