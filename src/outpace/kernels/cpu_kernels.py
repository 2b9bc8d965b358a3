"""The ops of CPU decode and verify steps as compiled C, one call each.

A CPU decode step of the default model is 4 matrix products and about 150 small ATen ops a layer
(norms, rotation, cache writes, attention, SwiGLU), each a few microseconds of dispatch and
allocation around almost no arithmetic: a third of a float32 step. Here each of those groups is one
C function over raw buffers (cpu_kernels.c): a residual add with the next RMSNorm, SwiGLU's product,
and rotation, cache writes and attention together; and the matrix products over weights packed
once at load (cpu_linear), which stream bfloat16 weights at 2 bytes a weight where PyTorch's
float32 products read 4, and GGUF's quantized blocks (QUANT_FORMATS) as the file holds them
(cpu_products.h), over inputs quantized to int8 per block of 32 once a call, integer dot products:
blocks of 32 inputs (Q8_0, Q4_1, Q4_0, Q5_0) and the k-quants' super-blocks of 256 (Q4_K, Q6_K),
their sub-block scales joined per block of 32 inputs.

The C is compiled per instruction-set level (cpu_isa: portable, avx2, avx2_vnni, avx512,
avx512_bf16; on aarch64 portable, neon) with the system's C compiler into the outpace cache folder
(cpu_build, one compile of a few seconds at first use) and loaded with ctypes; the level is the
highest the CPU has, capped by OUTPACE_CPU_ISA. Attention shares its work among OpenMP threads (PyTorch's own
libgomp, already loaded) from 64 keys summed over its key/value heads (22 tokens of context for
the default model's three). Without a compiler, or with
OUTPACE_CPU_KERNELS=0, steps run PyTorch's ops; the first case says so once on stderr.

Every kernel works row by row, so a token's result does not depend on how many tokens the call
holds (exact mode stays exact). bfloat16 kernels compute in float32 and round after each op where
PyTorch's bfloat16 ops round; results match PyTorch's ops to rounding (tests/test_cpu_kernels.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from outpace.kernels import cpu_build, cpu_isa

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_HEAD_DIM, MAX_GROUP = 256, 64       # cpu_kernels.c's limits
# cpu_products.h's WeightFormat of each packed weight dtype, and of each GGUF block type it computes on
WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1}
QUANT_FORMATS = {"Q8_0": 2, "Q4_1": 3, "Q4_0": 4, "Q5_0": 5, "Q4_K": 6, "Q6_K": 7}
@functools.cache
def _loaded() -> tuple[ctypes.CDLL, str] | None:
    """The compiled kernels at the chosen level and its name, built on first use; None when
    disabled or when the build fails. An OUTPACE_CPU_ISA that names no level raises."""
    if os.environ.get("OUTPACE_CPU_KERNELS", "1") == "0":
        return None
    level = cpu_isa.chosen()
    try:
        lib = library_of()
    except OSError as e:
        print(f"outpace: CPU kernels off ({e}); CPU steps use PyTorch's ops", file=sys.stderr)
        return None
    return lib, level.name


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with its functions' argument and result types set."""
    p, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    for suffix in SUFFIX.values():
        getattr(lib, f"add_rms_norm_{suffix}").argtypes = [p, p, p, p, p, i, i, f]
        getattr(lib, f"silu_mul_{suffix}").argtypes = [p, p, i, i]
        getattr(lib, f"rope_{suffix}").argtypes = [p, i, i, p, p, i, i, p]
        rope_attend = getattr(lib, f"rope_attend_{suffix}")
        rope_attend.argtypes = [p, i, p, i, p, p, p, p, p, i, p, i, i, i, i, i, i, f, p, p, i]
        rope_attend.restype = ctypes.c_int
    lib.argmax_f32.argtypes = [p, i, i, p]
    lib.decoder_stack.argtypes = [p, i, ctypes.c_int, p, p, i, i, i, f, i, i, i, i, i, f, p, p, i, p, p, p, i, p, p, i,
                                  p, i, p]
    lib.decoder_stack.restype = ctypes.c_int
    lib.head_layer.argtypes = [p, ctypes.c_int, p, p, i, i, i, f, i, i, i, i, f, p, p, p, i, p, p]
    lib.head_layer.restype = ctypes.c_int
    lib.head_chain.argtypes = [p, ctypes.c_int, p, i, i, i, i, f, i, i, i, i, f, p, p, p, p, f, p, p]
    lib.head_chain.restype = ctypes.c_int
    lib.linear.argtypes = [p, ctypes.c_int, i, i, p, ctypes.c_int, i, p, p, i]
    lib.linear.restype = ctypes.c_int
    lib.linear_bf16_dot.restype = ctypes.c_int
    lib.pack_blocks.argtypes = [p, i, i, ctypes.c_int, p]
    lib.pack_blocks.restype = ctypes.c_int
    lib.dequantize_rows.argtypes = [p, i, ctypes.c_int, p, i, ctypes.c_int, p]
    lib.dequantize_rows.restype = ctypes.c_int
    lib.quantize_q4_0.argtypes = [p, i, i, p]
    lib.quantize_q4_0.restype = ctypes.c_int
    return lib


