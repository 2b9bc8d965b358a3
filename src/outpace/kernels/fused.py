"""The step's small elementwise ops, one kernel each inside CUDA graphs.

At batch 1 a decode step on a GPU is a few large matrix products and, between them, about twenty
small elementwise kernels per layer whose launch and tail cost rivals the products on a small
model. While CUDA graphs are captured (`for_graphs()`), each function here runs as one kernel
compiled once (torch.compile, Triton, shapes dynamic) and is captured like any other. Elsewhere
(the CPU, eager CUDA steps, prompt chunks) the same math runs as plain torch ops: compiling on the
CPU took minutes and ran slower, and an eager step pays each compiled call's guard checks on the
host, which is what bounds it. Graphs of a half dtype also take two hand-written Triton kernels
(triton_ops): products of a single row (`linear`) and attention of decode and verify steps
(`decode_attention`). Each computes what the reference implementation computes: RMSNorm
normalises in float32, rounds to the model dtype, then scales. The compiled kernels may round
intermediate values differently from the plain ops (greedy outputs of graphs and eager steps can
part at near-ties).
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn


# Shapes are dynamic, but a size of 1 (batch 1, one token) and each dtype or strides compile
# their own kernel: a few per function, each once per process, all before graph capture ends.
RECOMPILE_LIMIT = 64


_capturing = False


@contextlib.contextmanager
def for_graphs():
    """Within: CUDA tensors go through the compiled kernels (warm-up and capture of graphs)."""
    global _capturing
    previous, _capturing = _capturing, True
    try:
        yield
    finally:
        _capturing = previous


@contextlib.contextmanager
def only_if(predicate):
    """Within: work that a CUDA graph being captured runs only where predicate() (a scalar bool
    CUDA tensor the graph computes) holds at replay, as a conditional node, where
    has_conditional_nodes() found them working on this device before the capture began. Elsewhere
    (warm-up, eager steps, the CPU, builds without them) the work always runs, so it must be
    harmless where it is not needed. predicate None: always runs."""
    graph = _capturing_graph() if predicate is not None else None
    if graph is None:
        yield
        return
    graph.begin_capture_to_if_node(predicate())
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


_conditional_nodes: dict[int, bool] = {}       # CUDA device index -> whether its probe passed


def has_conditional_nodes(device: torch.device | str | None = None) -> bool:
    """Whether graphs captured on `device` (default: the current CUDA device) can hold
    conditional nodes: CUDA 12.4 and a PyTorch whose CUDAGraph exposes them (torch 2.13 does, 2.11
    not), checked once per device by capturing a product and an add in one and replaying it with
    the predicate false and true. Call it before a capture begins: a probe cannot run inside one."""
    if not (torch.cuda.is_available() and hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph")
            and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")):
        return False
    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index
    if index not in _conditional_nodes:
        _conditional_nodes[index] = _probe_conditional_nodes(torch.device("cuda", index))
    return _conditional_nodes[index]


def _probe_conditional_nodes(device: torch.device) -> bool:
    try:
        x = torch.ones(8, 8, device=device)
        out = x @ x                                     # the product's library loaded outside the capture
        taken = torch.zeros((), dtype=torch.bool, device=device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            capturing = torch.cuda.CUDAGraph.get_currently_capturing_graph()
            capturing.begin_capture_to_if_node(taken)
            out.copy_(x @ x + 1)
            capturing.end_capture_to_conditional_node()
        results = []
        for value in (False, True):
            out.zero_()
            taken.fill_(value)
            graph.replay()
            results.append(float(out.sum()))
        torch.cuda.synchronize(device)
        return results == [0.0, 9.0 * 64]
    except RuntimeError:            # a driver, build or capture that refuses them: graphs do without
        return False


def _capturing_graph():
    """The CUDA graph the current stream captures where conditional nodes were found to work on
    this device (has_conditional_nodes, called before the capture), else None."""
    if not (_capturing and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None
    if not _conditional_nodes.get(torch.cuda.current_device()):
        return None
    return torch.cuda.CUDAGraph.get_currently_capturing_graph()


def cuda_compiled(eager):
    """Plain torch ops, or one compiled kernel for CUDA tensors within for_graphs()."""
    compiled = None

    @functools.wraps(eager)
    def call(x: torch.Tensor, *args):
        nonlocal compiled
        if not (_capturing and x.is_cuda):
            return eager(x, *args)
        if compiled is None:
            import torch._dynamo
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            compiled = torch.compile(eager, dynamic=True, fullgraph=True)
        return compiled(x, *args)
    return call


HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _triton_ops():
    """The Triton kernels, or None where Triton is missing."""
    try:
        from outpace.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


@functools.cache
def _checked_ops(device: torch.device, dtype: torch.dtype):
    """triton_ops once its kernels have run correctly on this device in this dtype, else None
    (said once on stderr: graphs then use PyTorch's kernels)."""
    ops = _triton_ops()
    problem = "Triton is not installed" if ops is None else ops.self_check(device, dtype)
    if problem:
        print(f"outpace: Triton kernels off on {device} ({problem}); CUDA graphs use PyTorch's kernels",
              file=sys.stderr)
        return None
    return ops


@functools.cache
def _checked_trees(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode_attention's token-tree words ran correctly on this device in this dtype
    (said once on stderr where not: trees then attend through an additive mask)."""
    problem = _checked_ops(device, dtype).tree_check(device, dtype)
    if problem:
        print(f"outpace: the Triton attention of token trees is off on {device} ({problem}); trees attend "
              "through PyTorch's kernels", file=sys.stderr)
    return not problem


def _graph_kernels(dtype: torch.dtype, device: torch.device):
    """triton_ops while graphs are captured for CUDA tensors of a half dtype, else None."""
    if not (_capturing and device.type == "cuda" and dtype in HALF):
        return None
    return _checked_ops(device, dtype)


# Inside graphs a step of a few rows takes Triton's matvec, each row as its own one-row product,
# while rows x the weight's elements stay within this: its rows then read the weight from L2, and
# on an H100 the default model's products took, in us, matvec / cuBLAS, qkv (960 x 576) 2.2 / 3.1
# for 2 rows, 2.7 / 3.1 for 5, 3.5 / 3.2 for 9; o (576 x 576) 2.7 / 3.2 for 9, 3.2 / 3.2 for 13;
# gate_up (3072 x 576) 2.9 / 3.3 for 2, 3.6 / 3.2 for 3; down (576 x 1536) 4.1 / 4.8 for 9, 5.5 /
# 4.6 for 13. Llama-3-8B's matrices take cuBLAS from 2 rows.
MATVEC_ROW_ELEMENTS = 4 << 20


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x); inside graphs one row, or a few rows of a small matrix, go through Triton's
    matvec (cuBLAS reads the attention's matrices of Llama-3-8B's shape at 71-82% of the copy
    bandwidth, the matvec at 85-92%)."""
    ops = _graph_kernels(x.dtype, x.device)
    rows = x.numel() // x.shape[-1]
    if (ops is None or not layer.weight.is_contiguous()
            or rows > 1 and rows * layer.weight.numel() > MATVEC_ROW_ELEMENTS):
        return layer(x)
    return ops.matvec(x, layer.weight, layer.bias)


def linear_rows(x: torch.Tensor, layer: nn.Module, n: int) -> torch.Tensor:
    """layer(x)[..., :n], computing those outputs alone (a draft vocabulary: an LM head's first
    token ids). The CPU's packed and quantized layers keep their output columns in order, so the
    first n are a prefix of their packed weight (their first_rows)."""
    if hasattr(layer, "first_rows"):
        return layer.first_rows(x, n)
    return F.linear(x, layer.weight[:n], None if layer.bias is None else layer.bias[:n])


def graph_attention(dtype: torch.dtype, head_dim: int, device: torch.device, queries: int) -> bool:
    """Whether decode_attention runs here: inside graphs, for a half dtype, a power-of-two head
    size up to 256 and few enough queries per key/value head (query heads per group x tokens per
    row; triton_ops.attention_fits). Its queries see keys j <= their positions, so no mask is
    built for it."""
    ops = _graph_kernels(dtype, torch.device(device))
    return ops is not None and ops.attention_fits(head_dim, queries)


def graph_tree_attention(dtype: torch.dtype, head_dim: int, device: torch.device, queries: int) -> bool:
    """graph_attention for token trees: decode_attention with trees' words (its tree argument),
    which must also have run correctly here."""
    return graph_attention(dtype, head_dim, device, queries) and _checked_trees(torch.device(device), dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_len: int, slot_start: int, window: int | None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of graph rows (q [B, H, S, D]) over their caches, keys j <= each query's
    position (within the window), and with tree [B, S] (int64 words) key position + 1 + i for
    each bit i set: [B, S, H * D] (graph_attention must hold)."""
    ops = _graph_kernels(q.dtype, q.device)
    return ops.decode_attention(q, k_cache, v_cache, positions, kv_len, slot_start, window or 0, tree=tree)


def tree_words(seen: torch.Tensor) -> torch.Tensor:
    """[..., n] bool (n < 64) as int64 words, bit i set where seen[..., i]: decode_attention's tree."""
    return (seen.long() << torch.arange(seen.shape[-1], device=seen.device)).sum(-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype) * weight


rms_norm = cuda_compiled(_rms_norm)


@cuda_compiled
def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta)): a residual add and the next norm in one pass."""
    h = h + delta
    return h, _rms_norm(h, weight, eps)


@cuda_compiled
def rms_norm_cat(a: torch.Tensor, a_weight: torch.Tensor, b: torch.Tensor, b_weight: torch.Tensor, eps: float):
    """cat(rms_norm(a), rms_norm(b)) on the last dim: an EAGLE-3 head's attention input in one pass."""
    return torch.cat([_rms_norm(a, a_weight, eps), _rms_norm(b, b_weight, eps)], dim=-1)


@cuda_compiled
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up from the fused [gate | up] product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D]; cos, signed_sin [B, S, 1, D] in x's dtype.

    The reference rotates as x * cos + cat(-x2, x1) * sin. Rolling x by half gives cat(x2, x1),
    and multiplying by the signed sin cat(-s1, s2) yields the same products bit for bit, in
    four ops instead of eight (one kernel on CUDA)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


rope = cuda_compiled(_rope)


@cuda_compiled
def rope_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """Rotates q and k (qk [B, S, H+KVH, D]), writes k and v [B, S, KVH, D] into the caches
    [slots, KVH, L, D] at (slots [B], positions [B, S]) and returns q as [B, H, S, D]. Inside
    graphs this is one kernel where the plain ops are a rotation, two transposing copies and two
    scatters."""
    qk = _rope(qk, cos, signed_sin)
    kv_heads = v.shape[2]
    index = (slots[:, None, None], heads, positions[:, None, :])
    k_cache.index_put_(index, qk[:, :, -kv_heads:].transpose(1, 2).to(k_cache.dtype))
    v_cache.index_put_(index, v.transpose(1, 2).to(v_cache.dtype))
    return qk[:, :, :-kv_heads].transpose(1, 2)
