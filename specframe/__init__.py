"""specframe: exact speculative decoding for Hugging Face causal LMs, with pluggable proposers.

The names below are imported when first used, so that `import specframe` (the CLI's `--help`, `plugins` and
`models list`, a plugin's `from specframe import hookimpl`) does not import PyTorch and transformers (~5 s on a
2-core machine) before anything needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Acceptance": "specframe.proposer",
    "DecodeState": "specframe.proposer",
    "GenerationResult": "specframe.decoder",
    "Proposal": "specframe.proposer",
    "Proposer": "specframe.proposer",
    "SamplingParams": "specframe.sampling",
    "SpecframeConfig": "specframe.config",
    "SpeculativeDecoder": "specframe.decoder",
    "TargetInfo": "specframe.proposer",
    "hookimpl": "specframe.hookspecs",
    "load_config": "specframe.config",
    "sampling_probs": "specframe.sampling",
}
__all__ = [
    "Acceptance",
    "DecodeState",
    "GenerationResult",
    "Proposal",
    "Proposer",
    "SamplingParams",
    "SpecframeConfig",
    "SpeculativeDecoder",
    "TargetInfo",
    "hookimpl",
    "load_config",
    "sampling_probs",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specframe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (the next lookup is a plain attribute)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from specframe.config import SpecframeConfig, load_config
    from specframe.decoder import GenerationResult, SpeculativeDecoder
    from specframe.hookspecs import hookimpl
    from specframe.proposer import Acceptance, DecodeState, Proposal, Proposer, TargetInfo
    from specframe.sampling import SamplingParams, sampling_probs
