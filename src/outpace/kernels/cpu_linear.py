"""Linear layers of a CPU model with weights packed once at load, and the dtype CPU models prefer.

Where the CPU kernels load (any CPU with a C compiler: every instruction-set level has them),
products run as cpu_kernels.linear over weights in its own layout, bfloat16 or float32, with
bfloat16 or float32 inputs (a bfloat16 model's long prompt chunks compute in float32 where the
products have no bfloat16 dot instruction, see ModelRunner): bfloat16 weights are widened to
float32 in registers, so they stream at 2 bytes a weight on every CPU. A row's sums take one
order whatever the rows beside it, so float32 products too are row-independent here, unlike MKL's.

Without the kernels (no compiler, or OUTPACE_CPU_KERNELS=0) a float32 model keeps nn.Linear
(MKL), and a bfloat16 one runs in oneDNN over weights reordered once into its blocked layout
(F.linear would reorder them on every call), bit-identical to F.linear, where oneDNN's bfloat16
path runs on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere a bfloat16 model is
refused with an error that says what to do.
"""
from __future__ import annotations

import functools
import os
from itertools import groupby

import torch
import torch.nn.functional as F
from torch import nn

from outpace.errors import InvalidParameterError
from outpace.kernels import cpu_kernels

_ops = getattr(torch.ops, "mkldnn", None)

# instruction-set levels at which `auto` picks bfloat16 for a CPU model: a decode step reads half
# the bytes of float32 weights and the kernels widen them in registers, so bfloat16 decodes faster
# wherever the products are vectorised (docs/DESIGN.md, "CPU steps")
BF16_LEVELS = frozenset({"avx2", "avx2_vnni", "avx512", "avx512_bf16", "neon"})


@functools.cache
def _onednn_bf16_works() -> bool:
    """Whether oneDNN's bfloat16 products run on this CPU (its reorder raises where they do not)."""
    if _ops is None or not hasattr(_ops, "_reorder_linear_weight") or not torch.backends.mkldnn.is_available():
        return False
    try:
        _ops._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def prefers_bfloat16() -> bool:
    """Whether `auto` chooses bfloat16 over float32 for a CPU model here: where the kernels'
    level vectorises bfloat16 products, or, without the kernels, where oneDNN's bfloat16 runs."""
    level = cpu_kernels.level()
    return level in BF16_LEVELS if level is not None else _onednn_bf16_works()


def _kernel_serves(linear: nn.Linear) -> bool:
    return (cpu_kernels.has_library() and linear.weight.dtype in cpu_kernels.WEIGHT_FORMATS
            and linear.in_features % 2 == 0)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernel = _kernel_serves(linear)
        bias = None if linear.bias is None else linear.bias.detach()
        if self.kernel:         # the packed copy alone: float32 inputs read the same weights
            self.format = cpu_kernels.WEIGHT_FORMATS[weight.dtype]
            self.register_buffer("packed", cpu_kernels.pack_weight(weight), persistent=False)
            bias = None if bias is None else bias.float()
        else:                   # oneDNN's batch-size hint 1: decoding and verification run a handful of rows
            self.register_buffer("packed", _ops._reorder_linear_weight(weight, 1), persistent=False)
            self.register_buffer("weight", weight, persistent=False)
            bias = None if bias is None else bias.clone()
        self.register_buffer("bias", bias, persistent=False)

    def runs(self) -> list[tuple[torch.Tensor, int, int, torch.Tensor | None]]:
        """The kernels' packed weight as kernel_parts lists it (self.kernel only)."""
        return [(self.packed, self.format, self.out_features, self.bias)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_kernels.linear(x, self.packed, self.format, self.bias, self.out_features)
        if x.dtype == torch.float32:            # a prompt chunk computed in float32: the weight widened
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x, self.weight.float(), bias)
        return _ops._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def first_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """self(x)[..., :n], those outputs alone (pack_weight keeps output columns in order)."""
        bias = None if self.bias is None else self.bias[:n]
        if self.kernel:
            return cpu_kernels.linear(x, self.packed, self.format, bias, n)
        return F.linear(x, self.weight[:n].to(x.dtype), None if bias is None else bias.to(x.dtype))


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of a CPU model with a PackedLinear where cpu_kernels.linear serves
    it, or, with bfloat16 weights, oneDNN does (in place); others stay nn.Linear. bfloat16 weights
    without the kernels or oneDNN are an InvalidParameterError that says what to do."""
    for name, child in list(model.named_children()):
        if not isinstance(child, nn.Linear):
            pack_linears(child)
        elif _kernel_serves(child) or (child.weight.dtype == torch.bfloat16 and _onednn_bf16_works()):
            setattr(model, name, PackedLinear(child))
        elif child.weight.dtype == torch.bfloat16 and not cpu_kernels.has_library():
            why = ("OUTPACE_CPU_KERNELS=0 turned them off: unset it" if os.environ.get("OUTPACE_CPU_KERNELS") == "0"
                   else "they need a C compiler: install gcc, or set CC to one")
            raise InvalidParameterError(f"bfloat16 on this CPU needs outpace's CPU kernels (PyTorch's bfloat16 "
                                        f"products need AVX-512 BW/VL/DQ or AVX-NE-CONVERT), and {why}; "
                                        f"or use --dtype float32")


def quantize_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of a CPU module whose inputs are whole blocks of 32 with a
    QuantizedLinear over its weight quantized to Q4_0 (cpu_kernels.quantize_q4_0), in place; others
    are packed as pack_linears packs them. For a drafter beside a quantized target (a head): a
    quarter of bfloat16's bytes to stream a draft, at Q4_0's rounding, which changes drafts only."""
    if cpu_kernels.has_library():
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
                    layer = QuantizedLinear(cpu_kernels.quantize_q4_0(child.weight.detach()), "Q4_0",
                                            child.in_features, child.out_features, child.bias is not None)
                    if child.bias is not None:
                        layer.bias.data.copy_(child.bias.detach().float())
                    setattr(module, child_name, layer)
    pack_linears(model)


