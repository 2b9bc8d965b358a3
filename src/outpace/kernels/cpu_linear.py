"""Linear layers of a CPU model with weights packed once at load.

Where cpu_kernels builds (AVX-512), products run as cpu_kernels.linear over weights in its own
layout, bfloat16 or float32, with bfloat16 or float32 inputs (a bfloat16 model's prompt chunks
compute in float32, see ModelRunner). Otherwise a bfloat16 model's products run in oneDNN over
weights reordered once into its blocked layout (F.linear would reorder them on every call),
bit-identical to F.linear (tests/test_model.py), and a float32 model keeps nn.Linear (MKL).

Measured on this CPU (AVX-512 with bf16, no AMX, 2 threads), all of the default model's products
of one step (121, weights read from memory as in a step), in one run each: bfloat16, oneDNN 16.2
ms for one row, 26.5 for 9, 37.0 for 16, 117.3 for 64, cpu_kernels.linear 11.0, 14.6, 21.8, 66.4;
float32, MKL 20.4 ms for one row, 38.7 for 4, 53.0 for 9, cpu_kernels.linear 18.8, 22.0, 22.6.
oneDNN's bfloat16 products use vdpbf16ps, which runs at about half the rate of float32 FMAs here
(85 GFLOP/s a core from cache); cpu_kernels widens the weights and uses FMAs (140-150), and
prefetches the weights' stream. MKL's float32 products of a few rows take other paths than one
row's, at twice its cost and more; cpu_kernels' cost follows the weights' bytes until the FMAs
take longer. Where the CPU has AVX512_BF16, cpu_kernels' bfloat16 products use vdpbf16ps as well
(on a later session's AMD EPYC it ran at the FMAs' rate: 12.1 ms for the 9-row step's products
against 16.6 with FMAs, oneDNN 15.6; numbers in cpu_kernels.c).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outpace.kernels import cpu_kernels

_ops = getattr(torch.ops, "mkldnn", None)


def _onednn_available() -> bool:
    return (_ops is not None and hasattr(_ops, "_reorder_linear_weight") and hasattr(_ops, "_linear_pointwise")
            and torch.backends.mkldnn.is_available())


def _kernel_serves(linear: nn.Linear) -> bool:
    return (cpu_kernels.has_linear() and linear.weight.dtype in (torch.bfloat16, torch.float32)
            and linear.in_features % 2 == 0)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernel = _kernel_serves(linear)
        if self.kernel:         # the packed copy alone: float32 inputs read the same weights
            self.register_buffer("packed", cpu_kernels.pack_weight(weight), persistent=False)
        else:                   # oneDNN's batch-size hint 1: decoding and verification run a handful of rows
            self.register_buffer("packed", _ops._reorder_linear_weight(weight, 1), persistent=False)
            self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_kernels.linear(x, self.packed, self.bias, self.out_features)
        if x.dtype == torch.float32:            # a prompt chunk computed in float32: the weight widened
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x, self.weight.float(), bias)
        return _ops._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of a CPU model with a PackedLinear where cpu_kernels.linear serves
    it, or, with bfloat16 weights, oneDNN does (in place)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if _kernel_serves(child) or (child.weight.dtype == torch.bfloat16 and _onednn_available()):
                setattr(model, name, PackedLinear(child))
        else:
            pack_linears(child)
