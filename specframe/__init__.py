"""specframe: exact speculative decoding for Hugging Face causal LMs, with pluggable proposers.

The names below (and the submodules, as `specframe.errors`) are imported when first used, so that `import
specframe` (the CLI's `--help`, a plugin's `from specframe import hookimpl`) does not import
PyTorch and transformers (~5 s on a 2-core machine) before anything needs them.
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
__all__ = list(_EXPORTS)


if not TYPE_CHECKING:  # (type checkers see the imports below instead, and flag a name that is not there)

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:  # a submodule not imported yet (e.g. `specframe.errors` after `import specframe`)
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # (the next lookup is a plain attribute)
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from specframe.config import SpecframeConfig as SpecframeConfig
    from specframe.config import load_config as load_config
    from specframe.decoder import GenerationResult as GenerationResult
    from specframe.decoder import SpeculativeDecoder as SpeculativeDecoder
    from specframe.hookspecs import hookimpl as hookimpl
    from specframe.proposer import Acceptance as Acceptance
    from specframe.proposer import DecodeState as DecodeState
    from specframe.proposer import Proposal as Proposal
    from specframe.proposer import Proposer as Proposer
    from specframe.proposer import TargetInfo as TargetInfo
    from specframe.sampling import SamplingParams as SamplingParams
    from specframe.sampling import sampling_probs as sampling_probs