class QuantizedLinear(nn.Module):
    """A linear layer over a GGUF weight's blocks, kept in the file's type (cpu_kernels.QUANT_FORMATS)
    and bytes: x [..., K] float32 or bfloat16 -> [..., N] in x's dtype. The bias, where the layer
    has one, is a parameter the loader fills like any other."""

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.format = cpu_kernels.QUANT_FORMATS[qtype]
        self.register_buffer("packed", cpu_kernels.pack_quantized(blocks, qtype), persistent=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first_rows(x, self.out_features)

    def runs(self) -> list[tuple[torch.Tensor, int, int, torch.Tensor | None]]:
        """Its packed blocks as kernel_parts lists them."""
        return [(self.packed, self.format, self.out_features, None if self.bias is None else self.bias.detach().float())]

    def first_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """self(x)[..., :n], those outputs alone (pack_quantized keeps output columns in order)."""
        bias = None if self.bias is None else self.bias[:n].float()
        return cpu_kernels.linear(x, self.packed, self.format, bias, n)


class QuantizedEmbedding(nn.Module):
    """An embedding over a GGUF matrix's blocks, kept in the file's type and bytes: ids -> their
    rows [..., H] dequantized in C (cpu_kernels.dequantize_rows), the float32 copy's rows bit for
    bit, in the model's dtype (the float embedding it replaces would have been cast to it; an
    empty float buffer follows Module.to's dtype for it)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, embedding_dim: int):
        super().__init__()
        self.qtype, self.num_embeddings, self.embedding_dim = qtype, blocks.shape[0], embedding_dim
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("like", torch.empty(0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.dequantize_rows(self.blocks, self.qtype, ids, self.like.dtype)


class QuantizedParts(nn.Module):
    """A fused layer (qkv, gate_up) whose parts are GGUF weights of different types (cpu_kernels.
    QUANT_FORMATS): one QuantizedLinear a run of parts of one type, over its rows in order, each
    writing its columns of the result; x [..., K] -> [..., N]. The bias, a parameter the loader
    fills like any other, goes into each run's product as its rows' slice, so each row computes as
    a QuantizedLinear of its type does."""

    def __init__(self, parts: list[tuple[torch.Tensor, str]], in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        runs = [(torch.cat([blocks for blocks, _ in run]), qtype) for qtype, run in groupby(parts, key=lambda p: p[1])]
        self.parts = nn.ModuleList(QuantizedLinear(blocks, qtype, in_features, blocks.shape[0], False)
                                   for blocks, qtype in runs)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def runs(self) -> list[tuple[torch.Tensor, int, int, torch.Tensor | None]]:
        """Its parts as kernel_parts lists them: each part's packed blocks and its rows of the bias."""
        bias = None if self.bias is None else self.bias.detach().float()
        runs, start = [], 0
        for part in self.parts:
            rows = part.out_features
            runs.append((part.packed, part.format, rows, None if bias is None else bias[start:start + rows]))
            start += rows
        return runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, start = x.new_empty(*x.shape[:-1], self.out_features), 0
        for packed, fmt, rows, bias in self.runs():
            cpu_kernels.linear(x, packed, fmt, bias, rows, out[..., start:start + rows])
            start += rows
        return out


def kernel_parts(layer: nn.Module) -> list[tuple[torch.Tensor, int, int, torch.Tensor | None]] | None:
    """How cpu_kernels.linear computes a layer: its output columns in order as runs of (packed
    weight, format, columns, float32 bias or None), one run a part of a QuantizedParts; None where
    the layer is not computed by the kernels."""
    if isinstance(layer, (QuantizedParts, QuantizedLinear)) or isinstance(layer, PackedLinear) and layer.kernel:
        return layer.runs()
    return None
