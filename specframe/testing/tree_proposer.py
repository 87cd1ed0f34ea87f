"""A reference tree proposer: a small draft model expanded level by level into a full tree.

It exists to exercise the engine's tree path (4-D mask, positions, gather rollback) and both exact tree
modes in the conformance suite; it recomputes the draft from scratch per level (no KV cache), which is
fine for tiny models. `mode="deterministic"`: each node's children are the draft's top-`width` tokens
(one-hot q). `mode="iid"`: `width` children drawn independently from q (SpecInfer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specframe.errors import ConfigError
from specframe.proposer import Acceptance, DecodeState, Proposal, Proposer, TargetInfo
from specframe.sampling import sampling_probs
from specframe.testing.tiny import tiny_llama


@dataclass
class TreeConfig:
    # "deterministic" (top-width children) or "iid" (width children sampled from q).
    mode: str = "deterministic"
    # Children per node.
    width: int = 2
    # Levels below the root.
    depth: int = 2

    def __post_init__(self) -> None:
        if self.mode not in ("deterministic", "iid"):
            raise ConfigError(f"proposer.mode must be 'deterministic' or 'iid', got {self.mode!r}")
        if self.width < 1 or self.depth < 1:
            raise ConfigError("proposer.width and proposer.depth must be >= 1")


class TreeTestProposer(Proposer):
    name = "tree_test"
    config_class = TreeConfig

    def __init__(self, config: TreeConfig, target: TargetInfo, model: torch.nn.Module) -> None:
        super().__init__(config, target)
        self.model = model

    @classmethod
    def random(cls, target: TargetInfo, config: TreeConfig | None = None, seed: int = 0) -> TreeTestProposer:
        model = tiny_llama(target.vocab_size, seed=seed + 1000, device=target.device, dtype=target.dtype, num_layers=1)
        return cls(config or TreeConfig(), target, model)

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        pass

    def accepted(self, result: Acceptance) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        cfg, s = self.config, state.sampling
        deterministic = cfg.mode == "deterministic" or s.greedy
        tokens: list[torch.Tensor] = []
        parents: list[int] = []
        probs: list[torch.Tensor] = []
        frontier = [(-1, state.tokens)]  # (node index, the sequence ending at that node)
        for _ in range(min(cfg.depth, state.max_depth)):
            seqs = torch.stack([seq for _, seq in frontier])
            logits = self.model(input_ids=seqs).logits[:, -1].float()
            nxt = []
            for (node, seq), row in zip(frontier, logits, strict=True):
                q = sampling_probs(row, s)
                if deterministic:
                    width = min(cfg.width, int((q > 0).sum()))
                    chosen = torch.topk(q, width).indices
                else:
                    chosen = torch.multinomial(q, cfg.width, replacement=True, generator=state.generator)
                for x in chosen:
                    tokens.append(x.view(1))
                    parents.append(node)
                    probs.append(q)
                    nxt.append((len(tokens) - 1, torch.cat([seq, x.view(1)])))
            frontier = nxt
        if not tokens:
            return Proposal.empty(state.tokens.device)
        device = state.tokens.device
        det = torch.full((len(tokens),), deterministic, dtype=torch.bool, device=device)
        return Proposal(
            torch.cat(tokens), torch.tensor(parents, device=device), det, None if deterministic else torch.stack(probs)
        )
