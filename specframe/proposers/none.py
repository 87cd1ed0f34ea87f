"""`none`: proposes nothing, so the engine does plain autoregressive decoding — the honest baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specframe.proposer import Acceptance, DecodeState, Proposal, Proposer


@dataclass
class NoneConfig:
    """`none` has no options."""


class NoneProposer(Proposer):
    name = "none"
    config_class = NoneConfig

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        return Proposal.empty(state.tokens.device)

    def accepted(self, result: Acceptance) -> None:
        pass
