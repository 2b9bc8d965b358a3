"""Triton kernels for the steps CUDA graphs replay: one-row products and decode attention.

At batch 1 a decode step streams every weight once, and two kinds of kernel fall short of the
copy bandwidth there on an H100 (timed inside graphs, each weight read from memory, not L2):
cuBLAS's products of one row (Llama-3-8B's shape: qkv 82%, o 71%, down 90%, gate_up 96% of the
copy bandwidth), and attention of a few queries over a short cache (PyTorch's kernels spread one
query's keys over too few blocks: 8.8 us a layer for 512 keys, 16 us for 9 queries). `matvec`
gives each block a few output rows over all of K (qkv 92%, o 85%, down 95%, gate_up 102%: the copy
bandwidth counts a read and a write); `decode_attention` splits the keys over blocks
(flash-decoding) and combines the parts in a second kernel, which writes the heads in the layout
the o projection reads (5.1 us and 6.8 us for the two cases above). Heads of 256 (Qwen3.5's gated
attention) take key blocks of half the size, their tiles being twice as wide.

Both compute what the reference computes, in float32 from bf16 inputs, but in another order:
graph and eager steps can part at near-ties, as with the compiled elementwise kernels (fused.py).
Importing this module needs Triton (CUDA machines); fused.py calls it only inside graph capture.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K,
                   HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_N outputs of one row of x (the grid's second axis)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    x_ptr += tl.program_id(1).to(tl.int64) * K
    out_ptr += tl.program_id(1).to(tl.int64) * N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptr + k + cols)
            w = tl.load(w_rows + (k + cols)[None, :], eviction_policy="evict_first")
        else:
            in_k = k + cols < K
            x = tl.load(x_ptr + k + cols, mask=in_k, other=0.0)
            w = tl.load(w_rows + (k + cols)[None, :], mask=(rows[:, None] < N) & in_k[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of a few rows, each computed as a product of one row: x [..., K], weight [N, K]
    contiguous -> [..., N]. Blocks read 2 rows x 1024 columns at a time where K allows, else
    8 x 512 or 8 x 256 (the fastest of nine shapes timed on an H100 for the 8B shape's and the
    default model's matrices). Every row has its own blocks (after the first, they find the
    weights in L2), so a row's result does not depend on the rows beside it."""
    N, K = weight.shape
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    block_k = next((b for b in (1024, 512) if K % b == 0), 256)
    block_n = 2 if block_k == 1024 else 8
    even = N % block_n == 0 and K % block_k == 0
    _matvec_kernel[(triton.cdiv(N, block_n), x.numel() // K)](
        x.contiguous(), weight, weight if bias is None else bias, out, N, K,
        HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


@triton.jit
def _attention_part_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, tree_ptr, part_ptr, stat_ptr,
                           q_stride_b, q_stride_h, q_stride_t, c_stride_s, c_stride_h, c_stride_l,
                           slot_start, split_len, num_splits, num_heads, window, scale_log2, kv_len,
                           T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                           BLOCK: tl.constexpr, TREE: tl.constexpr):
    """One (row, key/value head, split of the keys): the G query heads x T tokens of that head
    group as M (padded) query rows, over keys [split * split_len, ...) up to the last position
    (TREE: and the TREE_SPAN keys past it, each query's bits saying which of them it sees)."""
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = tl.arange(0, M)
    head, token = kv_head * G + m // T, m % T
    real = m < G * T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * q_stride_b + head[:, None] * q_stride_h + token[:, None] * q_stride_t + d[None, :],
                mask=real[:, None], other=0.0)
    pos = tl.load(pos_ptr + row * T + token, mask=real, other=-1)
    start = split * split_len
    last = tl.max(pos, axis=0) + 1                                    # keys past every query: never read
    if TREE:
        bits = tl.load(tree_ptr + row * T + token, mask=real, other=0)
        last = tl.minimum(last + TREE_SPAN, kv_len)
    end = tl.minimum(start + split_len, last)
    cache = (slot_start + row).to(tl.int64) * c_stride_s + kv_head * c_stride_h
    top = tl.full((M,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((M,), dtype=tl.float32)
    acc = tl.zeros((M, D), dtype=tl.float32)
    for n0 in range(start, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        at = cache + n[:, None] * c_stride_l + d[None, :]
        k = tl.load(k_ptr + at, mask=(n < end)[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2                  # log2 units
        seen = n[None, :] <= pos[:, None]
        if window > 0:
            seen &= n[None, :] > pos[:, None] - window
        if TREE:                    # key pos + 1 + j where the query's bit j is set
            j = n[None, :] - pos[:, None] - 1
            inside = (j >= 0) & (j < TREE_SPAN)
            seen |= inside & (((bits[:, None] >> tl.where(inside, j, 0).to(tl.int64)) & 1) != 0)
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        base = tl.where(new_top == float("-inf"), 0.0, new_top)     # a row with no key seen yet
        p = tl.exp2(scores - base[:, None])
        scale = tl.exp2(top - base)
        total = total * scale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + at, mask=(n < end)[:, None], other=0.0)
        acc = acc * scale[:, None] + tl.dot(p.to(v.dtype), v)
        top = new_top
    # part [rows, heads, T, splits, D], stat [rows, heads, T, splits, 2] (max in log2 units, sum)
    at = ((row * num_heads + head) * T + token) * num_splits + split
    tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=real[:, None])
    tl.store(stat_ptr + at * 2, top, mask=real)
    tl.store(stat_ptr + at * 2 + 1, total, mask=real)


@triton.jit
def _attention_combine_kernel(part_ptr, stat_ptr, out_ptr, num_splits, num_heads,
                              T: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    """One query (row, head, token): its splits' parts weighed by their maxima, written to
    out [rows, T, heads, D]."""
    query = tl.program_id(0)                  # (row * heads + head) * T + token
    row, head, token = query // (num_heads * T), (query // T) % num_heads, query % T
    s = tl.arange(0, SPLITS)
    used = s < num_splits
    top = tl.load(stat_ptr + (query * num_splits + s) * 2, mask=used, other=float("-inf"))
    total = tl.load(stat_ptr + (query * num_splits + s) * 2 + 1, mask=used, other=0.0)
    best = tl.max(top, axis=0)
    weight = tl.where(top == float("-inf"), 0.0, tl.exp2(top - best))
    d = tl.arange(0, D)
    part = tl.load(part_ptr + (query * num_splits + s)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + ((row * T + token) * num_heads + head) * D + d, out.to(out_ptr.dtype.element_ty))


# the keys past a query's position a token tree's bits may let it see (bits of an int64)
TREE_SPAN = tl.constexpr(63)
# a block's query tile, (query rows padded to a power of two, at least 16) x head size, at most
# this many elements: its float32 accumulator and bf16 queries then fit 8 warps' registers
QUERY_TILE = 128 * 128


def _query_rows(queries: int) -> int:
    return max(16, triton.next_power_of_2(queries))


def attention_fits(head_dim: int, queries: int) -> bool:
    """Whether decode_attention takes a head size and a number of queries per key/value head
    (query heads per group x tokens per row): their tiles must fit a block's registers."""
    return (16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
            and _query_rows(queries) * head_dim <= QUERY_TILE)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_len: int, slot_start: int = 0, window: int = 0, block: int = 64,
                     tree: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, T, D] (last dim contiguous) of rows in slots slot_start.. over their caches
    [slots, KVH, L, D], query (b, t) seeing keys j <= positions[b, t] (and > positions - window)
    among [0, kv_len), and with tree [B, T] (int64) also key positions[b, t] + 1 + i where bit i
    of tree[b, t] is set (i < TREE_SPAN: a token tree's ancestors). Returns [B, T, H * D] in q's
    dtype."""
    B, H, T, D = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_heads = k_cache.shape[1]
    G = H // kv_heads
    # enough blocks to fill the card: split the keys until there are about 256 of them
    splits = max(1, min(kv_len // block, -(-256 // (B * kv_heads))))
    split_len = -(-kv_len // splits // block) * block
    splits = -(-kv_len // split_len)
    part = torch.empty(B, H, T, splits, D, dtype=torch.float32, device=q.device)
    stat = torch.empty(B, H, T, splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(B, T, H * D, dtype=q.dtype, device=q.device)
    M = _query_rows(G * T)
    positions = positions.contiguous()
    _attention_part_kernel[(B, kv_heads, splits)](
        q, k_cache, v_cache, positions, positions if tree is None else tree.contiguous(), part, stat,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slot_start, split_len, splits, H, window, math.log2(math.e) / math.sqrt(D), kv_len,
        T=T, G=G, D=D, M=M, BLOCK=block if D <= 128 else block // 2, TREE=tree is not None,
        num_warps=4 if M * D <= 4096 else 8)
    _attention_combine_kernel[(B * H * T,)](part, stat, out, splits, H, T=T, D=D,
                                           SPLITS=triton.next_power_of_2(splits), num_warps=1 if D <= 64 else 2)
    return out


def tree_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """decode_attention with token trees' words once on a small tree: None when it agrees with
    masked attention, else what went wrong."""
    try:
        g = torch.Generator().manual_seed(0)
        k_cache, v_cache = (torch.randn(1, 2, 64, 16, generator=g).to(device, dtype) for _ in range(2))
        q = torch.randn(1, 4, 4, 16, generator=g).to(device, dtype)
        # the last token at 30, then nodes 0 and 1 (its children) and node 1's child
        start, words = 30, [0, 1, 2, 6]
        seen = (torch.arange(64) <= start).expand(4, 64).clone()
        for token, word in enumerate(words):
            for i in range(3):
                seen[token, start + 1 + i] = bool(word >> i & 1)
        keys, values = (c.float().repeat_interleave(2, 1) for c in (k_cache, v_cache))
        want = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=seen.to(device)[None, None])
        got = decode_attention(q, k_cache, v_cache, torch.full((1, 4), start, device=device), 64,
                               tree=torch.tensor([words], device=device))
        if not torch.allclose(got.float(), want.transpose(1, 2).reshape(1, 4, -1), rtol=3e-2, atol=3e-2):
            return "decode attention of a token tree disagrees with masked attention"
    except Exception as e:      # compile or launch failures: Triton raises many kinds
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run both kernels once on small inputs here: None when they agree with the reference ops,
    else what went wrong (a card or Triton build they do not compile or run on)."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(40, 300, generator=g).to(device, dtype)
        x = torch.randn(1, 300, generator=g).to(device, dtype)
        if not torch.allclose(matvec(x, w).float(), F.linear(x.float(), w.float()), rtol=3e-2, atol=3e-2):
            return "the one-row product disagrees with F.linear"
        k_cache, v_cache = (torch.randn(2, 2, 64, 16, generator=g).to(device, dtype) for _ in range(2))
        q = torch.randn(1, 4, 2, 16, generator=g).to(device, dtype)
        positions = torch.tensor([[40, 41]], device=device)
        seen = torch.arange(64, device=device) <= positions[:, None, :, None]
        keys, values = (c[1:2].float().repeat_interleave(2, 1) for c in (k_cache, v_cache))
        want = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=seen)
        got = decode_attention(q, k_cache, v_cache, positions, 64, slot_start=1)
        if not torch.allclose(got.float(), want.transpose(1, 2).reshape(1, 2, -1), rtol=3e-2, atol=3e-2):
            return "decode attention disagrees with masked attention"
    except Exception as e:      # compile or launch failures: Triton raises many kinds
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
