"""The sampling transform T(logits) -> probabilities, applied identically to target (p) and draft (q).

Order: temperature, then top-k, then top-p, then normalise. Everything is computed in float32 (or float64
when the logits already are), so bf16/fp16 models share one numerically safe path. Temperature 0 is greedy:
T returns the one-hot distribution of the argmax (lowest index on ties).

Ties at a cut: top-k keeps every token tied with the k-th (as transformers' TopKLogitsWarper does). Top-p ranks
tied tokens by index, lowest first (a stable sort, the same on every device), so where the cut falls inside a
run of ties the lower ids are kept; transformers' TopPLogitsWarper usually keeps the higher ones. Both are nucleus sets
of the same mass, and exactness is unaffected (p and q go through this one function); it shows only as a
different draw than transformers' own sampling, mostly with 16-bit logits, where ties are common.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specframe.errors import ConfigError, is_count, is_number


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; otherwise logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 = off (-1, vLLM's spelling of off, is stored as 0)
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 = off

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        object.__setattr__(self, "top_k", top_k_off_as_zero(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_seed(seed: object, key: str = "sampling.seed", unset: str = " or unset (a fresh seed)") -> None:
    """Raise ConfigError naming `key` unless `seed` is None or an integer a torch.Generator takes."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64):
        raise ConfigError(f"{key} must be an integer in [-2**63, 2**64){unset}, got {seed!r}")


def check_sampling(temperature: float, top_k: int, top_p: float, prefix: str = "sampling.") -> None:
    """Raise ConfigError naming the key of the first out-of-range or non-numeric sampling value."""
    if not is_number(temperature) or not 0.0 <= temperature < float("inf"):  # also rejects NaN
        raise ConfigError(f"{prefix}temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not is_number(top_p) or not (0.0 < top_p <= 1.0):
        raise ConfigError(f"{prefix}top_p must be a number in (0, 1], got {top_p!r}")
    if not is_count(top_k, -1):
        raise ConfigError(f"{prefix}top_k must be an integer >= 1, or 0 or -1 for off, got {top_k!r}")


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
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        sorted_p = sorted_x.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1).to(dtype)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D probability vector (need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator))
