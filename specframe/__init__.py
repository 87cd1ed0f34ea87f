"""specframe: exact speculative decoding for Hugging Face causal LMs, with pluggable proposers."""

from specframe.config import SpecframeConfig, load_config
from specframe.decoder import GenerationResult, SpeculativeDecoder
from specframe.hookspecs import hookimpl
from specframe.proposer import Acceptance, DecodeState, Proposal, Proposer, TargetInfo
from specframe.sampling import SamplingParams, sampling_probs

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
