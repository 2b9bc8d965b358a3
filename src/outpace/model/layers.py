"""Shared layers of the decoder-only families: RMSNorm, attention with a KV cache, SwiGLU MLP.

Every forward takes a batch of B rows at explicit positions [B, S]: row b holds up to S new tokens
of one sequence (1 for decoding, k+1 for verifying k drafts, many for a prompt chunk). Rows may be
packed: the residual stream then holds only the real tokens [T, H], so the linear layers never
compute padding, and attention alone lays them out as [B, S]. Attention reads keys from the cache
through an explicit boolean mask, so a tree of drafts is one more mask.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from outpace.model.config import ModelConfig
from outpace.kernels import cpu_kernels, fused
from outpace.kernels.fused import add_rms_norm, linear, rms_norm, rope, rope_store, silu_mul


# Forwards whose shapes rarely repeat on CUDA (prompt chunks, and every eager forward: a draft
# model's catch-up, token trees, steps past the graphs) attend through kernels that need no plan
# per shape. cuDNN's attention, which PyTorch prefers there, builds one for every new (queries,
# keys) shape: about 55 ms each on an H100 for the default model, against 15-18 ms for the whole
# forward of a 300-token chunk; 0.6-1.1 s for a new two-row catch-up of Qwen2.5-Coder-0.5B on an
# H200, against 21 ms once planned. Flash (causal) and memory-efficient (masked) attention do
# not; they need the key/value heads repeated up to the query heads.
PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def planless_attention(q, keys, values, mask, causal: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention of q [B, H, S, D] over keys/values [B, KVH, L, D] through
    PROMPT_BACKENDS (CUDA shapes that rarely repeat)."""
    repeat = q.shape[1] // keys.shape[1]
    if repeat > 1:                  # grouped-query attention: one key/value head per query head
        keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    with sdpa_kernel(PROMPT_BACKENDS):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal)


@dataclass
class PromptChunk:
    """A prompt chunk cached in a decode forward: its tokens follow the rows' and attend apart."""

    slot: int
    n: int                         # tokens, at positions end - n .. end - 1
    end: int
    mask: torch.Tensor | None      # [1, 1, n, end] bool; None: causal from position 0


@dataclass
class Packed:
    """Rows of different lengths as their T real tokens, row after row. Attention alone lays them
    out by row; everything else (linears, norms, rotation, cache writes) sees only real tokens.
    Prompt chunks' tokens may follow the rows' (positions and slots cover them too); the model
    returns logits and hidden states of the rows' tokens only."""

    index: torch.Tensor            # [T] each row token's flat index into [B, S]
    positions: torch.Tensor        # [T (+ chunks' tokens)] its cache position
    slots: torch.Tensor            # [T (+ chunks' tokens)] its cache slot
    chunks: list[PromptChunk] = field(default_factory=list)
    # set when padding the rows would cost much: attention then runs every row's first query
    # (tokens `first` [B]) apart from the others, which sit in the long rows [R] (rows with more
    # than one token): tokens `later` at `later_at`, flat indices into [R, S - 1]
    long_rows: torch.Tensor | None = None
    first: torch.Tensor | None = None
    later: torch.Tensor | None = None
    later_at: torch.Tensor | None = None


class AttentionKind(enum.Enum):
    """How a forward's attention runs, decided once per forward by the runner (one function each
    in Attention):
      DENSE       rotation and cache writes in PyTorch, attention over the rows' caches (a view of
                  their slot range, or a gather) through `mask`, or causal from position 0;
      PACKED      rows of different lengths packed into their real tokens (batch.packed), laid
                  out by row for attention alone (padded, or split when padding would cost much);
                  prompt chunks after the rows attend over their own caches;
      GRAPH       a CUDA graph step: fused.decode_attention over positions (mask None);
      CPU_KERNEL  every token through cpu_kernels.rope_attend (rotation, cache writes and
                  attention by slot and position; mask None), packed or not;
      CPU_ROWS    packed rows through cpu_kernels.rope_attend in the caches' dtype, then float32
                  prompt chunks (a bfloat16 model's, see FP32_PREFILL_MIN_TOKENS) as in PACKED."""

    DENSE = "dense"
    PACKED = "packed"
    GRAPH = "graph"
    CPU_KERNEL = "cpu_kernel"
    CPU_ROWS = "cpu_rows"


