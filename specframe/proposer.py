"""The proposer contract: the `Proposer` abstract base class and the data it exchanges with the engine.

A proposal is a tree of draft tokens hanging off the *root*: the last emitted token, which the target has
not yet processed. Node i has token `tokens[i]` and parent `parents[i]` (-1 = the root; otherwise an earlier
node, so the list is in topological order and cannot hold a cycle). A chain is the tree whose parents are
-1, 0, 1, ....

Each node also says how its token was chosen, which the exact acceptance rule needs:
- `deterministic[i]` True: chosen without randomness (argmax, top-k, n-gram lookup); q is one-hot.
- otherwise the token was drawn from `draft_probs[i]`, the full distribution q (already passed through the
  same sampling transform as the target's p) at its parent's position; siblings drawn i.i.d. share it.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from specframe.errors import ConfigError, ModelLoadError, ProposerError
from specframe.sampling import History, SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] long, draft token ids
    parents: torch.Tensor  # [n] long, parent node index, -1 = root
    deterministic: torch.Tensor  # [n] bool, True = one-hot q
    draft_probs: torch.Tensor | None = None  # [n, V] float, q of non-deterministic nodes (rows of others unused)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> Proposal:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone(), torch.zeros(0, dtype=torch.bool, device=device))

    @classmethod
    def chain(
        cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None, deterministic: bool = False
    ) -> Proposal:
        """A chain of len(tokens) nodes, deterministic when `deterministic` is set or `draft_probs` is None (else
        each node was drawn from its row of `draft_probs`). `tokens` may be any integer dtype (made int64); floats
        are refused, not rounded."""
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"Proposal.chain: tokens must be an integer tensor, got {tokens.dtype}")
        if tokens.dim() > 1 and not (tokens.dim() == 2 and 1 in tokens.shape):  # (a batch is not one chain)
            raise ValueError(
                f"Proposal.chain: tokens must be one chain, [n], [1, n] or [n, 1], got shape {tuple(tokens.shape)}"
            )
        n = tokens.numel()
        parents = torch.arange(-1, n - 1, device=tokens.device)
        det = torch.full((n,), deterministic or draft_probs is None, dtype=torch.bool, device=tokens.device)
        return cls(tokens.reshape(-1).long(), parents, det, draft_probs)

    def __len__(self) -> int:
        return self.tokens.numel()

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        return depths_of(self.parents.tolist())

    def is_chain(self) -> bool:
        n = len(self)
        return bool(n == 0 or torch.equal(self.parents.cpu(), torch.arange(-1, n - 1)))


def depths_of(parents: list[int]) -> list[int]:
    """Each node's depth from its parent's index (-1: the root; children of the root have depth 1)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


@dataclass
class TargetInfo:
    """What a proposer may know about the target when it is built."""

    vocab_size: int  # rows of the target's logits; every token id must be below it
    hidden_size: int
    num_layers: int
    device: torch.device
    dtype: torch.dtype
    model: Any = None  # the target model itself (e.g. to share its embeddings or LM head); never modify it
    tokenizer: Any = None  # the target's tokenizer, or None
    name: str = ""  # the target as configured (`target.model`: alias, path or hub id); "" when built in code
    # Whether the target runs on specframe's CPU kernels (`target.fast_cpu_kernels`, specframe/cpu_kernels.py):
    # a proposer's own models and few-row products follow it.
    fast_cpu_kernels: bool = False


