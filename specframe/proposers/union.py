"""`union`: several proposers draft for the same step; their trees are merged and verified in one forward.

Proposers are good at different text: a feature drafter (EAGLE) at free text, n-gram lookup at text that
copies the prompt (summaries, retrieval answers, translation that repeats names and numbers). `union` asks
each member for its proposal, hangs all of them off the same root in member order and sends the result to
the target as one tree, so a step keeps whichever member's guess went furthest.

Merging. Deterministic nodes (q one-hot) with the same parent and token are one node (a trie): members that
agree share nodes, and the target scores each distinct continuation once. Sampled nodes (drawn from a
member's q) are never merged and keep their member's q. The engine's tree rule tries a node's children in
order against the running residual; that is exact for any mix of deterministic children and children drawn
from any q, as long as each draw is independent of the others (docs/architecture.md, "Acceptance, in one
rule"). So the union is exact whenever every member is, and the conformance suite checks it like any other
proposer. (Merging may reorder a member's own siblings; that is harmless because a deterministic node's token
never depends on a sampled sibling's draw.) A member's own duplicate siblings are not merged.

What members learn. After verification every member gets the whole accepted path: `accepted_tokens` and the
hidden states cover every accepted token, and `accepted_nodes` lists the member's own nodes along the path,
which ends where the path leaves that member's proposal, so it can be shorter than `accepted_tokens` (see
`Acceptance`). A member that rolls its own state back by `accepted_nodes` and catches up from the tokens
(as `draft`, `eagle`, `medusa` and `ngram` do) works unchanged.

Cost. Every member drafts every step and the target verifies all of their nodes, so a member that proposes
often and is seldom right makes every step dearer; pick members whose strengths differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, is_dataclass, replace
from typing import Any

import torch
from omegaconf import OmegaConf

from specframe.errors import BadInputError, ConfigError, ProposerError
from specframe.proposer import (
    MAX_PROPOSAL_NODES,
    Acceptance,
    DecodeState,
    Proposal,
    ProposalStructure,
    Proposer,
    TargetInfo,
    built_proposer,
    validate_proposal,
)

# Chosen on held-out training prompts (docs/plugins.md); "ngram" is the separate specframe-ngram plugin.
DEFAULT_MEMBERS = ("eagle", "ngram")
# Members' options on a CPU target, for each key the user does not set. On a CPU every verified token costs
# (4 tokens ~1.4 one-token forwards, default target, 2 cores), and ngram's own default (10 tokens after a match,
# 2 continuations) verifies up to 20 nodes for a guess that EAGLE's node often covers already. Chosen on 24
# held-out training prompts (128 tokens, greedy, 2026-12-05): union 1.39x plain decoding with ngram's 6 tokens of
# 1 continuation, 1.37x with 8 (or 6 of 2), 1.23x with ngram's defaults. On a GPU a member keeps its own defaults.
CPU_MEMBER_OPTIONS = {"ngram": {"num_speculative_tokens": 6, "max_candidates": 1}}


def member_configs_on(config: UnionConfig, device: torch.device | str) -> tuple[list[Any], list[str]]:
    """Each member's config as it runs on `device`: on a CPU with CPU_MEMBER_OPTIONS filled in where
    `proposer.options` does not set them; and those filled in, in words ("ngram num_speculative_tokens=6, ...")."""
    configs, filled = [], []
    for name, cfg in zip(config.members, config.member_configs, strict=True):
        given = config.options.get(name) or {}
        defaults = CPU_MEMBER_OPTIONS.get(name, {}) if torch.device(device).type == "cpu" else {}
        defaults = {k: v for k, v in defaults.items() if k not in given and is_dataclass(cfg) and hasattr(cfg, k)}
        if defaults:
            cfg = replace(cfg, **defaults)
            filled.append(f"{name} " + ", ".join(f"{k}={v}" for k, v in defaults.items()))
        configs.append(cfg)
    return configs, filled


@dataclass
class UnionConfig:
    # Member proposers by registered name, in order: their trees hang off the root in this order (earlier
    # members' children are tried first). A name may repeat (each copy is built separately).
    members: list[str] = field(default_factory=lambda: list(DEFAULT_MEMBERS))
    # Each member's own options by member name, e.g. {ngram: {num_speculative_tokens: 6}}, on the command line
    # `proposer.options.ngram.num_speculative_tokens=6`. Validated by that member's config class.
    options: dict[str, dict[str, Any]] = field(
        default_factory=dict, metadata={"example": "ngram.num_speculative_tokens=6"}
    )

    @staticmethod
    def unknown_key_hint(key: str, prefix: str) -> str:
        """Where a proposer's options go when given as a key of the union itself (`proposer.eagle.model=...`)."""
        from specframe.plugins import get_registry

        if key not in get_registry().names():
            return ""
        return f" (a member's options go under {prefix}.options.{key}: {prefix}.options.{key}.OPTION=VALUE)"

    def __post_init__(self) -> None:
        from specframe.config import structured
        from specframe.plugins import get_registry

        if not isinstance(self.members, list) or not self.members:
            raise ConfigError(f"proposer.members must be a non-empty list of proposer names, got {self.members!r}")
        registry = get_registry()
        for name in self.members:
            if not isinstance(name, str):
                raise ConfigError(f"proposer.members must hold proposer names, got {name!r}")
            if name == UnionProposer.name:
                raise ConfigError("proposer.members: a union cannot have a union as a member")
            try:
                registry.get(name)
            except BadInputError as e:  # (the registry's words: unknown, contested, plugins not loaded)
                missing = name == "ngram" and registry.autoload and name not in registry.contested
                hint = (  # (the bench's words for it)
                    " ('ngram' comes from the specframe-ngram plugin, plugins/specframe-ngram in specframe's "
                    "repository: pip install ./plugins/specframe-ngram)"
                    if missing
                    else ""
                )
                raise ConfigError(f"proposer.members: {e}{hint}; set proposer.members to installed proposers") from e
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"proposer.options must map member names to their options, got {self.options!r}")
        for name, values in self.options.items():
            if not isinstance(values, Mapping):
                raise ConfigError(f"proposer.options.{name} must be a mapping of {name}'s options, got {values!r}")
            if name not in self.members:
                raise ConfigError(
                    f"proposer.options.{name}: '{name}' is not a member (members: {', '.join(self.members)})"
                )
        # One validated config per member (options of a repeated name apply to each copy).
        self.member_configs: list[Any] = []
        for name in self.members:
            values = OmegaConf.create(dict(self.options.get(name) or {}))
            prefix = f"proposer.options.{name}"
            try:
                self.member_configs.append(structured(registry.get(name).cls.config_class, values, prefix))
            except ConfigError as e:
                raise ConfigError(member_keys(str(e), name)) from e


