"""Deliberately wrong acceptance rules and proposers. The conformance suite must reject every one of them;
if it did not, its passing verdicts would prove nothing."""

from __future__ import annotations

import torch

from specframe.acceptance import TreeAcceptance
from specframe.proposer import DecodeState
from specframe.proposers.draft import DraftProposer
from specframe.sampling import SamplingParams, sample


class InvertedRatio(TreeAcceptance):
    """Accepts with min(1, q/p) instead of min(1, p/q)."""

    def accept(self, r, q, x, generator):
        u = torch.rand((), generator=generator, device=r.device, dtype=r.dtype)
        qx = 1.0 if q is None else q[x]
        return bool(u * r[x] < qx)


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

    def draw(self, logits: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = super().draw(logits, state)
        return x, logits.float().softmax(-1)


BROKEN_ACCEPTANCE = {
    "inverted_ratio": InvertedRatio,
    "residual_not_normalised": ResidualNotNormalised,
    "resample_from_target": ResampleFromTarget,
    "bonus_from_parent": BonusFromParent,
}
