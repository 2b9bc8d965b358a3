"""ModelRunner: the one place where host-side rows become tensors and the target model runs.

A row is one sequence's new tokens in a step: a prompt chunk, or its last token followed by its
draft. Rows of different lengths are packed: the model's linears, norms, rotation and cache writes
run over the real tokens only, so a row's draft costs what its tokens cost, not the longest row's
length times the rows; attention alone lays the rows out by row (padded to the longest, or, where
that padding would cost much, every row's first query apart from the others). Rows of one length
are a plain [B, S] batch. A packing runner also caches the step's prompt chunks in the same
forward (their tokens packed after the rows', each attending over its own cache), so a step is one
forward. Padded entries of logits are never read. Exact mode never packs: its forwards keep one
shape whatever the drafts, padding included, whose tokens are written past the sequence's length
(the cache has `max_step_tokens` spare positions for that), masked from every query, and
overwritten later.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from outpace.kernels import cpu_kernels
from outpace.kernels.cpu_linear import PackedLinear
from outpace.model.decoder import DecoderLM
from outpace.model.layers import AttentionKind, ForwardBatch, Packed, PromptChunk
from outpace.sampling.tree import tree_depths


@dataclass
class Row:
    slot: int
    token_ids: list[int]
    start: int          # position of token_ids[0]


# Rows on scattered slots attend over their slot range as one view when the range is at most this
# many times the rows; wider ranges gather each row's cache instead.
SPAN_LIMIT = 2

# Packed rows with at least this many padded tokens attend in two parts (every row's first query,
# then the longer rows' others) rather than padded: about where, at a few hundred keys on this CPU,
# the padded queries cost what the second attention call and its gathers cost.
SPLIT_ATTENTION_PADDING = 16

# A bfloat16 prompt chunk of at least this many tokens runs in float32 on a CPU whose bfloat16
# products widen to float32 FMAs (no AVX512_BF16), where the layers multiply dense weights: there
# oneDNN's float32 products were about 1.6x its bfloat16 ones from 128 rows up (cpu_linear.py's
# notes). Where cpu_kernels.linear runs on vdpbf16ps the chunk stays bfloat16: four 660-790-token
# rag prompts took 3.14 s to prefill against 6.07 in float32 (products 1.70 s against 4.18); so it
# does where every product of the layers reads GGUF blocks, whose inputs are rounded to int8 in
# either dtype: with the AVX2 attention kernel, prompts of the default model and of
# Qwen2.5-Coder-1.5B prefilled within 4% of float32 (one slower, one faster) on an AVX2-only EPYC.
# A decode or verify forward of its own keeps the weights' dtype; rows packed beside such a chunk
# compute in float32 with it, and a float32 chunk's attention depends on its length, so under load
# a row's tokens can depend on how prompts were chunked and packed (DESIGN, "Exactness"). Exact
# mode keeps every chunk in the weights' dtype (ModelRunner.prefill_dtype).
FP32_PREFILL_MIN_TOKENS = 128


def _dense_products(model: DecoderLM) -> bool:
    """Whether a product of the model's layers multiplies dense weights (not GGUF blocks)."""
    return any(isinstance(m, (nn.Linear, PackedLinear)) for m in model.layers.modules())


