"""Exact acceptance of a draft tree against the target's distributions (docs/architecture.md, "Acceptance").

Walk from the root. At a node with target distribution r (start r = p at that node), try its children in
order; child c with token x and draft distribution q (one-hot for deterministic children):

    accept with probability min(1, r(x) / q(x))      -> move to c, r = p at c
    else r = norm(max(0, r - q))                     -> next child

When no child is accepted (or the node is a leaf), emit a sample from r and stop. A chain is the tree in
which every node has one child, which gives Leviathan et al.'s rule with its bonus token; a deterministic
child reduces to "accept with r(x), else zero x in r". The comparison u * q(x) < r(x) needs no division,
so q(x) = 0 cannot blow up; all of it runs in float32 or better.
"""

from __future__ import annotations

import torch

from specframe.proposer import Proposal, ProposalStructure
from specframe.sampling import SamplingParams, sample, sampling_probs


class TreeAcceptance:
    """The exact rule. `specframe.testing.broken` subclasses it to prove the conformance suite has power."""

    def __call__(
        self,
        logits: torch.Tensor,  # [n + 1, V]: row 0 = root, row i + 1 = node i
        proposal: Proposal,
        params: SamplingParams,
        generator: torch.Generator,
        structure: ProposalStructure | None = None,  # the proposal's tree on the host, where the caller has it
    ) -> tuple[list[int], int]:
        """Return (accepted node indices root-to-leaf, the next token emitted by the target)."""
        if structure is None:
            tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
            deterministic = proposal.deterministic.tolist()
        else:
            tokens, parents, deterministic = structure.tokens, structure.parents, structure.deterministic
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # by row
        for i, parent in enumerate(parents):
            children[parent + 1].append(i)
        if params.greedy:
            return self.greedy(logits, tokens, children)
        path: list[int] = []
        row, parent_row = 0, 0
        while True:
            if not children[row]:
                return path, self.bonus(logits, row, parent_row, params, generator)
            r = self.target_probs(logits, row, params)
            # Every child's test is drawn before any is read, each against the residual left by rejecting the ones
            # before it (what it faces exactly when they were rejected): the host then waits once per row walked,
            # not once per child tried. (Draws after the accepted child go unused: independent, so harmless.)
            tests, kids = [], children[row]
            for i, c in enumerate(kids):
                # (q as drawn from: validation lets a row's sum be off by rounding, and torch.multinomial draws
                # from the row over its sum; the rule must use the same distribution to stay exact)
                q = None if deterministic[c] else self.normalised(proposal.draft_probs[c].float())
                tests.append(torch.as_tensor(self.accept(r, q, tokens[c], generator), device=r.device))
                if i < len(kids) - 1:  # (the last child's residual: only when every child is rejected, below)
                    r = self.residual(r, q, tokens[c])
            hits = torch.stack(tests).tolist()
            accepted = next((c for c, hit in zip(kids, hits, strict=True) if hit), None)
            if accepted is None:
                return path, sample(self.residual(r, q, tokens[kids[-1]]), generator)
            path.append(accepted)
            row, parent_row = accepted + 1, row

    @staticmethod
    def greedy(logits: torch.Tensor, tokens: list[int], children: list[list[int]]) -> tuple[list[int], int]:
        """Temperature 0: follow the child whose token is the target's argmax."""
        best = logits.argmax(-1).tolist()
        path: list[int] = []
        row = 0
        while True:
            nxt = next((c for c in children[row] if tokens[c] == best[row]), None)
            if nxt is None:
                return path, best[row]
            path.append(nxt)
            row = nxt + 1

    @staticmethod
    def normalised(q: torch.Tensor) -> torch.Tensor:
        return q / q.sum()

    def target_probs(self, logits: torch.Tensor, row: int, params: SamplingParams) -> torch.Tensor:
        return sampling_probs(logits[row], params)

    def accept(self, r: torch.Tensor, q: torch.Tensor | None, x: int, generator: torch.Generator) -> torch.Tensor:
        """Whether the child with token x is accepted (a bool tensor, read later: no host sync here)."""
        u = torch.rand((), generator=generator, device=r.device, dtype=r.dtype)
        qx = 1.0 if q is None else q[x]
        return u * qx < r[x]

    def residual(self, r: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
        if q is None:
            new = r.clone()
            new[x] = 0.0
        else:
            new = (r - q).clamp_min_(0.0)
        total = new.sum()
        # A zero residual only arises from rounding (r == q would have accepted every draw): keep r. (Chosen on
        # the device: no host sync.)
        return torch.where(total > 0, new / total, r)

    def bonus(
        self, logits: torch.Tensor, row: int, parent_row: int, params: SamplingParams, generator: torch.Generator
    ) -> int:
        """The node at `row` has no children to try (a leaf of the tree, the root of an empty proposal, the
        prefill's last row): emit a token from p there. (`parent_row` is for `specframe.testing.broken`.)"""
        return sample(self.target_probs(logits, row, params), generator)
