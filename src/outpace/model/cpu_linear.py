"""Linear layers of a bfloat16 CPU model with weights packed once at load.

Where cpu_kernels builds for AVX-512, bfloat16 products run as cpu_kernels.linear over weights in
its own layout. Otherwise they run in oneDNN over weights reordered once into its blocked layout
(F.linear would reorder them on every call), bit-identical to F.linear (tests/test_model.py).

Measured on this CPU (AVX-512 with bf16, no AMX, 2 threads), all of the default model's products
of one step (121, weights read from memory as in a step), in one run: oneDNN 16.2 ms for one row,
26.5 for 9, 37.0 for 16, 117.3 for 64; cpu_kernels.linear 11.0, 14.6, 21.8, 66.4. oneDNN's
bfloat16 products use vdpbf16ps, which runs at about half the rate of float32 FMAs here (85
GFLOP/s a core from cache); cpu_kernels widens the weights and uses FMAs (140-150), and prefetches
the weights' stream. A float32 input (a prompt chunk computed in float32, see
ModelRunner) takes a float32 product with the weight widened on the fly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outpace.model import cpu_kernels

_ops = getattr(torch.ops, "mkldnn", None)


def is_available() -> bool:
    return cpu_kernels.has_linear() or _onednn_available()


def _onednn_available() -> bool:
    return (_ops is not None and hasattr(_ops, "_reorder_linear_weight") and hasattr(_ops, "_linear_pointwise")
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernel = cpu_kernels.has_linear() and weight.dtype == torch.bfloat16 and self.in_features % 2 == 0
        # oneDNN's batch-size hint 1: decoding and verification run a handful of rows
        packed = cpu_kernels.pack_weight(weight) if self.kernel else _ops._reorder_linear_weight(weight, 1)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("weight", linear.weight.detach(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype != torch.float32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x, self.weight.float(), bias)
        if self.kernel:
            return cpu_kernels.linear(x, self.packed, self.bias, self.out_features)
        return _ops._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of a CPU model with a PackedLinear (in place)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if _onednn_available() or (cpu_kernels.has_linear() and child.in_features % 2 == 0):
                setattr(model, name, PackedLinear(child))
        else:
            pack_linears(child)