@dataclass
class ForwardBatch:
    """Where a forward reads and writes the cache. Built by the model runner, shared by all layers."""

    input_ids: torch.Tensor        # [B, S] int64 ([T] when packed)
    positions: torch.Tensor        # [B, S] int64, cache position of each new token
    slots: torch.Tensor            # [B] int64, cache slot of each row
    kv_len: int                    # keys attended: cache positions [0, kv_len)
    attention: AttentionKind = AttentionKind.DENSE
    mask: torch.Tensor | None = None    # [B, 1, S, kv_len] bool (True = may attend) or additive bias; None = all keys
    slot_start: int | None = None  # slots are slot_start .. slot_start+B-1: read the cache as a view
    write_start: int | None = None  # B == 1: the row's first position, so writes are slice copies
    logits: bool = True            # False: a prompt chunk, whose logits nobody reads
    planless: bool = False         # rare shapes (eager, a prompt chunk): CUDA attention through PROMPT_BACKENDS
    packed: Packed | None = None   # rows packed into their real tokens (PACKED, CPU_KERNEL, CPU_ROWS)
    # rows' offsets in the slot range slot_start.. that attention reads as one view; the range's
    # other slots are idle rows whose outputs are dropped (mask then has one row per slot of it)
    span_rows: torch.Tensor | None = None
    causal: bool = False           # rows of one length from position 0, consecutive slots: mask None, keys j <= query i
    window: int | None = None      # GRAPH: the sliding window the kernel applies
    # a token tree's rotary positions (each node's depth past the row's start) where they differ
    # from `positions`, where its keys and values are written (one entry a node); None: the same
    rope_positions: torch.Tensor | None = None
    # CPU_KERNEL token trees: cpu_kernels.tree_keys' table, the keys each node attends to; None: a chain
    tree: torch.Tensor | None = None
    # GRAPH token trees: [B, S] int64 words; a query sees its row's keys up to its first position
    # and, for bit i set, the key at that position + 1 + i (its ancestors' and its own); None: causal
    tree_words: torch.Tensor | None = None
    # the norms, SwiGLU and (outside the kernel's attention) rotation run as cpu_kernels: every CPU
    # forward whose activations' dtype the kernels serve
    cpu_pointwise: bool = False
    # a static step's (the CUDA graph runner's): rows starting at this position or later are idle
    # slots' dummy rows, which recurrent layers run on a slot no sequence reads; None: no idle rows
    idle_start: int | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not x.is_cuda:
            # one fused op: in float32 bit for bit the reference's normalise-then-scale
            return F.rms_norm(x, self.shape, self.weight.to(x.dtype), self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None,
                    kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm) (delta None: (h, its norm)): one kernel inside CUDA graphs, one
        call of cpu_kernels with kernels."""
        if kernels:     # the weight in the activations' dtype (a bfloat16 model's float32 prompt chunks)
            return cpu_kernels.add_rms_norm(h, delta, self.weight.to(h.dtype), self.eps)
        if delta is None:
            return h, self(h)
        if h.is_cuda:
            return add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_window

    def forward(self, x, cos, sin, batch: ForwardBatch, k_cache, v_cache):
        H, KVH = self.num_heads, self.num_kv_heads
        qkv = linear(x, self.qkv).unflatten(-1, (H + 2 * KVH, self.head_dim))       # [B, S, heads, D] or [T, heads, D]
        qk, v = qkv[..., :H + KVH, :], qkv[..., H + KVH:, :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[..., :H, :]), self.k_norm(qk[..., H:, :])], dim=-2)
        out = self.VARIANTS[batch.attention](self, qkv, qk, v, cos, sin, batch, k_cache, v_cache)
        return self.output(out, x)

    def output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The o projection of the heads' outputs out [..., H * D] (x: the layer's input, which a
        gated variant reads)."""
        return linear(out, self.o)

    def _cpu_kernel(self, qkv, qk, v, cos, sin, batch: ForwardBatch, k_cache, v_cache):
        pk = batch.packed
        return self._kernel_rows(qkv, qk, cos, sin, batch.slots if pk is None else pk.slots,
                                 batch.positions if pk is None else pk.positions, k_cache, v_cache, batch.tree)

    def _packed_variant(self, qkv, qk, v, cos, sin, batch: ForwardBatch, k_cache, v_cache):
        return self._packed(qkv, qk, v, cos, sin, batch, k_cache, v_cache).flatten(-2)

    def _dense(self, qkv, qk, v, cos, sin, batch: ForwardBatch, k_cache, v_cache):
        B, S = batch.positions.shape
        q = self._rotate_and_store(qk, v, cos, sin, batch, k_cache, v_cache)
        keys, values = self._caches(batch, k_cache, v_cache)
        out = self._attend(q, keys, values, batch.mask, batch.causal, batch.span_rows, planless=batch.planless)
        return out.transpose(1, 2).reshape(B, S, -1)

    def _graph(self, qkv, qk, v, cos, sin, batch: ForwardBatch, k_cache, v_cache):
        q = self._rotate_and_store(qk, v, cos, sin, batch, k_cache, v_cache)
        seen = batch.positions if batch.tree_words is None else batch.positions[:, :1].expand_as(batch.positions)
        return fused.decode_attention(q, k_cache, v_cache, seen, batch.kv_len, batch.slot_start, batch.window,
                                      batch.tree_words)

    def _rotate_and_store(self, qk, v, cos, sin, batch: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        """q and k rotated together, the new keys/values written at their positions (stale
        entries past a sequence's length are never attended and get overwritten by later
        writes); returns q [B, H, S, D]."""
        H, S = self.num_heads, batch.positions.shape[1]
        if batch.write_start is None:
            return rope_store(qk, v, cos, sin, k_cache, v_cache, batch.slots, self._heads(qk.device), batch.positions)
        # one row at known positions: plain copies
        qk = cpu_kernels.rope(qk, cos, sin) if batch.cpu_pointwise else rope(qk, cos, sin)   # [B, S, H+KVH, D]
        k_cache[batch.slot_start, :, batch.write_start:batch.write_start + S] = qk[0, :, H:].transpose(0, 1)
        v_cache[batch.slot_start, :, batch.write_start:batch.write_start + S] = v[0].transpose(0, 1)
        return qk[:, :, :H].transpose(1, 2)

    def _caches(self, batch: ForwardBatch, k_cache, v_cache):
        """The rows' caches: a view of slots slot_start.. when they sit in one range (rows scattered
        over it put zero queries in its idle slots, dropped after), else a gather of each row's
        cache, which costs more than the linears at 16 rows."""
        if batch.slot_start is not None:
            span = batch.positions.shape[0] if batch.span_rows is None else batch.mask.shape[0]
            return (k_cache[batch.slot_start:batch.slot_start + span, :, :batch.kv_len],
                    v_cache[batch.slot_start:batch.slot_start + span, :, :batch.kv_len])
        return self._gather(k_cache, v_cache, batch.kv_len, batch.slots)

    @staticmethod
    def _gather(k_cache, v_cache, kv_len: int, slots: torch.Tensor):
        """Copies of the caches of `slots`, positions [0, kv_len)."""
        return k_cache[:, :, :kv_len].index_select(0, slots), v_cache[:, :, :kv_len].index_select(0, slots)

    def _packed(self, qkv, qk, v, cos, sin, batch: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        """Attention over packed rows (qkv [T, H+2KVH, D], its q and k heads qk (normed where the
        family norms them), v [T, KVH, D], cos/sin [T, 1, D]): rotation and cache writes per real
        token; returns [T, H, D]."""
        H, pk = self.num_heads, batch.packed
        rows, first = None, 0       # first: the first token rotated and written below
        if batch.attention is AttentionKind.CPU_ROWS:   # the rows (the first T tokens) in one kernel call, then the chunks'
            first = T = len(pk.index)
            rows = self._kernel_rows(qkv[:T], qk[:T], cos[:T], sin[:T], pk.slots[:T], pk.positions[:T],
                                     k_cache, v_cache).unflatten(-1, (H, -1))
            qk, v, cos, sin = qk[T:], v[T:], cos[T:], sin[T:]
        qk = cpu_kernels.rope(qk, cos, sin) if batch.cpu_pointwise else rope(qk, cos, sin)
        index = (pk.slots[first:, None], self._heads(qk.device).view(-1), pk.positions[first:, None])   # [T, KVH]
        k_cache.index_put_(index, qk[:, H:].to(k_cache.dtype))
        v_cache.index_put_(index, v.to(v_cache.dtype))
        q = qk[:, :H]
        if not pk.chunks:
            return self._packed_rows(q, batch, k_cache, v_cache)
        # prompt chunks after the rows: each attends over its own slot's cache. The rows attend in
        # the cache's dtype even when a long chunk makes the forward float32: widening every row's
        # cache to float32 cost more than the rows' share of the products
        if rows is None:
            T = len(pk.index)
            rows = self._packed_rows(q[:T].to(k_cache.dtype), batch, k_cache, v_cache).to(q.dtype)
            q = q[T:]
        outs, offset = [rows], 0
        for c in pk.chunks:
            chunk_q = q[offset:offset + c.n].transpose(0, 1)[None]                 # [1, H, n, D]
            out = self._attend(chunk_q, k_cache[c.slot:c.slot + 1, :, :c.end], v_cache[c.slot:c.slot + 1, :, :c.end],
                               c.mask, c.mask is None, None, planless=batch.planless)
            outs.append(out[0].transpose(0, 1))
            offset += c.n
        return torch.cat(outs)

    def _kernel_rows(self, qkv, qk, cos, sin, slots, positions, k_cache, v_cache, tree=None) -> torch.Tensor:
        """Rotation, cache writes and attention of rows' tokens as cpu_kernels.rope_attend, in the
        caches' dtype (qkv [..., H+2KVH, D]; qk its q and k heads, used where the family norms
        them; tree: the token trees' table). Returns [..., H * D] in qkv's dtype."""
        dtype = k_cache.dtype
        out = cpu_kernels.rope_attend(qkv.to(dtype).contiguous(), self.num_heads, cos.to(dtype), sin.to(dtype),
                                      k_cache, v_cache, slots, positions, self.window,
                                      None if self.q_norm is None else qk.to(dtype).contiguous(), tree)
        return out.view(*qkv.shape[:-2], -1).to(qkv.dtype)

    def _packed_rows(self, q, batch: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        """Attention of the packed rows' queries q [T, H, D] (written to the cache already)."""
        B, S = batch.positions.shape
        pk, planless = batch.packed, batch.planless
        keys, values = self._caches(batch, k_cache, v_cache)
        if pk.long_rows is None:        # little padding: attention runs over the rows padded to S
            padded = q.new_zeros(B * S, *q.shape[1:]).index_copy_(0, pk.index, q).view(B, S, *q.shape[1:])
            out = self._attend(padded.transpose(1, 2), keys, values, batch.mask, False, batch.span_rows, planless)
            return out.transpose(1, 2).reshape(B * S, *q.shape[1:]).index_select(0, pk.index)
        # much padding: attention's cost follows its queries, so every row's first query attends as
        # in a decode step, and the longer rows' later ones, padded among themselves, over a gather
        # of their own caches
        out = torch.empty_like(q)
        out[pk.first] = self._attend(q[pk.first, :, None], keys, values, batch.mask[:, :, :1], False,
                                     batch.span_rows, planless)[:, :, 0]
        rows = pk.long_rows
        later = q.new_zeros(len(rows) * (S - 1), *q.shape[1:])
        later[pk.later_at] = q[pk.later]
        mask_rows = rows if batch.span_rows is None else batch.span_rows[rows]
        later = self._attend(later.view(len(rows), S - 1, *q.shape[1:]).transpose(1, 2),
                             *self._gather(k_cache, v_cache, batch.kv_len, batch.slots[rows]),
                             batch.mask[mask_rows, :, 1:], False, None, planless)
        out[pk.later] = later.transpose(1, 2).reshape(-1, *q.shape[1:])[pk.later_at]
        return out

    @staticmethod
    def _attend(q, keys, values, mask, causal: bool, span_rows, planless: bool = False) -> torch.Tensor:
        """q [B, H, S, D] over keys/values [B or span, KVH, L, D]; span_rows: q's rows in the span.
        planless: a shape that rarely repeats (on CUDA: PROMPT_BACKENDS)."""
        keys, values = keys.to(q.dtype), values.to(q.dtype)    # a float32 prompt chunk reads bf16 caches
        if span_rows is not None:
            q = q.new_zeros((keys.shape[0], *q.shape[1:])).index_copy_(0, span_rows, q)
        if planless and q.is_cuda:
            out = planless_attention(q, keys, values, mask, causal)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return out if span_rows is None else out.index_select(0, span_rows)

    def _heads(self, device) -> torch.Tensor:
        heads = getattr(self, "_heads_index", None)
        if heads is None or heads.device != device:
            heads = self._heads_index = torch.arange(self.num_kv_heads, device=device)[None, :, None]
        return heads


    VARIANTS = {AttentionKind.DENSE: _dense, AttentionKind.PACKED: _packed_variant, AttentionKind.GRAPH: _graph,
                AttentionKind.CPU_KERNEL: _cpu_kernel, AttentionKind.CPU_ROWS: _packed_variant}


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matrix."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, kernels: bool = False):
        gate_up = linear(x, self.gate_up)
        return linear(cpu_kernels.silu_mul(gate_up) if kernels else silu_mul(gate_up), self.down)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, delta, cos, sin, batch, k_cache, v_cache):
        """(h, delta) -> (h', delta'): the residual stream is h + delta, whose add the next norm
        takes into its own kernel on CUDA (delta None: h is the stream)."""
        h, x = self.input_norm.add_forward(h, delta, batch.cpu_pointwise)
        h, x = self.post_norm.add_forward(h, self.attn(x, cos, sin, batch, k_cache, v_cache), batch.cpu_pointwise)
        return h, self.mlp(x, batch.cpu_pointwise)
