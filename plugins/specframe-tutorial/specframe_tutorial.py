"""`repeat_last`: guesses that the last token repeats. The worked example of docs/plugins.md."""

from dataclasses import dataclass

import torch

from specframe import Acceptance, DecodeState, Proposal, Proposer, hookimpl
from specframe.errors import ConfigError


@dataclass
class RepeatLastConfig:
    # How many copies of the last token to propose per step.
    num_speculative_tokens: int = 3

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ConfigError(f"proposer.num_speculative_tokens must be an integer in [1, 16], got {k!r}")


class RepeatLastProposer(Proposer):
    name = "repeat_last"
    config_class = RepeatLastConfig

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        pass  # nothing to remember between steps

    def propose(self, state: DecodeState) -> Proposal:
        k = min(self.config.num_speculative_tokens, state.max_depth)
        if k < 1:
            return Proposal.empty(state.tokens.device)
        # A chain of k copies of the root; deterministic: no randomness went into choosing them.
        return Proposal.chain(state.tokens[-1:].repeat(k), deterministic=True)

    def accepted(self, result: Acceptance) -> None:
        pass  # no state, so nothing to roll back


@hookimpl
def register_proposers(register):
    register(RepeatLastProposer)