_swapped: ctypes.CDLL | None = None       # using's library while it is active


def _library() -> ctypes.CDLL | None:
    if _swapped is not None:
        return _swapped
    loaded = _loaded()
    return None if loaded is None else loaded[0]


def library_of(source: Path = cpu_build.SOURCE, level: cpu_isa.Level | None = None) -> ctypes.CDLL:
    """The kernels of a cpu_kernels.c (by default this checkout's; another checkout's with the
    headers beside it) built at `level` (by default this machine's), for `using`."""
    return _declared(ctypes.CDLL(str(cpu_build.build(level or cpu_isa.chosen(), source))))


@contextlib.contextmanager
def using(lib: ctypes.CDLL):
    """Within: every kernel call goes to lib (library_of), packed weights staying as they are, so
    its checkout must share this one's packed formats and structure layouts.
    benchmarks/kernels_ab.py times two checkouts' kernels this way, call by call in one process."""
    global _swapped
    previous, _swapped = _swapped, lib
    try:
        yield
    finally:
        _swapped = previous


def reload() -> None:
    """Forget the loaded kernels: the next call loads them again at the level chosen then (after
    OUTPACE_CPU_ISA or OUTPACE_CPU_KERNELS changed)."""
    _loaded.cache_clear()


def level() -> str | None:
    """The instruction-set level the kernels run at here; None when they are off."""
    loaded = _loaded()
    return None if loaded is None else loaded[1]


def build_key() -> str:
    """Names the kernels' build and this machine; timings taken with the kernels depend on both."""
    built = cpu_build.library_path(cpu_isa.chosen(), cpu_build.compiler() or "")
    return hashlib.sha256(f"{built.name} {cpu_isa.cpu_description()}".encode()).hexdigest()[:16]


