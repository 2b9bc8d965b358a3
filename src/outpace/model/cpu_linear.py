"""Linear layers with weights pre-packed for oneDNN, for the CPU.

F.linear on the CPU hands bfloat16 (and, through MKL, float32) products to oneDNN, which
reorders the weight into its blocked layout on every call. Packing once at load removes that
reorder; the products are bit-identical to F.linear's (checked in tests/test_model.py).
"""
from __future__ import annotations

import torch
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
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of a CPU model with a PackedLinear (in place)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child))
        else:
            pack_linears(child)