def member_keys(message: str, member: str) -> str:
    """A member's error names its keys `proposer.<key>`; inside a union they are `proposer.options.<member>.<key>`."""
    prefix = f"proposer.options.{member}."
    return message if message.startswith(prefix) else message.replace("proposer.", prefix)


@dataclass
class _Merged:
    proposal: Proposal
    # owners[i]: member index -> that member's node index, for every member whose proposal holds merged node i.
    owners: list[dict[int, int]]


def merge_proposals(
    proposals: list[Proposal],
    vocab_size: int,
    device: torch.device | str,
    structures: list[ProposalStructure] | None = None,  # their trees on the host (validate_proposal's), if known
) -> _Merged:
    """Hang `proposals` off one root in order; deterministic nodes with the same parent and token are shared."""
    tokens: list[int] = []
    parents: list[int] = []
    deterministic: list[bool] = []
    q_rows: dict[int, torch.Tensor] = {}  # merged node -> its q (sampled nodes only)
    owners: list[dict[int, int]] = []
    shared: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged deterministic node
    for m, p in enumerate(proposals):
        where: list[int] = []  # this member's node -> merged node
        if structures is None:
            own_tokens, own_parents, det = p.tokens.tolist(), p.parents.tolist(), p.deterministic.tolist()
        else:
            own_tokens, own_parents, det = structures[m].tokens, structures[m].parents, structures[m].deterministic
        for i, (tok, par) in enumerate(zip(own_tokens, own_parents, strict=True)):
            parent = -1 if par < 0 else where[par]
            node = shared.get((parent, tok)) if det[i] else None
            if node is not None and m in owners[node]:  # only merge across members: a member's own duplicate
                node = None  # siblings stay apart, so what it is told later is a path in its own tree
            if node is None:
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                deterministic.append(det[i])
                owners.append({})
                if det[i]:
                    shared.setdefault((parent, tok), node)  # later members join the first such node
                else:
                    q_rows[node] = p.draft_probs[i]
            owners[node][m] = i
            where.append(node)
    n = len(tokens)
    q = None
    if q_rows:
        q = torch.zeros(n, vocab_size, device=device)
        for node, row in q_rows.items():
            q[node] = row.to(device=device, dtype=q.dtype)
    tree = torch.tensor([tokens, parents, deterministic], dtype=torch.long, device=device)  # (one upload)
    proposal = Proposal(tree[0], tree[1], tree[2].bool(), q)
    return _Merged(proposal, owners)