def attention_fits(cfg, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether rope_attend serves a model of this config with caches in this dtype."""
    group = cfg.num_heads // cfg.num_kv_heads
    return (device.type == "cpu" and dtype in SUFFIX and cfg.head_dim <= MAX_HEAD_DIM and cfg.head_dim % 2 == 0
            and group * cfg.num_kv_heads == cfg.num_heads and group <= MAX_GROUP and has_library())


def pointwise_fits(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the norm and SwiGLU kernels run a forward whose activations have this dtype."""
    return device.type == "cpu" and dtype in SUFFIX and has_library()


def has_library() -> bool:
    """Whether the kernels are built and on here."""
    return _library() is not None


def has_bf16_dot() -> bool:
    """Whether linear's bfloat16 products run on vdpbf16ps here (the avx512_bf16 level)."""
    lib = _library()
    return lib is not None and lib.linear_bf16_dot() == 1


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 or float32 weight [N, K] (K even) laid out for linear, in the format
    WEIGHT_FORMATS[weight.dtype] names: blocks of 16 output columns (the last padded with zeros),
    each [K / 2, 16, 2] (bfloat16) or [K, 16] (float32). The same layout at every level."""
    N, K = weight.shape
    padded = weight.new_zeros((N + 15) // 16 * 16, K)
    padded[:N] = weight
    if weight.dtype == torch.float32:
        return padded.view(-1, 16, K).transpose(1, 2).contiguous()
    return padded.view(-1, 16, K // 2, 2).transpose(1, 2).contiguous()


def unserved(qtypes: list[str], in_features: int) -> str | None:
    """Why matrices of these GGUF types with this many inputs a row cannot be computed on as
    blocks here (None: they can, as products and as an embedding's rows)."""
    lacking = sorted(set(qtypes) - set(QUANT_FORMATS))
    if lacking:
        return f"no CPU kernels for {', '.join(lacking)} (kernels: {', '.join(sorted(QUANT_FORMATS))})"
    inputs = {t: GGML_QUANT_SIZES[GGMLQuantizationType[t]][0] for t in qtypes}      # a block's
    partial = sorted(t for t in inputs if in_features % inputs[t])
    if partial:
        return (f"{in_features} inputs are not whole blocks of {', '.join(partial)} "
                f"({', '.join(str(inputs[t]) for t in partial)} inputs a block)")
    return None


def pack_quantized(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """A GGUF weight's raw blocks [N, K / block inputs * block bytes] uint8 (rows of type `qtype`, a
    key of QUANT_FORMATS; blocks of 32 inputs, 256 for the k-quants) regrouped for linear: blocks
    of 16 output columns (the last padded with zero blocks), each K / block inputs groups of
    cpu_products.h's layout (cpu_pack.h moves the bits, never converting them, so the packed weight
    is the file's size). The same layout at every level."""
    blocks = blocks.contiguous()
    N, row_bytes = blocks.shape
    size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]         # a block's bytes
    # [N / 16, K / block inputs, a group: the 16 columns' blocks of those inputs, as many bytes]
    out = torch.empty((N + 15) // 16, row_bytes // size, 16 * size, dtype=torch.uint8)
    if _library().pack_blocks(blocks.data_ptr(), N, row_bytes, QUANT_FORMATS[qtype], out.data_ptr()):
        raise ValueError(f"{qtype} blocks of {row_bytes} bytes a row are not whole blocks")
    return out


def dequantize_rows(blocks: torch.Tensor, qtype: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids (int64, any shape) of a GGUF matrix's blocks (uint8 [rows, bytes a row], a key of
    QUANT_FORMATS) as float32 or bfloat16 [*ids.shape, K]: gguf.quants.dequantize's values bit
    for bit (cpu_dequant.h), bfloat16 rounded once from them."""
    rows, row_bytes = blocks.shape
    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    flat = ids.reshape(-1).contiguous()
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < rows:
        raise IndexError(f"token ids must be in [0, {rows}), got {int(flat.min())}..{int(flat.max())}")
    out = torch.empty(*ids.shape, row_bytes // size * weights, dtype=dtype)
    if _library().dequantize_rows(blocks.data_ptr(), row_bytes, QUANT_FORMATS[qtype], flat.data_ptr(), flat.numel(),
                                  dtype == torch.bfloat16, out.data_ptr()):
        raise ValueError(f"{qtype} blocks of {row_bytes} bytes a row are not whole blocks")
    return out


def quantize_q4_0(weight: torch.Tensor) -> torch.Tensor:
    """A float32 matrix [N, K] (K a multiple of 32) as GGUF's Q4_0 blocks [N, K / 32 * 18] uint8,
    the bytes gguf-py's quantizer writes (cpu_dequant.h)."""
    weight = weight.float().contiguous()
    N, K = weight.shape
    out = torch.empty(N, K // 32 * 18, dtype=torch.uint8)
    if _library().quantize_q4_0(weight.data_ptr(), N, K, out.data_ptr()):
        raise ValueError(f"Q4_0 takes whole blocks of 32 inputs, got {K}")
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, fmt: int, bias: torch.Tensor | None,
           out_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T + bias, the weight as pack_weight (pack_quantized) laid it out in format fmt, bias
    float32; x and the result float32 or bfloat16. out: where to write it, x's shape but [..., out_features],
    its last dimension contiguous and the others one stride apart (a column slice of a wider result)."""
    K = x.shape[-1]
    x = x.contiguous()
    if out is None:
        out = x.new_empty(*x.shape[:-1], out_features)
    failed = _library().linear(x.data_ptr(), x.dtype == torch.float32, x.numel() // K, K, packed.data_ptr(), fmt,
                               out_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                               out.stride(-2) if out.dim() > 1 else out_features)
    if failed:
        raise MemoryError("out of memory for a product's input") if failed == -1 else ValueError(
            f"CPU product kernel: unknown weight format {fmt}, or inputs of {K} it cannot take")
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] float32 -> [N] int64: torch.argmax(x, -1), ties and NaNs alike."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _library().argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta) * weight), or (h, rms_norm(h) * weight) when delta is None."""
    h_out = h if delta is None else torch.empty_like(h)
    x = torch.empty_like(h)
    dim = h.shape[-1]
    getattr(_library(), f"add_rms_norm_{SUFFIX[h.dtype]}")(
        h.data_ptr(), None if delta is None else delta.contiguous().data_ptr(), weight.data_ptr(),
        h_out.data_ptr(), x.data_ptr(), h.numel() // dim, dim, eps)
    return h_out, x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    getattr(_library(), f"silu_mul_{SUFFIX[gate_up.dtype]}")(gate_up.data_ptr(), out.data_ptr(),
                                                             gate_up.numel() // (2 * inter), inter)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] rotated as fused.rope rotates it, bit for bit; cos, sin: each token's row
    [..., 1, D] in x's dtype. x's heads may be a slice of wider rows (qkv's query and key heads).
    Returns a contiguous [..., heads, D]."""
    *lead, heads, D = x.shape
    rows = x.reshape(-1, heads, D)
    if rows.stride(2) != 1 or rows.stride(1) != D:
        rows = rows.contiguous()
    out = x.new_empty(x.shape)
    getattr(_library(), f"rope_{SUFFIX[x.dtype]}")(rows.data_ptr(), rows.stride(0), heads, cos.contiguous().data_ptr(),
                                                  sin.contiguous().data_ptr(), rows.shape[0], D, out.data_ptr())
    return out


def rope_attend(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, window: int | None,
                qk: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Rotation, cache writes and attention of T tokens in one call.

    qkv [..., (NH + 2 KVH) * D], contiguous, T rows of query, key and value heads; qk: the query
    and key heads [..., (NH + KVH) * D] to use instead of qkv's (normed ones), contiguous. cos,
    sin: each token's row of rope_tables' cos and signed sin in qkv's dtype [..., D]; caches
    [slots, KVH, L, D]; slots [T] or [B] (then T = B * S, rows of S tokens), positions: [T] or
    [B, S] int64. Each token attends to its slot's keys at positions <= its own (within the
    window); with tree (tree_keys' table [T, ...]), a token tree's node attends to its path's.
    Returns [T, NH * D]."""
    KVH, L, D = k_cache.shape[1:]
    width = (num_heads + 2 * KVH) * D
    T = qkv.numel() // width
    out = qkv.new_empty(T, num_heads * D)
    slots, positions = slots.contiguous(), positions.contiguous()
    v = qkv.data_ptr() + (num_heads + KVH) * D * qkv.element_size()
    failed = getattr(_library(), f"rope_attend_{SUFFIX[qkv.dtype]}")(
        qkv.data_ptr() if qk is None else qk.data_ptr(), width if qk is None else width - KVH * D, v, width,
        cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        T // slots.numel(), positions.data_ptr(), T, num_heads, KVH, D, L, window or 0, D ** -0.5, out.data_ptr(),
        *_tree_args(tree))
    if failed:
        raise MemoryError("out of memory for attention scores") if failed == -1 else ValueError(
            f"CPU attention kernel: unsupported heads ({num_heads} query, {KVH} key/value) or head size {D}")
    return out


def tree_keys(starts: list[int], parents: list[list[int]]) -> torch.Tensor:
    """rope_attend's table for token-tree rows: row i is its last token, at position starts[i],
    then its nodes, node j (parent parents[i][j], an earlier node or -1 for the last token) written
    at position starts[i] + 1 + j. Returns [T, 2 + most nodes on a path] int64, one row a token of
    every row in order (T = rows' tokens): [extent, from, cache positions of positions from..]:
    the token attends as a chain token at position extent (its row's start plus its depth) whose
    positions past the start are its ancestors' and its own entries. Rows of one token are plain
    decode rows (extent their position)."""
    paths = []
    for start, nodes in zip(starts, parents):
        row = [[start]]                             # each token's entries along its path
        for j, parent in enumerate(nodes):
            row.append(row[parent + 1] + [start + 1 + j])
        paths += [(start + len(path) - 1, start, path) for path in row]
    width = 2 + max(len(path) for _, _, path in paths)
    table = torch.zeros(len(paths), width, dtype=torch.int64)
    for t, (extent, first, path) in enumerate(paths):
        table[t, :2 + len(path)] = torch.tensor([extent, first, *path])
    return table


def _tree_args(tree: torch.Tensor | None) -> tuple:
    """rope_attend's and decoder_stack's last two arguments for a tree table (or none)."""
    return (None, 0) if tree is None else (tree.data_ptr(), tree.stride(0))


MAX_PARTS = 3       # cpu_kernels.c's Product: runs of columns a product may have


class _Product(ctypes.Structure):
    _fields_ = [("parts", ctypes.c_long), ("weight", ctypes.c_void_p * MAX_PARTS), ("format", ctypes.c_long * MAX_PARTS),
                ("columns", ctypes.c_long * MAX_PARTS), ("bias", ctypes.c_void_p * MAX_PARTS)]


class _StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Product), ("o", _Product),
                ("gate_up", _Product), ("down", _Product)]


def _set_product(product: _Product, runs: list[tuple], tensors: list) -> None:
    """product's runs of columns (cpu_linear.kernel_parts' list); their tensors join `tensors`,
    which the caller keeps: the structure points into them."""
    product.parts = len(runs)
    for k, (weight, fmt, columns, bias) in enumerate(runs):
        product.weight[k], product.format[k], product.columns[k] = weight.data_ptr(), fmt, columns
        product.bias[k] = None if bias is None else bias.data_ptr()
        tensors += [weight, bias]


def _set_layer(entry: _StackLayer, layer: tuple, tensors: list) -> None:
    """entry from (input norm weight, post norm weight, qkv, o, gate_up, down), as DecoderStack
    takes a layer."""
    input_norm, post_norm, *products = layer
    tensors += [input_norm, post_norm]
    entry.input_norm, entry.post_norm = input_norm.data_ptr(), post_norm.data_ptr()
    for name, runs in zip(("qkv", "o", "gate_up", "down"), products):
        _set_product(getattr(entry, name), runs, tensors)


class DecoderStack:
    """A decoder's layers as one call of cpu_kernels.c's decoder_stack: every layer's norms,
    products, attention and SwiGLU, the same kernels in the same order as the layers' own forwards
    (so the same bits), without a return to Python between them.

    layers: per layer (input norm weight, post norm weight, qkv, o, gate_up, down), the norms in
    the activations' dtype, each product as cpu_linear.kernel_parts lists it. The tensors are kept
    here: the C structures point into them."""

    def __init__(self, layers: list[tuple], eps: float, num_heads: int, intermediate: int):
        self.tensors = []
        self.array = (_StackLayer * len(layers))()
        for entry, layer in zip(self.array, layers):
            _set_layer(entry, layer, self.tensors)
        self.eps, self.num_heads, self.intermediate = eps, num_heads, intermediate

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, window: int | None,
                 keep: list[int], tree: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """h [T, H] the embedded tokens in the caches' dtype; cos, sin, slots, positions, tree as
        rope_attend takes them; caches [layers, slots, KVH, L, D]; keep: the layers whose output
        stream to return. Returns (h, delta) after the last layer (the stream is h + delta) and
        the kept layers' streams [T, len(keep), H] (None when keep is empty)."""
        T, hidden = h.shape
        KVH, L, D = k_cache.shape[2:]
        h = h.clone()
        delta = torch.empty_like(h)
        at = torch.full((len(self.array),), -1, dtype=torch.int64)
        for n, i in enumerate(keep):
            at[i] = n
        kept = h.new_empty(T, len(keep), hidden) if keep else None
        slots, positions = slots.contiguous(), positions.contiguous()
        failed = _library().decoder_stack(
            self.array, len(self.array), h.dtype == torch.float32, h.data_ptr(), delta.data_ptr(), T, hidden,
            self.intermediate, self.eps, self.num_heads, KVH, D, L, window or 0, D ** -0.5, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.stride(0), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
            slots.data_ptr(), T // slots.numel(), positions.data_ptr(), *_tree_args(tree), at.data_ptr(), len(keep),
            None if kept is None else kept.data_ptr())
        _raise_failed(failed, "decoder step")
        return h, delta, kept


def _raise_failed(failed: int, what: str) -> None:
    """decoder_stack's, head_layer's and head_chain's failures as exceptions."""
    if failed:
        raise MemoryError(f"out of memory in a CPU {what}") if failed == -1 else ValueError(
            f"CPU {what} kernel: a product or attention it cannot take")


class _PairHead(ctypes.Structure):
    _fields_ = [("layer", _StackLayer), ("feature_norm", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("lm_head", _Product), ("draft_vocab", ctypes.c_long), ("d2t", ctypes.c_void_p),
                ("embed", ctypes.c_void_p), ("embed_format", ctypes.c_long), ("embed_row_bytes", ctypes.c_long),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


class PairHead:
    """An EAGLE-3 head as cpu_kernels.c's head_layer and head_chain take it: a forward of its
    layer, or a row's whole greedy chain, in one call each, the ops of the head drafter's Python
    path over these kernels in the same order (the same bits), where that path paid interpreter
    and PyTorch work about as long as the kernels' own.

    layer: (embedding norm, post norm, qkv, o, gate_up, down) as DecoderStack takes a layer, qkv
    reading [norm(embedding), norm(feature)]; feature_norm, final_norm: norm weights in the
    activations' dtype; lm_head: kernel_parts' runs over draft_vocab rows; d2t [draft_vocab]
    int64; embed: (dense rows in the activations' dtype, None) or (a GGUF matrix's blocks, its
    type); cos, sin: rotary tables [positions, D] in the activations' dtype."""

    def __init__(self, layer: tuple, feature_norm: torch.Tensor, final_norm: torch.Tensor, lm_head: list[tuple],
                 d2t: torch.Tensor, embed: tuple[torch.Tensor, str | None], cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, num_heads: int, intermediate: int):
        self.tensors = [feature_norm, final_norm, d2t, cos, sin, embed[0]]
        self.head = head = _PairHead()
        _set_layer(head.layer, layer, self.tensors)
        _set_product(head.lm_head, lm_head, self.tensors)
        head.feature_norm, head.final_norm = feature_norm.data_ptr(), final_norm.data_ptr()
        head.draft_vocab, head.d2t = d2t.numel(), d2t.data_ptr()
        table, qtype = embed
        head.embed = table.data_ptr()
        head.embed_format = -1 if qtype is None else QUANT_FORMATS[qtype]
        head.embed_row_bytes = 0 if qtype is None else table.shape[1]
        head.cos, head.sin = cos.data_ptr(), sin.data_ptr()
        self.dtype, self.eps, self.num_heads, self.intermediate = cos.dtype, eps, num_heads, intermediate
        self.positions = cos.shape[0]

    def _check_positions(self, last: int) -> None:
        if last >= self.positions:
            raise IndexError(f"head position {last} is past its rotary tables' {self.positions}")

    def layer(self, feature: torch.Tensor, ids: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer over pairs (feature [..., H], the target's ids [...]) at positions (rows of
        one slot each: slots [B], positions [B, S]; or slots and positions [T]), each attending to
        its slot's entries up to its own position, writing its own: the outputs [..., H]."""
        feature, ids = feature.contiguous(), ids.contiguous()
        slots, positions = slots.contiguous(), positions.contiguous()
        self._check_positions(int(positions.max()))
        H = feature.shape[-1]
        T = ids.numel()
        KVH, L, D = k_cache.shape[1:]
        out = torch.empty_like(feature)
        failed = _library().head_layer(
            ctypes.byref(self.head), self.dtype == torch.float32, feature.data_ptr(), ids.data_ptr(), T, H,
            self.intermediate, self.eps, self.num_heads, KVH, D, L, D ** -0.5, k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), T // slots.numel(), positions.data_ptr(), out.data_ptr())
        _raise_failed(failed, "head step")
        return out

    def chain(self, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              starts: torch.Tensor, depth: int, p_min: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy chains [R, depth] (the target's ids) of R rows in slots [R] whose last tokens sit
        at starts [R], from their stored outputs out [R, H]: draft d (from 1) is fed at position
        start + d - 1, writing the head's entry there. Also each row's length [R]: its drafts
        before the first whose probability is below p_min (depth where none is; a chain's entries
        past every row's length are left unwritten)."""
        out = out.clone(memory_format=torch.contiguous_format)
        slots, starts = slots.contiguous(), starts.contiguous()
        self._check_positions(int(starts.max()) + depth - 2)
        R, H = out.shape
        KVH, L, D = k_cache.shape[1:]
        chain = torch.zeros(R, depth, dtype=torch.int64)
        lengths = torch.empty(R, dtype=torch.int64)
        failed = _library().head_chain(
            ctypes.byref(self.head), self.dtype == torch.float32, out.data_ptr(), R, depth, H, self.intermediate,
            self.eps, self.num_heads, KVH, D, L, D ** -0.5, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            starts.data_ptr(), p_min, chain.data_ptr(), lengths.data_ptr())
        _raise_failed(failed, "head step")
        return chain, lengths
