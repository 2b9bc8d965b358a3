"""The RMSNorm variants of the hybrid families, beside layers.RMSNorm (x / rms(x) * w).

Qwen3.5 and Qwen3-Next scale by 1 + w (their weights are stored zero-centred) and round once,
after scaling; their Gated DeltaNet layers norm each head's output and gate it with silu(z).
Both normalise in float32 (float64 for a float64 model), as the reference does. On the CPU in
float32 or bfloat16 the offset norm (and the residual add before it) is one call of
kernels/recurrent_kernels; the gated norm is part of that file's Gated DeltaNet call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outpace.kernels import recurrent_kernels


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm computes in: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed wide and rounded once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_forward(x, None)[1]

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None,
                    kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm), as layers.RMSNorm.add_forward (delta None: (h, its norm)). The
        kernel serves wherever its dtype does (`kernels` is the dense norm's flag)."""
        if recurrent_kernels.serves(h):
            weight = recurrent_kernels.kernel_weights(self, (self.weight,), lambda w: (1 + w,))[0]
            return recurrent_kernels.offset_rms_norm(h, delta, weight, self.eps)
        if delta is not None:
            h = h + delta
        wide = _wide(h.dtype)
        return h, (F.rms_norm(h.to(wide), self.shape, eps=self.eps) * (1 + self.weight.to(wide))).to(h.dtype)


class GatedRMSNorm(nn.Module):
    """x / rms(x) * w * silu(gate) over the last dim: rounded to x's dtype before the weight, as the
    reference does, the gate applied wide."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        wide = _wide(x.dtype)
        normed = F.rms_norm(x.to(wide), self.shape, eps=self.eps).to(x.dtype) * self.weight
        return (normed.to(wide) * F.silu(gate.to(wide))).to(x.dtype)
