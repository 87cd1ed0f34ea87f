"""A proposer's steps replayed: what it proposed at each step of a generation, against what a fresh proposer
proposes on the same tokens.

Exactness does not depend on a proposer's state (the target verifies every draft), so a rollback that leaves a
draft's cache a position off, or heads fed the wrong row, keeps the output exact and only lowers acceptance:
no exactness test sees it. A proposer whose next proposal depends only on the tokens so far (a draft model,
Medusa heads, an EAGLE drafter) must propose after any number of steps what a new one begun on the same tokens
proposes; these helpers check that.

    steps = recorded_proposals(proposer)
    out = SpeculativeDecoder(target, proposer).generate(prompt, max_new_tokens=30)
    assert len(steps) == out.stats["target_forwards"] - 1  # (a proposal before each verification)
    for step in steps:
        again = fresh_proposal(make_proposer(), target, step.tokens, step.max_depth)
        assert again.tokens.tolist() == step.proposal.tokens.tolist()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from specframe.proposer import DecodeState, Proposal, Proposer
from specframe.sampling import SamplingParams


class Step(NamedTuple):
    """One proposal of a generation: the state's tokens and depth limit, the proposal, and what `also` read
    from the proposer right after it (None without `also`)."""

    tokens: torch.Tensor
    max_depth: int
    proposal: Proposal
    also: Any


def recorded_proposals(proposer: Proposer, also: Callable[[Proposer], Any] | None = None) -> list[Step]:
    """A list that gets a `Step` for every proposal `proposer` makes from now on (its `propose` is wrapped on
    this instance); `also(proposer)`, if given, is recorded with each (e.g. the length of its cache then)."""
    steps: list[Step] = []
    propose = proposer.propose

    def recording(state: DecodeState) -> Proposal:
        proposal = propose(state)
        steps.append(Step(state.tokens.clone(), state.max_depth, proposal, also(proposer) if also else None))
        return proposal

    proposer.propose = recording  # type: ignore[method-assign]
    return steps


@torch.no_grad()
def fresh_proposal(
    proposer: Proposer,
    target: torch.nn.Module,
    tokens: torch.Tensor,
    max_depth: int = 100,
    sampling: SamplingParams | None = None,
    generator: torch.Generator | None = None,
) -> Proposal:
    """What `proposer`, a new one, proposes after `tokens` ([n], n >= 2): begun on tokens[:-1] with the target's
    hidden states there (at the layers it reads: its `hidden_state_layers`), as the engine begins it on a
    prompt, the last token being the one the target produced from that prompt."""
    prompt = tokens[:-1]
    out = target(input_ids=prompt[None], output_hidden_states=True)
    proposer.begin(prompt, {layer: out.hidden_states[layer][0] for layer in proposer.hidden_state_layers})
    state = DecodeState(
        tokens, prompt.numel(), sampling or SamplingParams(), generator or torch.Generator(), max_depth=max_depth
    )
    return proposer.propose(state)
