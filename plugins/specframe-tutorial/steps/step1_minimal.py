from dataclasses import dataclass

import torch

from specframe import Acceptance, DecodeState, Proposal, Proposer, hookimpl


@dataclass
class RepeatLastConfig:
    """No options yet."""


class RepeatLastProposer(Proposer):
    name = "repeat_last"
    config_class = RepeatLastConfig

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        if state.max_depth < 1:
            return Proposal.empty(state.tokens.device)
        return Proposal.chain(state.tokens[-1:], deterministic=True)

    def accepted(self, result: Acceptance) -> None:
        pass


@hookimpl
def register_proposers(register):
    register(RepeatLastProposer)