class UnionProposer(Proposer):
    name = "union"
    config_class = UnionConfig

    def __init__(self, config: UnionConfig, target: TargetInfo, members: list[Proposer]) -> None:
        names = [m.name for m in members]
        if names != list(config.members):  # (built by hand: the config's names say who is who in stats and errors)
            raise ConfigError(f"union: members {names} were given for proposer.members {list(config.members)}")
        super().__init__(config, target)
        self.members = members
        self.merged: _Merged | None = None
        self.whos = [self._name_member(m) for m in range(len(members))]

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """Every layer any member needs; each member is handed only its own."""
        return tuple(sorted({layer for p in self.members for layer in p.hidden_state_layers}))

    @classmethod
    def from_config(cls, config: UnionConfig, target: TargetInfo) -> UnionProposer:
        from specframe.plugins import get_registry

        registry = get_registry()
        members = []
        configs, cpu_defaults = member_configs_on(config, target.device)  # (said in the bench's report)
        for name, cfg in zip(config.members, configs, strict=True):
            try:
                member = registry.get(name).cls.from_config(cfg, target)
            except BadInputError as e:  # keep the error's kind (exit code 2); say which member and which key
                raise type(e)(f"union member '{name}': {member_keys(str(e), name)}") from e
            except Exception as e:
                raise ProposerError(f"union member '{name}' failed to build: {type(e).__name__}: {e}") from e
            members.append(built_proposer(member, f"union member '{name}'", "from_config"))
        union = cls(config, target, members)
        if cpu_defaults:
            union.shape_choice = "on this CPU, " + "; ".join(cpu_defaults) + " (union.CPU_MEMBER_OPTIONS)"
        return union

    @classmethod
    def random(cls, target: TargetInfo, config: UnionConfig | None = None, seed: int = 0) -> UnionProposer:
        """Every member with its own random weights (member i gets seed + i, so repeated names differ)."""
        from specframe.plugins import get_registry

        config = config or UnionConfig()
        registry = get_registry()
        configs, _ = member_configs_on(config, target.device)  # (as from_config: a check tests what runs there)
        members = []
        for i, (name, cfg) in enumerate(zip(config.members, configs, strict=True)):
            member = registry.get(name).cls.random(target, cfg, seed=seed + i)
            members.append(built_proposer(member, f"union member '{name}'", "random"))
        return cls(config, target, members)

    def _name_member(self, m: int) -> str:
        """Member m as errors name it: with its position (from 1) when its name is listed more than once, and
        with its plugin when it comes from one (as a proposer's own errors name it)."""
        from specframe.plugins import get_registry

        name = self.config.members[m]
        who = f"union member {m + 1} '{name}'" if self.config.members.count(name) > 1 else f"union member '{name}'"
        try:
            plugin = get_registry().get(name).plugin
        except BadInputError:  # (a member built by hand, not registered)
            plugin = "builtin"
        return who if plugin == "builtin" else f"{who} (plugin '{plugin}')"

    def _call(self, m: int, fn: Any, *args: Any) -> Any:
        """Call a member's method; its failure names the member (running out of memory stays itself)."""
        try:
            return fn(*args)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except ProposerError as e:  # (already a proposer's own account: said once, after the member's name)
            raise ProposerError(f"{self.whos[m]}: {e}") from e
        except Exception as e:
            raise ProposerError(f"{self.whos[m]} raised {type(e).__name__}: {e}") from e

    def _hidden(self, m: int, hidden_states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {layer: hidden_states[layer] for layer in self.members[m].hidden_state_layers}

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        self.merged = None
        for m, member in enumerate(self.members):
            self._call(m, member.begin, prompt, self._hidden(m, hidden_states))

    def end(self) -> None:
        self.merged = None
        for m, member in enumerate(self.members):
            self._call(m, member.end)

    def propose(self, state: DecodeState) -> Proposal:
        proposals, structures = [], []
        for m, member in enumerate(self.members):
            # (each member its own copy of the tokens, as the engine gives a proposer: one member's edits of
            # state.tokens, a breach of the contract, must not mislead the others)
            p = self._call(m, member.propose, replace(state, tokens=state.tokens.clone()))
            structures.append(validate_proposal(p, self.target.vocab_size, state.max_depth, self.whos[m]))
            proposals.append(p)
        self.merged = merge_proposals(proposals, self.target.vocab_size, state.tokens.device, structures)
        nodes = len(self.merged.proposal)
        if nodes > MAX_PROPOSAL_NODES:  # (each member's fits; together, not shared, they do not)
            raise ProposerError(
                f"union: its {len(self.members)} members proposed {nodes} nodes together, more than the "
                f"{MAX_PROPOSAL_NODES} one verification takes: use fewer members or smaller drafts (e.g. a lower "
                "num_speculative_tokens)"
            )
        return self.merged.proposal

    def accepted(self, result: Acceptance) -> None:
        if self.merged is None:
            raise RuntimeError("union: accepted() without a proposal")
        for m, member in enumerate(self.members):
            own: list[int] = []
            for node in result.accepted_nodes:  # the path, root to leaf, until it leaves this member's tree
                i = self.merged.owners[node].get(m)
                if i is None:
                    break
                own.append(i)
            hidden = self._hidden(m, result.hidden_states)
            told = Acceptance(own, list(result.accepted_tokens), result.next_token, hidden)
            self._call(m, member.accepted, told)
        self.merged = None