class ModelRunner:
    # what a greedy step asks forward for: the argmax of its real tokens' logits, taken before rows
    # are padded (PyTorch's argmax over a 16-row step's padded logits took up to a fifth of the step)
    greedy_logits = "tokens"

    def __init__(self, model: DecoderLM, num_slots: int, max_len: int, max_step_tokens: int,
                 exact_width: int | None = None, max_verify_tokens: int = 1, snapshots: bool = True):
        """exact_width: in exact mode, every decode forward is padded to this many tokens per row
        and attends over the whole cache, so its arithmetic never depends on the draft length.
        max_verify_tokens, snapshots: a recurrent model's state rolls back verify rows of up to
        that many tokens, from a snapshot per token or by replay (model.make_cache)."""
        self.model = model
        cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len = max_len
        self.cache = model.make_cache(num_slots, max_len + max_step_tokens, self.dtype, self.device,
                                      max(max_verify_tokens, exact_width or 1), snapshots)
        self.exact_width = exact_width
        self.window = cfg.sliding_window
        # exact mode keeps prompt chunks in the weights' dtype: a float32 chunk's attention depends on
        # its length (PyTorch's), so a prompt's cache would depend on how a load chunked it
        self.prefill_dtype = (torch.float32 if self.device.type == "cpu" and self.dtype == torch.bfloat16
                              and not cpu_kernels.has_bf16_dot() and exact_width is None
                              and _dense_products(model) else None)
        self._arange = torch.arange(max_len + max_step_tokens, device=self.device)
        self._padded_logits: torch.Tensor | None = None
        # whether rows of different lengths cost their own tokens (packed) or the longest row's
        self.packs_rows = exact_width is None
        self._extend_rope(model)

    def _extend_rope(self, model: DecoderLM) -> None:
        """Padded rows sit at positions up to the cache length; the rope tables cover max_len.
        Those rows are never read as real positions, so copies of the last table row do."""
        extra = self.cache.max_len - model.rope_cos.shape[0]
        if extra > 0:
            model.rope_cos = torch.cat([model.rope_cos, model.rope_cos[-1:].expand(extra, -1)])
            model.rope_sin = torch.cat([model.rope_sin, model.rope_sin[-1:].expand(extra, -1)])

    def release_graphs(self) -> None:
        """Free what holds the process group's communicators (CudaGraphRunner: its graphs)."""

    def copy_prefix(self, source_slot: int, slot: int, length: int) -> None:
        """The first `length` positions' keys and values of source_slot copied into slot (prefix
        sharing, engine/scheduler.py)."""
        self.cache.copy_prefix(source_slot, slot, length)

    @torch.inference_mode()
    def forward(self, rows: list[Row], logits: str = "all", hidden_layers: tuple[int, ...] = (),
                chunks: list[Row] = (), draft_tokens: torch.Tensor | None = None,
                tree: list[list[int]] | None = None):
        """logits: 'all' -> [B, S, V] (a decode/verify step); 'tokens' -> their argmax [B, S] int64
        (a greedy step: taken over the real tokens only, before rows are padded); 'none' -> None (a
        prompt chunk). hidden_layers: the layers whose output to return for the rows' tokens.
        chunks: prompt chunks cached in the same forward (a packing runner only), after `rows`;
        nothing of theirs is returned. draft_tokens [B, K]: appended to each row's tokens. tree:
        the rows are token trees (forward_tree's layout, parents per row) that the CPU kernels'
        attention serves. Returns (logits or tokens, hidden [B, S, len(hidden_layers), H] or None)
        of `rows`."""
        if draft_tokens is not None:
            rows = [Row(r.slot, r.token_ids + d, r.start) for r, d in zip(rows, draft_tokens.tolist())]
        B = len(rows)
        S = max(len(r.token_ids) for r in rows)
        exact = self.exact_width is not None and logits != "none"
        if exact:
            S = max(S, self.exact_width)
        lengths = [len(r.token_ids) for r in rows]
        if chunks and not self.packs_rows:
            raise ValueError("only a packing runner caches prompt chunks in a decode forward")
        packed = not exact and (sum(lengths) < B * S or bool(chunks))
        if packed:
            ids = [t for r in rows + list(chunks) for t in r.token_ids]
        else:
            ids = [r.token_ids + [0] * (S - len(r.token_ids)) for r in rows]
        starts = torch.tensor([r.start for r in rows], device=self.device)
        positions = starts[:, None] + self._arange[None, :S]                    # [B, S]
        slots = [r.slot for r in rows]
        kv_len = max(r.start for r in rows) + S
        if exact:
            kv_len = self.cache.max_len
        is_contiguous = slots == list(range(slots[0], slots[0] + B))
        lowest, span = min(slots), max(slots) - min(slots) + 1
        prompt_tokens = sum(lengths) if logits == "none" else sum(len(c.token_ids) for c in chunks)
        compute = self.prefill_dtype if prompt_tokens >= FP32_PREFILL_MIN_TOKENS else None
        # rows of one length from position 0 in consecutive slots (one prompt, a trainer's padded
        # batch): keys j <= query i, no mask (rows scattered over a slot span attend through one)
        causal = (S > 1 and not packed and is_contiguous and all(r.start == 0 for r in rows) and not exact
                  and not self.window and not chunks)
        kind = self._attention(packed, compute, bool(chunks))
        in_torch = kind in (AttentionKind.DENSE, AttentionKind.PACKED)     # attention reads a mask
        span_rows = None
        query_positions = positions
        if in_torch and not is_contiguous and span <= SPAN_LIMIT * B:
            # attention reads slots lowest..lowest+span-1 as one view; idle slots' rows attend to
            # every key (never an empty softmax) and are dropped
            span_rows = torch.tensor([s - lowest for s in slots], device=self.device)
            query_positions = torch.full((span, S), kv_len - 1, dtype=torch.long, device=self.device)
            query_positions[span_rows] = positions
        masked = in_torch and (S > 1 or B > 1 or exact or self.window) and not causal
        tree_keys = None
        if tree is not None:
            assert kind is AttentionKind.CPU_KERNEL and not exact and not chunks, "trees in the CPU kernels only"
            tree_keys = cpu_kernels.tree_keys([r.start for r in rows], tree)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=self.device),
            positions=positions,
            slots=torch.tensor(slots, device=self.device),
            kv_len=kv_len,
            attention=kind,
            mask=self._mask(query_positions, kv_len) if masked else None,       # [B or span, 1, S, L]
            slot_start=slots[0] if is_contiguous else lowest if span_rows is not None else None,
            write_start=rows[0].start if B == 1 else None,
            logits=logits != "none",
            planless=self.device.type == "cuda",     # eager on a GPU: rare shapes
            packed=self._packing(lengths, S, positions, slots, chunks, split=kind is AttentionKind.PACKED) if packed else None,
            span_rows=span_rows,
            causal=causal,
            cpu_pointwise=kind is AttentionKind.CPU_KERNEL or cpu_kernels.pointwise_fits(compute or self.dtype, self.device),
            tree=tree_keys,
            # a node is rotated at its depth: its extent (tree_keys' first column), [T] or [B, S]
            rope_positions=None if tree_keys is None else tree_keys[:, 0].view(-1 if packed else (B, S)),
        )
        out, hidden = self.model(batch, self.cache, hidden_layers=hidden_layers, compute_dtype=compute)
        if logits == "tokens":
            on_kernel = self.device.type == "cpu" and cpu_kernels.has_library()
            out = cpu_kernels.argmax(out) if on_kernel else out.argmax(-1)
        if packed:      # back to [B, S]: padded entries keep finite stale values, which nobody reads
            index = batch.packed.index
            if out is not None:
                out = out.new_zeros(B * S).index_copy_(0, index, out) if logits == "tokens" else \
                    self._unpacked(out, index, B * S)
            if hidden is not None:
                hidden = hidden.new_zeros(B * S, *hidden.shape[1:]).index_copy_(0, index, hidden)
        if hidden is not None:
            hidden = hidden.view(B, S, *hidden.shape[1:])
        if out is None:
            return None, hidden
        return out.view(B, S, -1) if logits == "all" else out.view(B, S), hidden

    @torch.inference_mode()
    def forward_tree(self, rows: list[Row], parents: list[list[int]], logits: str = "all",
                     hidden_layers: tuple[int, ...] = ()):
        """A verify forward of token trees: row i is its last token then its draft's nodes, node
        j's parent parents[i][j] (an earlier node, or -1 for the row's last token). Node j's keys
        and values are written at position start + 1 + j, one entry a node; it is rotated at its
        depth (start + its depth) and attends to the cache up to the row's start and to its
        ancestors and itself. Where the CPU kernels attend (_attention), they read each node's keys
        through cpu_kernels.tree_keys' table, rows packed, so a node's result is bit for bit the one
        its path would get as a chain; elsewhere rows are padded and attend in PyTorch through the
        tree's mask. Returns as forward: (logits [B, S, V] or tokens [B, S], hidden or None)."""
        if self.exact_width is not None or self.model.is_recurrent:
            raise ValueError("token trees need a model without recurrent state, outside exact mode")
        if self._attention(True, None, False) is AttentionKind.CPU_KERNEL:
            return self.forward(rows, logits, hidden_layers, tree=parents)
        B, S = len(rows), max(len(r.token_ids) for r in rows)
        kv_len = max(r.start for r in rows) + S
        depth, allowed = [], torch.zeros(B, S, kv_len, dtype=torch.bool)
        for b, (row, nodes) in enumerate(zip(rows, parents)):
            allowed[b, :, :row.start + 1] = True        # the cache up to the row's last token
            for j, parent in enumerate(nodes):
                allowed[b, j + 1] = allowed[b, parent + 1]      # its parent's keys (a parent comes first)
                allowed[b, j + 1, row.start + 1 + j] = True     # and its own
            # padding: causal keys, never read
            for j in range(len(row.token_ids), S):
                allowed[b, j, :row.start + j + 1] = True
            depth.append(tree_depths(nodes, S - 1))
        starts = torch.tensor([r.start for r in rows], device=self.device)
        slots = [r.slot for r in rows]
        batch = ForwardBatch(
            input_ids=torch.tensor([r.token_ids + [0] * (S - len(r.token_ids)) for r in rows], device=self.device),
            positions=starts[:, None] + self._arange[None, :S],
            slots=torch.tensor(slots, device=self.device),
            kv_len=kv_len,
            mask=allowed.to(self.device).unsqueeze(1),                       # [B, 1, S, kv_len]
            write_start=rows[0].start if B == 1 else None,
            slot_start=slots[0] if B == 1 else None,
            rope_positions=starts[:, None] + torch.tensor(depth, device=self.device),
            planless=self.device.type == "cuda",
            cpu_pointwise=cpu_kernels.pointwise_fits(self.dtype, self.device),
        )
        out, hidden = self.model(batch, self.cache, hidden_layers=hidden_layers)
        out = out.view(B, S, -1)
        if logits == "tokens":
            out = out.argmax(-1)
        return out, (hidden.view(B, S, *hidden.shape[1:]) if hidden is not None else None)

    def _attention(self, packed: bool, compute: torch.dtype | None, has_chunks: bool) -> AttentionKind:
        """The forward's attention variant, decided here once. The CPU kernels' attention finds
        each token's keys from its slot and position (no mask, no slot span), prompt chunks too,
        whether alone or beside rows; where prompt chunks compute in float32 (a bfloat16 model's
        long chunks) the rows alone attend through it, the chunks through PyTorch."""
        fits = cpu_kernels.attention_fits(self.model.cfg, self.dtype, self.device)
        if fits and compute is None:
            return AttentionKind.CPU_KERNEL
        if fits and has_chunks:
            return AttentionKind.CPU_ROWS
        return AttentionKind.PACKED if packed else AttentionKind.DENSE

    def _packing(self, lengths: list[int], S: int, positions: torch.Tensor, slots: list[int],
                 chunks: list[Row], split: bool) -> Packed:
        """Where the real tokens of rows of these lengths sit, padded to S; prompt chunks' tokens
        follow them. split: attention may run in two parts (PyTorch's attention, not the CPU
        kernel's)."""
        device = self.device
        index = torch.tensor([b * S + j for b, n in enumerate(lengths) for j in range(n)], device=device)
        token_slots = torch.tensor(slots, device=device).repeat_interleave(torch.tensor(lengths, device=device))
        packed = Packed(index, positions.flatten().index_select(0, index), token_slots)
        if chunks:
            packed.chunks = [self._chunk(c) for c in chunks]
            packed.positions = torch.cat([packed.positions, *(self._arange[c.start:c.start + len(c.token_ids)]
                                                               for c in chunks)])
            packed.slots = torch.cat([token_slots, torch.tensor([c.slot for c in chunks for _ in c.token_ids],
                                                                device=device)])
        if split and len(lengths) * S - sum(lengths) >= SPLIT_ATTENTION_PADDING:
            starts = [0, *itertools.accumulate(lengths)][:-1]
            long_rows = [b for b, n in enumerate(lengths) if n > 1]
            later = [(starts[b] + j, r * (S - 1) + j - 1) for r, b in enumerate(long_rows) for j in range(1, lengths[b])]
            packed.long_rows = torch.tensor(long_rows, device=device)
            packed.first = torch.tensor(starts, device=device)
            packed.later, packed.later_at = torch.tensor(later, device=device).unbind(1)
        return packed

    def _chunk(self, chunk: Row) -> PromptChunk:
        """A prompt chunk's own attention: causal from position 0, else through a mask."""
        n, end = len(chunk.token_ids), chunk.start + len(chunk.token_ids)
        if chunk.start == 0 and not self.window:
            return PromptChunk(chunk.slot, n, end, None)
        return PromptChunk(chunk.slot, n, end, self._mask(self._arange[None, chunk.start:end], end))

    def _mask(self, query_positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[R, 1, S, kv_len] bool: the keys each query (positions [R, S]) may attend, causal and
        within the sliding window."""
        keys = self._arange[:kv_len]
        allowed = keys[None, None, :] <= query_positions[:, :, None]
        if self.window:
            allowed &= keys[None, None, :] > query_positions[:, :, None] - self.window
        return allowed.unsqueeze(1)

    def _unpacked(self, logits: torch.Tensor, token_index: torch.Tensor, n: int) -> torch.Tensor:
        """Packed logits [T, V] laid out as n padded rows, in a buffer kept across steps: a fresh
        one of this size costs more to fault in than the model's LM head over the padding."""
        if self._padded_logits is None or self._padded_logits.shape[0] < n:
            self._padded_logits = logits.new_zeros(n, logits.shape[-1])
        return self._padded_logits[:n].index_copy_(0, token_index, logits)
