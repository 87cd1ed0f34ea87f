"""Deliberately wrong acceptance rules and proposers. The conformance suite must reject every one of them;
if it did not, its passing verdicts would prove nothing."""

from __future__ import annotations

from dataclasses import replace

import torch

from specframe.acceptance import TreeAcceptance
from specframe.proposer import DecodeState, Proposal, TargetInfo
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.sampling import SamplingParams, sample, sampling_probs


class InvertedRatio(TreeAcceptance):
    """Accepts with min(1, q/p) instead of min(1, p/q)."""

    def accept(self, r, q, x, generator):
        u = torch.rand((), generator=generator, device=r.device, dtype=r.dtype)
        qx = 1.0 if q is None else q[x]
        return u * r[x] < qx


class ResidualNotNormalised(TreeAcceptance):
    """Keeps max(0, r - q) unnormalised, so the next sibling's ratio is too small."""

    def residual(self, r, q, x):
        new = r.clone()
        if q is None:
            new[x] = 0.0
            return new
        return (r - q).clamp_min(0.0)


class ResampleFromTarget(TreeAcceptance):
    """After a rejection, samples from p instead of the residual (a classic bug)."""

    def residual(self, r, q, x):
        return r


class BonusFromParent(TreeAcceptance):
    """Draws the bonus token from the parent's position instead of the leaf's."""

    def bonus(self, logits, row, parent_row, params: SamplingParams, generator):
        return sample(self.target_probs(logits, parent_row, params), generator)


class UntransformedQDraft(DraftProposer):
    """Draws from T(logits) but reports q = softmax(logits): q not passed through the sampling transform."""

    def draw(
        self, logits: torch.Tensor, state: DecodeState, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = super().draw(logits, state, q)
        return x, logits.float().softmax(-1)


class OneCutQDraft(DraftProposer):
    """Draws from T(logits) but reports q with only top-p applied when top-k is set too, as a transform written
    `if top_p < 1: ... elif top_k: ...` would."""

    def draw(
        self, logits: torch.Tensor, state: DecodeState, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = super().draw(logits, state, q)
        params = state.sampling
        if params.top_p < 1.0:
            params = replace(params, top_k=0)
        return x, sampling_probs(logits, params)


class MinPIgnoredQDraft(DraftProposer):
    """Draws from T(logits) but reports q without the min-p cut, as a transform written before min-p was would."""

    def draw(
        self, logits: torch.Tensor, state: DecodeState, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = super().draw(logits, state, q)
        return x, sampling_probs(logits, replace(state.sampling, min_p=0.0))


class PenaltiesIgnoredQDraft(DraftProposer):
    """Draws from T(penalised logits) but reports q of the logits before the penalties: a proposer that drafts
    under them (`DecodeState.penalised`) and forgets them in the q it reports."""

    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self.unpenalised = super()._next_logits(tokens)
        return self.unpenalised

    def draw(
        self, logits: torch.Tensor, state: DecodeState, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = super().draw(logits, state, q)
        return x, sampling_probs(self.unpenalised, state.sampling)


class StaleQDraft(DraftProposer):
    """Reports the first drafted position's q for every position of its chain: right at depth 1, wrong past
    it, so only a statistical check that drafts two deep can catch it."""

    right_depths = 1  # depths whose q is reported truthfully; deeper ones repeat the last of them

    def propose(self, state: DecodeState) -> Proposal:
        proposal = super().propose(state)
        if proposal.draft_probs is not None and len(proposal) > self.right_depths:
            stale = proposal.draft_probs.clone()
            stale[self.right_depths :] = stale[self.right_depths - 1]
            proposal.draft_probs = stale
        return proposal


class StaleQPastDepth2Draft(StaleQDraft):
    """Right at depths 1 and 2, wrong past them, so only the deep sampling setting (budget for drafts past
    depth 2, counted tokens at depths 2-4) sees it."""

    right_depths = 2


class KeepIfLikelyDraft(DraftProposer):
    """Applies the confidence threshold after drawing: a sampled token is kept only when its own probability
    keeps the chain above the threshold, so the kept tokens are not draws from the q they report."""

    def propose(self, state: DecodeState) -> Proposal:
        gamma = min(self.gamma, state.max_depth)
        self.fed_drafts = 0
        if gamma == 0:
            return Proposal.empty(state.tokens.device)
        logits = self._next_logits(state.tokens[self.cached :])
        tokens, qs, confidence = [], [], 1.0
        for i in range(gamma):
            x, q = self.draw(logits, state)
            confidence *= float(q[x])
            if i > 0 and confidence < self.threshold:
                break
            tokens.append(x)
            qs.append(q)
            if i < gamma - 1:
                logits = self._next_logits(x)
                self.fed_drafts += 1
        return Proposal.chain(torch.cat(tokens), torch.stack(qs), deterministic=False)


BROKEN_ACCEPTANCE = {
    "inverted_ratio": InvertedRatio,
    "residual_not_normalised": ResidualNotNormalised,
    "resample_from_target": ResampleFromTarget,
    "bonus_from_parent": BonusFromParent,
}


class GlobalRandomDraft(DraftProposer):
    """Draws from the right q, but with torch's global generator instead of the engine's: exact in
    distribution, yet one seed no longer gives one output (the isolation check must catch it)."""

    def draw(
        self, logits: torch.Tensor, state: DecodeState, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = sampling_probs(logits, state.sampling) if q is None else q
        return torch.multinomial(q, 1), q


class ReseedingDraft(GlobalRandomDraft):
    """Reseeds torch's global generator at the start of every request and draws from it: one seed gives one
    output, yet the user's own generator is reset by every call (the isolation check must catch it)."""

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        torch.manual_seed(0)
        super().begin(prompt, hidden_states)


class RequestMemoryDraft(DraftProposer):
    """Deterministic and exact, but remembers earlier requests: it proposes nothing on every other one, so the
    same seed gives another output on the next call (the isolation check must catch it and name the cause)."""

    requests = 0

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        self.requests += 1
        super().begin(prompt, hidden_states)

    def propose(self, state: DecodeState) -> Proposal:
        if self.requests % 2:
            self.fed_drafts = 0  # (nothing drafted: accepted() has nothing to roll back)
            return Proposal.empty(state.tokens.device)
        return super().propose(state)


class TargetChangingDraft(DraftProposer):
    """Negates the target's output layer when it is built: every output then follows the changed target, which
    a suite computing its references on the same model object would take for the target's own."""

    @classmethod
    def random(cls, target: TargetInfo, config: DraftConfig | None = None, seed: int = 0) -> DraftProposer:
        with torch.no_grad():
            target.model.get_output_embeddings().weight.neg_()
        return super().random(target, config, seed)
