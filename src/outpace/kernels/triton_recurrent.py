"""The recurrent layers of hybrid models on CUDA as Triton kernels, for decode and verify rows.

Rows are described by the row table of recurrent_rows.RowGroups.table ([N, 8] int64 on the
device: slot, entry read, entry written or -1 for a snapshot per token, fresh, convolution window
start, first token in the stream, tokens, verify), so a launch reads nothing on the host and a
CUDA graph replays it with whatever the table holds that step. Each program runs one row's tokens
in order from the state where the StateCache keeps it, and writes what state_cache.py's layout
asks: a verify row's convolution window and inputs, and its state after every token into entry
(read + 1 + j) % E (snapshot mode), or after its last token into the entry written (replay mode,
with the log of each token's k, v, g and b; prompt chunks in place). The graph runner's idle rows
arrive on the cache's sink slot (recurrent_rows.row_groups), so no program touches a real slot
for them.

Two launches a Gated DeltaNet layer: the causal convolution (history read, then rewritten in
place) and the delta rule. One launch would race: every value head's program reads the q and k
channels of its key head, and a program rewriting their window could run before another read it.
LFM2's gated short convolution is the first kernel alone, gated.

Written here rather than taken from flash-linear-attention (fla-core 0.6.0): its fused recurrent
kernel keeps one state a sequence (an initial and a final state, no snapshot entries by row
table, no log), its causal convolution update (as causal-conv1d's) keeps a rolling window rather
than the verify layout rollback reads, and neither takes a row table of slots for graph replay.

Arithmetic: float32 throughout, rounded to the activations' dtype where the PyTorch path rounds
(the convolution's output, the write strength b, the output), in another order than PyTorch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

COLUMNS = 8                 # the row table's columns (recurrent_rows.RowGroup.table)
CONV_BLOCK = 64             # channels a convolution program takes (all its row's tokens)
# A delta-rule program: one warp on VALUE_BLOCK columns of the state [dk, dv], loading the
# inputs of PREFETCH tokens together. On an H200, Qwen3.5-0.8B's heads (dk = dv = 128), a row of
# 9 tokens alone: 9.5 us, against 16.9 us with two warps on 16 columns, each token's inputs loaded
# in its turn; 2.7 against 3.1 us for one token.
VALUE_BLOCK = 8
PREFETCH = 8


@triton.jit
def _conv_input(proj_ptr, tok, c, mask, proj_stride, C, GATED: tl.constexpr):
    """[len(tok), len(c)] the convolution's inputs at stream tokens `tok`, channels c: q k v
    (GATED: b * x, rounded as PyTorch rounds the product)."""
    at = proj_ptr + tok.to(tl.int64)[:, None] * proj_stride + c[None, :]
    x = tl.load(at, mask=mask, other=0.0)
    if GATED:
        x = (x * tl.load(at + 2 * C, mask=mask, other=0.0)).to(proj_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _conv_kernel(proj_ptr, w_ptr, bias_ptr, hist_ptr, rows_ptr, out_ptr, proj_stride, C, hist_rows,
                 K: tl.constexpr, KW: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 TP: tl.constexpr, BLOCK: tl.constexpr):
    """One row's channels [c0, c0 + BLOCK), all its tokens at once (tile [TP, BLOCK], TP >= its
    tokens): out_t = sum_i w[i] x_{t-K+1+i} (+ bias), then silu (Gated DeltaNet) or times the
    gate c (GATED, LFM2). Inputs before token 0 are the window, history entries conv_start ..
    conv_start+K-2 (zeros when fresh)."""
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_c = c < C
    info = rows_ptr + row * 8
    slot, fresh, conv_start = tl.load(info), tl.load(info + 3), tl.load(info + 4)
    offset, n, verify = tl.load(info + 5), tl.load(info + 6), tl.load(info + 7)
    hist = hist_ptr + slot * hist_rows * C
    t = tl.arange(0, TP)
    real = (t < n)[:, None] & in_c[None, :]
    acc = tl.full((TP, BLOCK), 0.0, tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=in_c, other=0.0)[None, :]
    for j in tl.static_range(K):
        at = t + j - (K - 1)                                    # [TP] each input's token; < 0: the window
        x = _conv_input(proj_ptr, offset + at, c, real & (at >= 0)[:, None], proj_stride, C, GATED)
        x += tl.load(hist + (conv_start + K - 1 + at)[:, None] * C + c[None, :],
                     mask=real & (at < 0)[:, None] & (fresh == 0), other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + j * C + c, mask=in_c, other=0.0)[None, :] * x
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tok = (offset + t).to(tl.int64)[:, None]
    if GATED:
        y *= tl.load(proj_ptr + tok * proj_stride + C + c[None, :], mask=real, other=0.0).to(tl.float32)
    else:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + tok * C + c[None, :], y.to(out_ptr.dtype.element_ty), mask=real)
    # the history: a verify row's window then its inputs (entries 0 .. K-2+n), else the K-1 inputs
    # before its next token; every old entry it keeps is read before any entry is written
    i = tl.arange(0, KW)
    in_window = (i < K - 1)[:, None] & in_c[None, :]
    window = tl.load(hist + (conv_start + i)[:, None] * C + c[None, :], mask=in_window & (fresh == 0), other=0.0)
    ends = n - (K - 1) + i                                      # [KW] the last K-1 inputs' tokens
    last = tl.load(hist + (conv_start + n + i)[:, None] * C + c[None, :],
                   mask=in_window & (ends < 0)[:, None] & (fresh == 0), other=0.0)
    tl.debug_barrier()
    if verify != 0:
        tl.store(hist + i[:, None] * C + c[None, :], window, mask=in_window)
        inputs = _conv_input(proj_ptr, offset + t, c, real, proj_stride, C, GATED)
        tl.store(hist + (K - 1 + t)[:, None] * C + c[None, :], inputs.to(hist_ptr.dtype.element_ty), mask=real)
    else:
        kept = in_window & (ends >= 0)[:, None]
        tail = tl.where(kept, _conv_input(proj_ptr, offset + ends, c, kept, proj_stride, C, GATED),
                        last.to(tl.float32))
        tl.store(hist + i[:, None] * C + c[None, :], tail.to(hist_ptr.dtype.element_ty), mask=in_window)


@triton.jit
def _delta_inputs(mixed_ptr, proj_ptr, offset, n, t0, kh, h, d, j, in_d, in_j, C, proj_stride, b_col, a_col,
                  neg_a, dt_bias, Hk, scale, DK: tl.constexpr, DV: tl.constexpr, PRE: tl.constexpr):
    """Tokens t0 .. t0+PRE-1 of a row, each a row of a tile: q and k normed [PRE, BK], v
    [PRE, BV], the write strength b and the log decay g [PRE] (b = g = 0 past the row's tokens:
    no decay, no write)."""
    t = t0 + tl.arange(0, PRE)
    real = t < n
    tok = (offset + t).to(tl.int64)
    x = mixed_ptr + tok[:, None] * C
    q = tl.load(x + kh * DK + d[None, :], mask=real[:, None] & in_d[None, :], other=0.0).to(tl.float32)
    k = tl.load(x + Hk * DK + kh * DK + d[None, :], mask=real[:, None] & in_d[None, :], other=0.0).to(tl.float32)
    v = tl.load(x + 2 * Hk * DK + h * DV + j[None, :], mask=real[:, None] & in_j[None, :], other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    p = proj_ptr + tok * proj_stride
    b = tl.sigmoid(tl.load(p + b_col + h, mask=real, other=0.0).to(tl.float32))
    b = b.to(proj_ptr.dtype.element_ty).to(tl.float32)
    a = tl.load(p + a_col + h, mask=real, other=0.0).to(tl.float32) + dt_bias
    g = neg_a * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))        # softplus, PyTorch's threshold
    return q, k, v, tl.where(real, b, 0.0), tl.where(real, g, 0.0)


@triton.jit
def _delta_kernel(mixed_ptr, proj_ptr, neg_a_ptr, dt_bias_ptr, state_ptr, rows_ptr, out_ptr,
                  log_k_ptr, log_v_ptr, log_g_ptr, log_b_ptr, proj_stride, b_col, a_col, E, R, H, Hk, scale,
                  DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LOG: tl.constexpr,
                  TOKENS: tl.constexpr, PRE: tl.constexpr):
    """One (value block, row, value head): the gated delta rule over the row's tokens on state
    columns [v0, v0 + BV) of the head, S [BK, BV] (rows >= DK, columns >= DV unused):
        S = exp(g) S;  S += k (b (v - S^T k))^T;  o = S^T q.
    The inputs of PRE tokens are loaded together, the next PRE's before this PRE's recurrence, so
    that no token's loads start only after the token before it is done."""
    vb, row, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = h // (H // Hk)
    info = rows_ptr + row * 8
    slot, read, write, fresh = tl.load(info), tl.load(info + 1), tl.load(info + 2), tl.load(info + 3)
    offset, n, verify = tl.load(info + 5), tl.load(info + 6), tl.load(info + 7)
    d = tl.arange(0, BK)
    j = vb * BV + tl.arange(0, BV)
    in_d, in_j = d < DK, j < DV
    tile = d[:, None] * DV + j[None, :]
    in_tile = in_d[:, None] & in_j[None, :]
    entry_size = H * DK * DV
    head = state_ptr + slot * E * entry_size + h * DK * DV          # entry e at head + e * entry_size
    S = tl.load(head + read * entry_size + tile, mask=in_tile & (fresh == 0), other=0.0)
    C = 2 * Hk * DK + H * DV
    neg_a, dt_bias = tl.load(neg_a_ptr + h), tl.load(dt_bias_ptr + h)
    ahead = _delta_inputs(mixed_ptr, proj_ptr, offset, n, 0, kh, h, d, j, in_d, in_j, C, proj_stride, b_col, a_col,
                          neg_a, dt_bias, Hk, scale, DK, DV, PRE)
    i = tl.arange(0, PRE)
    for t0 in tl.static_range(0, TOKENS, PRE):     # unrolled
        qs, ks, vs, bs, gs = ahead
        if t0 + PRE < TOKENS:
            ahead = _delta_inputs(mixed_ptr, proj_ptr, offset, n, t0 + PRE, kh, h, d, j, in_d, in_j, C, proj_stride,
                                  b_col, a_col, neg_a, dt_bias, Hk, scale, DK, DV, PRE)
        for u in tl.static_range(min(PRE, TOKENS - t0)):
            t = t0 + u
            real = t < n
            tok = (offset + t).to(tl.int64)
            mine = i == u                                  # token t's row of the tiles, picked by a sum of zeros
            q = tl.sum(tl.where(mine[:, None], qs, 0.0), axis=0)
            k = tl.sum(tl.where(mine[:, None], ks, 0.0), axis=0)
            v = tl.sum(tl.where(mine[:, None], vs, 0.0), axis=0)
            b = tl.sum(tl.where(mine, bs, 0.0), axis=0)
            g = tl.sum(tl.where(mine, gs, 0.0), axis=0)
            S = S * tl.exp(g)
            delta = b * (v - tl.sum(S * k[:, None], axis=0))              # [BV]
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(out_ptr + tok * (H * DV) + h * DV + j, o.to(out_ptr.dtype.element_ty), mask=in_j & real)
            if write < 0:
                tl.store(head + ((read + 1 + t) % E) * entry_size + tile, S, mask=in_tile & real)
            if LOG:
                if (verify != 0) & real:            # replay mode: what commit reruns, per token
                    at = slot * R + t
                    tl.store(log_v_ptr + (at * H + h) * DV + j, v, mask=in_j)
                    if vb == 0:
                        tl.store(log_g_ptr + at * H + h, g)
                        tl.store(log_b_ptr + at * H + h, b)
                        if h % (H // Hk) == 0:
                            tl.store(log_k_ptr + (at * Hk + kh) * DK + d, k, mask=in_d)
    if write >= 0:
        tl.store(head + write * entry_size + tile, S, mask=in_tile)


def _causal_conv(proj: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
                 rows: torch.Tensor, max_tokens: int, channels: int, gated: bool) -> torch.Tensor:
    """[T, channels] in proj's dtype: the convolution of every row (see _conv_kernel)."""
    K = weight.shape[0]
    out = proj.new_empty(proj.shape[0], channels)
    grid = (rows.shape[0], triton.cdiv(channels, CONV_BLOCK))
    _conv_kernel[grid](proj, weight, weight if bias is None else bias, history, rows, out, proj.stride(0), channels,
                       history.shape[1], K=K, KW=triton.next_power_of_2(max(K - 1, 1)), GATED=gated,
                       HAS_BIAS=bias is not None, TP=triton.next_power_of_2(max_tokens), BLOCK=CONV_BLOCK, num_warps=4)
    return out


def gated_deltanet(proj: torch.Tensor, conv_weight: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
                   history: torch.Tensor, state: torch.Tensor, log: tuple[torch.Tensor, ...] | None,
                   rows: torch.Tensor, max_tokens: int, heads: tuple[int, int, int, int]) -> torch.Tensor:
    """A Gated DeltaNet layer between its in projection and its gated norm. proj [T, P] (last dim
    contiguous) = [q k v | z | b | a] of the stream's tokens; conv_weight [K, C], neg_a =
    -exp(A_log) and dt_bias [H] float32; history [slots, K-1+R, C] and state [slots, E, H, dk, dv]
    one layer's of the StateCache; log its (k, v, g, b) in replay mode, else None; rows [N, 8]
    int64, no row of more than max_tokens tokens (the host's bound: a compile-time loop count);
    heads (Hk, dk, H, dv). Returns each head's output [T, H * dv] in proj's dtype."""
    Hk, dk, H, dv = heads
    C = 2 * Hk * dk + H * dv
    mixed = _causal_conv(proj, conv_weight, None, history, rows, max_tokens, C, gated=False)     # [T, C] after silu
    out = proj.new_empty(proj.shape[0], H * dv)
    log_k, log_v, log_g, log_b = log or (state,) * 4
    grid = (triton.cdiv(dv, VALUE_BLOCK), rows.shape[0], H)
    _delta_kernel[grid](mixed, proj, neg_a, dt_bias, state, rows, out, log_k, log_v, log_g, log_b, proj.stride(0),
                        C + H * dv, C + H * dv + H, state.shape[1], log_k.shape[1], H, Hk, dk ** -0.5,
                        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=min(VALUE_BLOCK, triton.next_power_of_2(dv)),
                        LOG=log is not None, TOKENS=max_tokens, PRE=min(triton.next_power_of_2(max_tokens), PREFETCH),
                        num_warps=1)
    return out


def short_conv(proj: torch.Tensor, conv_weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
               rows: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """LFM2's c * conv(b * x) from proj [T, 3C] = [b | c | x]; conv_weight [K, C] and bias [C]
    float32; history, rows and max_tokens as in gated_deltanet. Returns [T, C] in proj's dtype."""
    return _causal_conv(proj, conv_weight, bias, history, rows, max_tokens, proj.shape[1] // 3, gated=True)