@dataclass
class DecodeState:
    """What the engine tells a proposer before each proposal."""

    tokens: torch.Tensor  # [T] long: prompt + every emitted token; tokens[-1] is the root (not in target's cache)
    prompt_length: int  # tokens[:prompt_length] is the prompt
    sampling: SamplingParams  # the transform for q must be exactly this one (see specframe.sampling)
    generator: torch.Generator  # draw every random choice from this, so a seed reproduces the output
    max_depth: int  # deepest node the engine can still use (remaining token budget and context window)
    # With penalties on, the engine's own penalties' history of these tokens (the prompt, the output so far; over
    # the target's vocabulary, on its device): `penalised` reads it rather than counting the tokens again. None in
    # a state made by hand: then `penalised` counts them.
    history: History | None = None
    # (the penalties' history of the tokens, by vocabulary size and device: made on first use)
    _histories: dict[tuple, History] = field(default_factory=dict, init=False, repr=False, compare=False)

    def penalised(
        self, logits: torch.Tensor, drafted: torch.Tensor | None = None, columns: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`logits` with the penalties of `sampling` (repetition, presence, frequency) as the target's logits at
        the same position get them: `logits` ([V] or [R, V], over the target's vocabulary) predict the token
        after the root, or where `drafted` is given after the root and those draft tokens ([d]: one path for
        every row; [R, d]: row r's after drafted[r]). `columns`: the token ids of the logits' columns where they
        are a reduced vocabulary ([V'] ids, V' = the logits' width). Returns the logits themselves when no
        penalty is on, else penalised float32 (float64) logits. A proposer that drafts from penalised logits
        drafts what the target will choose under penalties; exactness never depends on it."""
        if not self.sampling.penalised:
            return logits
        rows_count = logits.shape[0] if logits.dim() == 2 else 1
        paths = None
        if drafted is not None and drafted.numel():
            paths = drafted if drafted.dim() == 2 else drafted.reshape(1, -1).expand(rows_count, -1)
            if paths.dim() != 2 or paths.shape[0] != rows_count:
                raise ValueError(
                    f"DecodeState.penalised: drafted must be [d] (one path for every row) or [R, d] (a path a row) "
                    f"with R = {rows_count}, the logits' rows; got shape {tuple(drafted.shape)} for logits of "
                    f"shape {tuple(logits.shape)}"
                )
        # (with the engine's history every id is below its vocabulary: nothing to leave out, no host wait)
        known = self.history is not None
        if known:
            size = self.history.output_counts.numel()
        else:
            size = logits.shape[-1] if columns is None else int(columns.max()) + 1
        device = logits.device
        history = self.history if known and self.history.output_counts.device == device else None
        history = history or self._histories.get((size, device))
        if history is None:
            ids = self.tokens.to(device)
            prompt, output = ids[: self.prompt_length], ids[self.prompt_length :]
            if not known:  # (ids past a reduced vocabulary's highest never reach a column)
                prompt, output = prompt[prompt < size], output[output < size]
            history = History(prompt, size, output)
            self._histories[(size, device)] = history
        rows = tokens = None
        if paths is not None:
            rows = torch.arange(rows_count, device=device).repeat_interleave(paths.shape[1])
            tokens = paths.reshape(-1).to(device)
            if not known:
                rows, tokens = rows[tokens < size], tokens[tokens < size]
        return history.penalised(logits, self.sampling, rows, tokens, columns)


@dataclass
class Acceptance:
    """What the engine tells a proposer after verification."""

    # Proposal node indices on the accepted path, root-to-leaf order. Inside a `union` a member's path may go on
    # through other members' nodes: it then lists only the member's own nodes up to where the path left them,
    # and is shorter than `accepted_tokens`.
    accepted_nodes: list[int]
    accepted_tokens: list[int]  # every accepted token on the path (the tokens of the accepted nodes)
    next_token: int  # the token the target emitted after them (residual or bonus); the next root
    # Hidden states of the target layers the proposer asked for, at the positions newly kept in the
    # target's cache (the root, then each accepted token): layer index -> [len(accepted_tokens) + 1, hidden].
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class Proposer(ABC):
    """Base class of every proposer, built-in or plugin.

    Subclasses set `name` and `config_class` (a dataclass whose fields are the `proposer.*` config keys,
    validated in `__post_init__`), and may set `hidden_state_layers`: indices into the target's
    `hidden_states` tuple (0 = embeddings, -1 = last layer after the final norm) it needs.
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    hidden_state_layers: tuple[int, ...] = ()
    # Options of `specframe train --proposer NAME` (a dataclass), or None when the proposer has nothing to
    # train. A trainable proposer also defines `train(config, target, tokenizer, resume) -> dict of metrics`.
    train_config_class: ClassVar[type | None] = None

    def __init__(self, config: Any, target: TargetInfo) -> None:
        self.config = config
        self.target = target

    @classmethod
    def from_config(cls, config: Any, target: TargetInfo) -> Proposer:
        """Build from a config, loading any trained weights it names. Default: the constructor."""
        return cls(config, target)

    @classmethod
    def random(cls, target: TargetInfo, config: Any = None, seed: int = 0) -> Proposer:
        """Build with random weights for any target, so the conformance suite needs no trained artifact.

        `config` defaults to `config_class()`; `seed` fixes the random weights (an override draws them inside
        `with seeded(seed):`). Default: the constructor, run inside `seeded(seed)`."""
        with seeded(seed):
            return cls(cls.config_class() if config is None else config, target)

    @abstractmethod
    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        """Start a new sequence. `prompt` is [T]; `hidden_states` holds the requested layers over the prompt."""

    @abstractmethod
    def propose(self, state: DecodeState) -> Proposal:
        """Draft a tree (or chain, or nothing) to continue `state.tokens`."""

    @abstractmethod
    def accepted(self, result: Acceptance) -> None:
        """Learn what was kept, and roll back any state built on rejected nodes."""

    def end(self) -> None:
        """The request is over (finished or failed): let go of what only it needed, such as a KV cache, so that
        nothing of it stays in memory between requests. Optional; default: nothing to let go of."""
        return None


def built_proposer(built: Any, who: str, how: str) -> Proposer:
    """`built`, what a proposer class's `how` (`from_config`, `random`) returned, when it is a Proposer; else a
    ProposerError naming the proposer (`who`) and what came back, rather than a failure later on its attributes."""
    if isinstance(built, Proposer):
        return built
    raise ProposerError(f"{who}'s {how}() returned {given_in_words(built)}, not a Proposer instance")


def given_in_words(given: Any) -> str:
    """What was given where another kind of object belongs, in words: None, a list, the class X (not an instance)."""
    if given is None:
        return "None"
    if isinstance(given, type):
        return f"the class {given.__name__} (not an instance of it)"
    name = type(given).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def check_confidence_threshold(value: Any, what: str = "proposer.confidence_threshold") -> None:
    """Raise ConfigError unless `value` (named `what` in the message) is None or a number in [0, 1)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{what} must be a number in [0, 1), got {value!r}")


def resolve_confidence_threshold(configured: float | None, saved: Any, what: str) -> float:
    """The threshold in force: the configured one, else the artifact's saved one (checked, named `what` in
    the error), else 0 (off)."""
    if configured is None:
        check_confidence_threshold(saved, what)
        configured = saved
    return float(configured or 0.0)


def saved_shape_applies(meta: dict, device: torch.device, what: str) -> bool:
    """Whether the proposal shape saved with an artifact (a draft's γ, Medusa's tree, EAGLE's tree shape) applies
    on `device`. An artifact may say which device type the shape was measured on (`shape_tuned_on`, e.g. "cpu":
    on a CPU a few more tokens per verification cost time, on a GPU they are nearly free); on another device
    type the proposer's default for that device is used instead. Without the key the saved shape applies."""
    tuned = meta.get("shape_tuned_on")
    if tuned is None:
        return True
    try:
        return torch.device(tuned.strip().lower()).type == device.type  # ("cuda:0" is the device type cuda)
    except (AttributeError, RuntimeError, TypeError) as e:
        raise ModelLoadError(f"shape_tuned_on in {what} must be a device type such as 'cpu', got {tuned!r}") from e


class ProposalStructure(NamedTuple):
    """A proposal's tree on the host, as `validate_proposal` read it (one transfer): what the engine and the
    acceptance rule read of it, so that neither reads the proposal's tensors again."""

    tokens: list[int]
    parents: list[int]
    deterministic: list[bool]
    depths: list[int]  # each node's depth (children of the root have depth 1)

    def is_chain(self) -> bool:
        """Whether each node hangs off the one before (the target's own causal mask then serves as the tree's)."""
        return self.depths == list(range(1, len(self.depths) + 1))


def validate_proposal(
    p: Proposal, vocab_size: int, max_depth: int, who: str, device: torch.device | None = None
) -> ProposalStructure:
    """Raise ProposerError naming `who` unless `p` is a well-formed proposal; return its tree as host lists.
    `device`: where the target's logits are (a tensor's `.device`, so "cuda:0", not "cuda"), and so where sampled
    nodes' draft_probs must be."""
    try:
        return _checked_structure(p, vocab_size, max_depth, who, device)
    except (ProposerError, MemoryError, torch.OutOfMemoryError):  # (out of memory is not the proposal's fault)
        raise
    except Exception as e:  # (tensors the checks cannot read: a meta tensor's .tolist(), a sparse one's gather)
        raise ProposerError(f"{who} returned a malformed proposal: {type(e).__name__}: {e}") from e


def _checked_structure(
    p: Proposal, vocab_size: int, max_depth: int, who: str, device: torch.device | None
) -> ProposalStructure:
    def bad(msg: str) -> ProposerError:
        return ProposerError(f"{who} returned a malformed proposal: {msg}")

    if not isinstance(p, Proposal):
        raise bad(f"expected a Proposal, got {type(p).__name__}")
    for fname in ("tokens", "parents", "deterministic"):
        if not isinstance(getattr(p, fname), torch.Tensor):
            raise bad(f"{fname} is not a tensor")
    n = p.tokens.numel()
    if p.tokens.dim() != 1 or p.parents.shape != p.tokens.shape or p.deterministic.shape != p.tokens.shape:
        raise bad(
            f"tokens, parents and deterministic must be 1-D of one length, got shapes "
            f"{tuple(p.tokens.shape)}, {tuple(p.parents.shape)}, {tuple(p.deterministic.shape)}"
        )
    wrong = [
        f"{fname} is {getattr(p, fname).dtype}, not {want}"
        for fname, want in (("tokens", torch.long), ("parents", torch.long), ("deterministic", torch.bool))
        if getattr(p, fname).dtype != want
    ]
    if wrong:
        raise bad("tokens and parents must be int64 and deterministic bool: " + ", ".join(wrong))
    if n == 0:
        return ProposalStructure([], [], [], [])
    if n > MAX_PROPOSAL_NODES:  # (before its structure is read: a plugin's runaway tree, not an out-of-memory)
        raise bad(
            f"{n} nodes, more than the {MAX_PROPOSAL_NODES} one verification forward takes (its tree attention "
            "grows with the square of the nodes)"
        )
    # The structure comes to the host in one transfer, then is checked in Python (a sync per check would stall
    # a GPU several times a step; proposals are small).
    structure = torch.cat([p.tokens, p.parents.to(p.tokens.device), p.deterministic.to(p.tokens.device, torch.long)])
    flat = structure.tolist()
    tokens, parents, deterministic = flat[:n], flat[n : 2 * n], [bool(d) for d in flat[2 * n :]]
    outside = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise bad(f"node {outside}'s token id {tokens[outside]} is out of range [0, {vocab_size})")
    orphan = next((i for i, parent in enumerate(parents) if not -1 <= parent < i), None)
    if orphan is not None:
        raise bad(
            f"node {orphan}'s parent is {parents[orphan]}: each parent must be -1 (the root) or an earlier node's index"
        )
    depths = depths_of(parents)
    if max(depths) > max_depth:
        raise bad(f"tree depth {max(depths)} exceeds the allowed {max_depth}")
    if not all(deterministic):
        q = p.draft_probs
        if not isinstance(q, torch.Tensor) or q.shape != (n, vocab_size):
            got = f"shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else given_in_words(q)
            raise bad(f"draft_probs must be a [{n}, {vocab_size}] tensor for sampled nodes, got {got}")
        if device is not None and q.device != device:  # (acceptance compares q with the target's p)
            raise bad(f"draft_probs is on {q.device}, the target's logits on {device}")
        # Only the rows of sampled nodes are read, so only they are checked: two reductions over each (a row's
        # smallest entry is NaN or negative, or its sum not finite, where it has a NaN, a negative or an infinite
        # entry), the three checks back in one transfer.
        nodes = [i for i, d in enumerate(deterministic) if not d]
        drafted = p.tokens.to(q.device)
        if len(nodes) < n:  # (when all are sampled, as a draft model's chain: no index to copy to the device)
            index = torch.tensor(nodes, device=q.device)
            q, drafted = q.index_select(0, index), drafted[index]
        rows = q.float()
        smallest, total = rows.amin(-1), rows.sum(-1)
        broken = ~(smallest >= 0) | ~torch.isfinite(total)
        unnormalised = ~torch.isclose(total, torch.ones_like(total), rtol=0.0, atol=1e-3)
        # (a sampled token must have been drawn from its row: at q = 0 the rejection rule would accept it always)
        impossible = rows.gather(1, drafted[:, None])[:, 0] <= 0
        flags = torch.stack([broken.any(), unnormalised.any(), impossible.any()])
        broken_rows, unnormalised_rows, impossible_token = flags.tolist()
        # (said with the first offending node: only now, on the way to an error, is more read from the device)
        if broken_rows:
            node = nodes[int(broken.nonzero()[0, 0])]
            raise bad(f"draft_probs has negative or non-finite entries (node {node}'s row)")
        if unnormalised_rows:
            row = int(unnormalised.nonzero()[0, 0])
            short = q.is_floating_point() and q.element_size() < 4
            coarse = f"; it is {q.dtype}: give float32 probabilities" if short else ""
            raise bad(f"draft_probs rows do not sum to 1 (node {nodes[row]}'s sums to {float(total[row]):.6g}{coarse})")
        if impossible_token:
            node = nodes[int(impossible.nonzero()[0, 0])]
            raise bad(f"node {node}'s token {tokens[node]} has draft probability 0 in its draft_probs row (a sampled "
                      "token must be drawn from its row)")  # fmt: skip
    return ProposalStructure(tokens, parents, deterministic, depths)


# The most draft nodes a built-in tree proposer verifies per step, from a config or a saved artifact (EAGLE-2 uses
# 60, Medusa 64): a verification forward's tree attention grows with the square of its nodes, so a mistaken or
# hostile medusa_config.json of 37,448 nodes took 16 GB and 89 s for 16 tokens of a tiny target.
MAX_TREE_NODES = 1024
# The most nodes any proposal may have, a plugin's too, checked by `validate_proposal`: room for a union of several
# full built-in trees, and a clear error instead of gigabytes of attention for a runaway one.
MAX_PROPOSAL_NODES = 8 * MAX_TREE_NODES

_SEEDING = threading.RLock()  # (re-entrant: a build may call another seeded build)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's global CPU generator seeded with `seed` for the duration, and put back afterwards: for random
    weights, since PyTorch's module initialisers draw from that generator. One such block runs at a time in the
    process, so builds in parallel threads each get their own seed's weights (a thread that draws from the
    global generator outside such a block still interferes)."""
    with rng_untouched():
        torch.random.default_generator.manual_seed(seed)  # (torch.manual_seed would reseed the GPUs' generators too)
        yield


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """torch's global CPU generator put back after the block: around modules built only to receive saved weights
    (a trained proposer's, an adapter's), whose initialisers draw from it, so that loading them leaves a user's
    seeded draws as they were (`torch.manual_seed(0)`, build a decoder, `torch.rand(...)`: the numbers of no
    build). Holds `seeded`'s lock, so a build in another thread does not draw in between (draws another thread
    makes outside that lock meanwhile are undone too, as with `seeded`; and code inside a `seeded` block must not
    wait on another thread that builds from saved weights: it would wait for the lock)."""
    with _SEEDING, torch.random.fork_rng(devices=[]):
        yield
