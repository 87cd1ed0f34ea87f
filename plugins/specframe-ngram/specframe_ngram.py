"""`ngram`: prompt-lookup decoding as a specframe plugin. No model, no training.

The last n tokens of the sequence (prompt + everything emitted, the root included) are looked up among the
earlier n-grams of the same sequence; what followed an earlier occurrence is proposed as the draft.
Longer n are tried first (`max_ngram` down to `min_ngram`) and, within one n, the most recent occurrence
first. Up to `max_candidates` distinct continuations are merged into a token trie, so continuations that
share a prefix share nodes and the target verifies all of them in one forward pass. Every node is
deterministic (q one-hot), so the engine accepts node x with probability r(x): exact under any sampling.

Cost: an index {n-gram: [positions of the token after it]} per n is kept incrementally. A proposal hashes
max_ngram - min_ngram + 1 suffixes and walks a bounded number of positions, independent of the sequence
length; each emitted token adds one entry per n. The index only ever holds emitted tokens, never drafts,
so nothing needs rolling back after a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specframe import Acceptance, DecodeState, Proposal, Proposer, TargetInfo, hookimpl
from specframe.errors import ConfigError

__all__ = ["NgramConfig", "NgramIndex", "NgramProposer", "build_trie", "register_proposers"]


MAX_NGRAM = 64  # the longest suffix `max_ngram` may ask for (vLLM's and transformers' defaults are 3 to 5)


@dataclass
class NgramConfig:
    # Longest suffix to match (at most MAX_NGRAM). Longer matches are rarer but their continuations are more
    # often right.
    max_ngram: int = 3
    # Shortest suffix to match. 1 = also fall back to the last token alone: many more (weaker) guesses, which
    # pays off where verifying extra tokens is nearly free (GPU) but not on a CPU, where any draft at all
    # makes the target's step ~1.7x dearer (default target, 2 cores).
    min_ngram: int = 2
    # Depth of the draft: tokens proposed after each match. Deep drafts pay off on copy-heavy text.
    num_speculative_tokens: int = 10
    # Distinct continuations merged into one tree; 1 = a plain chain (the cheapest verification).
    max_candidates: int = 2
    # Earlier occurrences examined per n when looking for distinct continuations (bounds the work per step).
    max_positions: int = 16

    def __post_init__(self) -> None:
        for key in ("max_ngram", "min_ngram", "num_speculative_tokens", "max_candidates", "max_positions"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"proposer.{key} must be an integer >= 1, got {value!r}")
        if self.max_ngram > MAX_NGRAM:  # (every n up to it is indexed at every token: a huge one hangs the run)
            raise ConfigError(f"proposer.max_ngram must be at most {MAX_NGRAM}, got {self.max_ngram}")
        if self.min_ngram > self.max_ngram:
            raise ConfigError(
                f"proposer.min_ngram must be <= proposer.max_ngram, got min_ngram={self.min_ngram} "
                f"> max_ngram={self.max_ngram}"
            )


class NgramIndex:
    """Every n-gram (min_n <= n <= max_n) of a growing token sequence -> positions of the token after it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.seq: list[int] = []
        self.after: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; index each n-gram that now has a following token."""
        seq = self.seq
        for t in tokens:
            j = len(seq)  # position of t: it follows the n-grams ending at j - 1
            for n, table in self.after.items():
                if j >= n:
                    key = tuple(seq[j - n : j])
                    positions = table.get(key)
                    if positions is None:
                        table[key] = [j]
                    else:
                        positions.append(j)
            seq.append(t)

    def continuations(self, depth: int, max_candidates: int, max_positions: int) -> list[list[int]]:
        """Up to max_candidates different continuations (each <= depth tokens) of the sequence's suffix.

        Longest n first, most recent occurrence first; an occurrence seen under a longer n is not repeated.
        A continuation that adds nothing to the ones already found (equal to, or a prefix of, one) is skipped; one
        that extends one found replaces it. The search goes on while a continuation found is cut short by the
        sequence's end (in text that repeats itself, the most recent occurrence is near the end), for an older
        one that extends it.
        """
        seq, length = self.seq, len(self.seq)
        found: list[list[int]] = []
        seen: set[int] = set()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            positions = self.after[n].get(tuple(seq[length - n :]))
            if not positions:
                continue
            for p in positions[: -max_positions - 1 : -1]:
                if p in seen:
                    continue
                seen.add(p)
                cont = seq[p : p + depth]
                if any(f[: len(cont)] == cont for f in found):
                    continue
                extends = [f for f in found if cont[: len(f)] == f]
                if len(found) == max_candidates and not extends:  # (full: only one that extends a short one)
                    continue
                found = [f for f in found if f not in extends] + [cont]
                if len(found) == max_candidates and all(len(f) == depth for f in found):
                    return found
        return found


def build_trie(continuations: list[list[int]]) -> tuple[list[int], list[int]]:
    """Merge token sequences into a trie: (tokens, parents) in insertion order, -1 = root, parents first."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        node = -1
        for t in cont:
            child = children.get((node, t))
            if child is None:
                child = children[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = child
    return tokens, parents


class NgramProposer(Proposer):
    name = "ngram"
    config_class = NgramConfig

    def __init__(self, config: NgramConfig, target: TargetInfo) -> None:
        super().__init__(config, target)
        self.index = NgramIndex(config.min_ngram, config.max_ngram)
        self.emitted: list[int] = []  # tokens the last step emitted (from `accepted`), not yet indexed

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        self.index = NgramIndex(self.config.min_ngram, self.config.max_ngram)
        self.index.extend(prompt.tolist())
        self.emitted = []

    def propose(self, state: DecodeState) -> Proposal:
        # The engine's tokens only ever grow by emitted tokens; index the new ones (the root included): those
        # `accepted` gave, already on the host, else (the first step's root) read from the sequence.
        known = len(self.index.seq)
        if known + len(self.emitted) == state.tokens.numel():
            self.index.extend(self.emitted)
        elif state.tokens.numel() >= known:
            self.index.extend(state.tokens[known:].tolist())
        else:  # a sequence we have not seen begin: start over
            self.index = NgramIndex(self.config.min_ngram, self.config.max_ngram)
            self.index.extend(state.tokens.tolist())
        self.emitted = []

        cfg, device = self.config, state.tokens.device
        depth = min(cfg.num_speculative_tokens, state.max_depth)
        if depth < 1:
            return Proposal.empty(device)
        tokens, parents = build_trie(self.index.continuations(depth, cfg.max_candidates, cfg.max_positions))
        if not tokens:
            return Proposal.empty(device)
        return Proposal(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
            torch.ones(len(tokens), dtype=torch.bool, device=device),
        )

    def accepted(self, result: Acceptance) -> None:
        # The tokens this step emitted, to index at the next propose() (which checks they make up the sequence).
        self.emitted = [*result.accepted_tokens, result.next_token]

    def end(self) -> None:
        # The request is over: its index (every n-gram of the sequence) is let go until the next begin().
        self.index = NgramIndex(self.config.min_ngram, self.config.max_ngram)
        self.emitted = []


@hookimpl
def register_proposers(register) -> None:
    register(NgramProposer)
