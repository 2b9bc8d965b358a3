"""Linear layers with weights pre-packed for oneDNN, for the CPU.

F.linear on the CPU hands bfloat16 (and, through MKL, float32) products to oneDNN, which
reorders the weight into its blocked layout on every call. Packing once at load removes that
reorder; the products are bit-identical to F.linear's (checked in tests/test_model.py).

oneDNN's bfloat16 products on this CPU (AVX-512 bf16, no AMX) reach about 160 GFLOP/s at any row
count, float32 ones about 250 from 128 rows up. A float32 input (a prompt chunk computed in float32,
see ModelRunner) therefore takes a float32 product with the weight widened on the fly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ops = getattr(torch.ops, "mkldnn", None)


def is_available() -> bool:
    return (_ops is not None and hasattr(_ops, "_reorder_linear_weight") and hasattr(_ops, "_linear_pointwise")
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # batch-size hint 1: decoding and verification run a handful of rows
        self.register_buffer("packed", _ops._reorder_linear_weight(linear.weight.detach(), 1), persistent=False)
        self.register_buffer("weight", linear.weight.detach(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype != torch.float32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x, self.weight.float(), bias)
        return _ops._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of a CPU model with a PackedLinear (in place)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child))
        else:
            pack_linears(child)
