"""Faster CPU matmuls for the few-row batches that verification produces.

Verifying a proposal runs the target on 2-64 tokens at once. On CPU, in float32, PyTorch's `linear` sends
such a batch to MKL as `X @ W.T`, and MKL's small-M kernels for that layout read the weights at well under
half the memory bandwidth a single decode step gets; the same product computed as `(W @ X.T).T` does not
have the problem. Measured on this project's 2-core machine, SmolLM2-135M, 300 tokens of context:

    rows in the forward          1     2     3     4     8    16    32
    plain linear (ms)           59   101   131    95    99   121   150
    W @ X.T for 2-64 rows (ms)  55    47    52    50    68    81   109

So verifying 2-8 tokens costs about what decoding one does, which is what speculative decoding assumes.
One-row decoding (plain generate) and prefills longer than 64 tokens keep PyTorch's own path, so `none`
stays the same speed as transformers' plain generate. The results differ from `linear` only by float
rounding (the summation order of each dot product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS, MAX_ROWS = 2, 64


def _linear_small_batch(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features if x.dim() else 0
    if MIN_ROWS <= rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32:
        y = torch.mm(self.weight, x.reshape(rows, self.in_features).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
    return F.linear(x, self.weight, self.bias)


def use_small_batch_gemm(model: torch.nn.Module) -> int:
    """Route `model`'s float32 CPU `nn.Linear` layers through the faster layout; returns how many were."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            if module.weight.dtype == torch.float32:
                module.forward = _linear_small_batch.__get__(module)
                n += 1
    return n


def undo_small_batch_gemm(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" in module.__dict__:
            del module.forward
