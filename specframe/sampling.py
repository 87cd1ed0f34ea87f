"""The sampling transform T(logits) -> probabilities, applied identically to target (p) and draft (q).

Order: temperature, then top-k, then top-p, then min-p, then normalise (the order of transformers' warpers).
Everything is computed in float32 (or float64 when the logits already are), so bf16/fp16 models share one
numerically safe path. Temperature 0 is greedy: T returns the one-hot distribution of the argmax (lowest index
on ties).

Ties at a cut: top-k keeps every token tied with the k-th (as transformers' TopKLogitsWarper does). Top-p ranks
tied tokens by index, lowest first (a stable sort, the same on every device), so where the cut falls inside a
run of ties the lower ids are kept; transformers' TopPLogitsWarper usually keeps the higher ones. Both are nucleus sets
of the same mass, and exactness is unaffected (p and q go through this one function); it shows only as a
different draw than transformers' own sampling, mostly with 16-bit logits, where ties are common.

Min-p (Nguyen et al., 2024; transformers' MinPLogitsWarper, vLLM's min_p) keeps the tokens whose probability is
at least min_p times the most likely token's. Top-k and top-p never drop the most likely token, and the ratio of
two kept tokens' probabilities does not depend on what else is kept, so min-p after them is the plain test
`scaled logit >= top scaled logit + log(min_p)`, here on the logits (transformers compares probabilities: the
same set up to rounding at the cut). Tokens tied with the top token always stay (min_p = 1 keeps only those).

Penalties (`apply_penalties`) come before all of it, on the raw logits, and depend on the tokens before the
position: vLLM's repetition penalty (a token in the prompt or the output so far: a positive logit divided by it, a
negative one multiplied, as transformers' RepetitionPenaltyLogitsProcessor does), presence penalty (subtracted from
each token the output holds) and frequency penalty (times how often the output holds it). They apply in greedy
decoding too. The engine applies them to each verified row with that row's own history (the output so far and the
tree path to the row's node), so the target's distribution is the penalised one, exactly. Proposers draft under
them too (`DecodeState.penalised`, the same `History`): not needed for exactness, but then their drafts are what
the target will choose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specframe.errors import ConfigError, is_count, is_number


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; otherwise logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 = off (-1, vLLM's spelling of off, is stored as 0)
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 = off
    min_p: float = 0.0  # keep tokens at least min_p x as likely as the most likely one; 0.0 = off
    repetition_penalty: float = 1.0  # > 0: logits of tokens in the prompt or output divided (if > 0) or multiplied
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from the logit of each token the output holds
    frequency_penalty: float = 0.0  # in [-2, 2]: times each token's count in the output, subtracted from its logit

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        check_penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        object.__setattr__(self, "top_k", top_k_off_as_zero(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (then the target's logits depend on the tokens before each position)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def check_penalties(repetition: float, presence: float, frequency: float, prefix: str = "sampling.") -> None:
    """Raise ConfigError naming the key of the first out-of-range or non-numeric penalty."""
    if not is_number(repetition) or not 0.0 < repetition < float("inf"):
        raise ConfigError(f"{prefix}repetition_penalty must be a finite number > 0 (1 = off), got {repetition!r}")
    for key, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not is_number(value) or not -2.0 <= value <= 2.0:
            raise ConfigError(f"{prefix}{key} must be a number in [-2, 2] (0 = off), got {value!r}")


def apply_penalties(
    logits: torch.Tensor, prompt_seen: torch.Tensor, output_counts: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """The penalised logits ([R, V], float32 or float64) of rows whose prompt holds the tokens `prompt_seen` marks
    ([V] bool) and whose output so far holds each token `output_counts[r]` times ([R, V])."""
    x = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    counts = output_counts.to(x.dtype)
    if params.repetition_penalty != 1.0:
        seen = prompt_seen | (counts > 0)
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty != 0.0:
        x = x - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        x = x - params.presence_penalty * (counts > 0).to(x.dtype)
    return x


class History:
    """What the penalties read of the tokens before a position: which tokens the prompt holds, and how often the
    output so far holds each (on the prompt's device). The engine keeps one per call for the target's rows, and
    hands it to the proposers' drafts in `DecodeState.history` (`DecodeState.penalised`)."""

    def __init__(self, prompt_ids: torch.Tensor, vocab_size: int, output_ids: torch.Tensor | None = None) -> None:
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=prompt_ids.device)
        self.prompt_seen[prompt_ids] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=prompt_ids.device)
        if output_ids is not None and output_ids.numel():
            self.output_counts.index_add_(0, output_ids, torch.ones(output_ids.numel(), device=prompt_ids.device))

    def add(self, tokens: list[int]) -> None:
        """The output gained `tokens`."""
        index = torch.tensor(tokens, device=self.output_counts.device)
        self.output_counts.index_add_(0, index, torch.ones(len(tokens), device=index.device))

    def penalised(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        rows: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        columns: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`logits` ([R, V], or [V] for one row) penalised (float32 or float64), each row with the output so far
        and, given `rows` and `tokens` (1-D, as long as each other), token tokens[i] once more in row rows[i]: the
        draft tokens between the output and the row's position. `columns`: the token ids of the logits' columns
        where they are not the whole vocabulary in order (a reduced draft vocabulary)."""
        one_row = logits.dim() == 1
        x = logits[None] if one_row else logits
        counts, seen = self.output_counts, self.prompt_seen
        if columns is not None:  # (the columns first: a reduced vocabulary's rows are that much smaller)
            counts, seen = counts[columns], seen[columns]
        counts = counts.expand(x.shape[0], -1)
        if rows is not None and rows.numel():
            at = tokens if columns is None else self._column_of(columns)[tokens]
            # (an id outside the columns goes to one more column, dropped after: no host wait to leave it out)
            counts = torch.cat([counts, counts.new_zeros(x.shape[0], 1)], 1)
            counts.index_put_((rows, at), torch.ones(rows.numel(), device=rows.device), accumulate=True)
            counts = counts[:, :-1]
        x = apply_penalties(x, seen, counts, params)
        return x[0] if one_row else x

    def _column_of(self, columns: torch.Tensor) -> torch.Tensor:
        """Each token id's column among `columns` ([V] long; len(columns) for ids not among them), made once per
        `columns` tensor."""
        made = getattr(self, "_columns", None)
        if made is None or made[0] is not columns:
            column_of = torch.full_like(self.output_counts, len(columns), dtype=torch.long)
            column_of[columns] = torch.arange(len(columns), device=columns.device)
            self._columns = made = (columns, column_of)
        return made[1]


def check_seed(seed: object, key: str = "sampling.seed", unset: str = " or unset (a fresh seed)") -> None:
    """Raise ConfigError naming `key` unless `seed` is None or an integer a torch.Generator takes."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64):
        raise ConfigError(f"{key} must be an integer in [-2**63, 2**64){unset}, got {seed!r}")


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float = 0.0, prefix: str = "sampling.") -> None:
    """Raise ConfigError naming the key of the first out-of-range or non-numeric sampling value."""
    if not is_number(temperature) or not 0.0 <= temperature < float("inf"):  # also rejects NaN
        raise ConfigError(f"{prefix}temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not is_number(top_p) or not (0.0 < top_p <= 1.0):
        raise ConfigError(f"{prefix}top_p must be a number in (0, 1], got {top_p!r}")
    if not is_count(top_k, -1):
        raise ConfigError(f"{prefix}top_k must be an integer >= 1, or 0 or -1 for off, got {top_k!r}")
    if not is_number(min_p) or not (0.0 <= min_p <= 1.0):
        raise ConfigError(f"{prefix}min_p must be a number in [0, 1] (0 = off), got {min_p!r}")


def top_k_off_as_zero(top_k: int) -> int:
    """One spelling of "top-k off": vLLM's -1 becomes 0 (transformers' and specframe's)."""
    return 0 if top_k == -1 else top_k


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """T(logits): [..., V] logits -> [..., V] probabilities (float32 or float64), rows sum to 1."""
    x = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
    dtype = x.dtype
    if not torch.finfo(dtype).tiny <= params.temperature <= torch.finfo(dtype).max:
        x = x.double()  # (it would round to 0 or inf in float32, and 0 / 0 or -inf / inf is nan)
    # (shifted by the row's maximum first: softmax is unchanged, and a tiny temperature cannot overflow to inf)
    x = (x - x.amax(-1, keepdim=True)) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        drop = _nucleus_drop_among_candidates(x, params.top_p)
        x = x.masked_fill(_nucleus_drop(x, params.top_p) if drop is None else drop, float("-inf"))
    if params.min_p > 0.0:  # (the top scaled logit is 0 after the shift, and no cut above dropped it)
        x = x.masked_fill(x < math.log(params.min_p), float("-inf"))
    return x.softmax(-1).to(dtype)


def _nucleus_drop(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's cut of `x` ([..., V] scaled logits) in the order of a stable descending sort (among tied logits, the
    lower ids first): a token is dropped when the mass strictly before it already reaches top_p; the top token
    always stays. Returns the dropped tokens, True where dropped."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    drop_sorted = _dropped_in_order(sorted_x.softmax(-1), top_p)
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def _dropped_in_order(sorted_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's rule over probabilities in sorted order ([..., n]): a token is dropped when the mass strictly before
    it already reaches top_p; the first always stays."""
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop[..., 0] = False
    return drop


NUCLEUS_CANDIDATES = 256  # the largest logits that `_nucleus_drop_among_candidates` sorts, ties with the last included


def _nucleus_drop_among_candidates(x: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """`_nucleus_drop` of one row on the CPU, sorting only its NUCLEUS_CANDIDATES largest logits (and any tied with
    the smallest of them), where their mass reaches top_p: they are the first of the full sort's order, so the cut
    falls among them, where the full sort puts it, and every other token is dropped. A sort of a 49,152-token
    vocabulary costs about 4 ms on a 2-core CPU, a sizeable part of a decoding step; this, about a tenth of that.
    None where it does not apply (several rows; a GPU, where the full sort is fast and this check would wait for
    the device; candidates whose mass falls short of top_p)."""
    vocab = x.shape[-1]
    if x.dim() != 1 or x.device.type != "cpu" or vocab <= 2 * NUCLEUS_CANDIDATES:
        return None
    kth = torch.topk(x, NUCLEUS_CANDIDATES).values[-1]
    # (in id order, as the stable sort keeps tied ones; where top-k left fewer finite logits, those)
    candidates = torch.nonzero(x >= kth if kth > float("-inf") else x > kth).squeeze(-1)
    if candidates.numel() > 2 * NUCLEUS_CANDIDATES:  # (many tied with the last: the full sort)
        return None
    sorted_x, order = torch.sort(x[candidates], descending=True, stable=True)
    sorted_p = (sorted_x - torch.logsumexp(x, -1)).exp()  # (each candidate's probability among all V)
    if not float(sorted_p.cumsum(-1)[-1]) >= top_p:  # (the nucleus reaches past the candidates: as the rule adds)
        return None
    drop = torch.ones_like(x, dtype=torch.bool)
    drop[candidates[order]] = _dropped_in_order(sorted_p, top_p)
    return drop


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D probability vector (need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator))
