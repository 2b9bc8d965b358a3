"""HeadDrafter: a head on the target's hidden states (EAGLE-3, MTP) drafts chains or token trees.

Pair p of a sequence is (the target's feature at position p, token p + 1) and its output predicts
token p + 2 (model/draft_head.py). The head keeps its own KV cache in the target's slots, one entry
per pair at the pair's position, and per slot its output at the last pair it caught up on.

Cache invariant, per sequence: entries [0, caught) hold the pairs of the target's own features
and tokens, and the slot's stored output is that of pair caught - 1; pairs caught .. n - 1 (n the
position of its last token) wait in a pending buffer of the slot. Prompt chunks are caught up as
the target caches them (prefilled: pairs start .. start + n - 1, the tokens after them read from
the prompt). A verify step's pairs (verified: pair n + j is the target's hidden state at n + j and
the j-th appended token, for each of the row's S verified positions) join the pending buffer at
offset n - caught, on the device; those past the accepted ones are junk past the new last
position n', overwritten by the next step's before anything reads them. A row catches up on its
pending pairs in one forward when it drafts (or when its buffer would overflow), and its stored
output becomes pair n - 1's, whose logits give the first draft: steps that do not draft cost the
head nothing but the copy. A row whose buffer fills without its having drafted since its pairs
were last caught up is given up: the head drafts no more for its sequence and keeps nothing of it
(a chain's lookup, or plain decoding, goes on alone), since its pairs would cost a head forward
each for no draft. Drafting writes entries at n and past it, which the next catch-up
overwrites: rollback is by length, as in the target's cache. Where the target replays CUDA graphs
the catch-up runs at every verify step instead, in graphs of its own (head_graphs.py), the
pending buffer is not allocated, and `caught` follows the accepted tokens.

Drafting (propose) is one forward per depth over all drafting rows. The first depth's candidates
are the top `tree_width` tokens of the stored output's logits; each further depth feeds the
frontier (the tree_width best nodes by cumulative log-probability) at rotary position n + depth -
2, each node's feature its parent's output and its entry at its own place past n, attending to the
row's entries before n, its ancestors' entries and its own; each frontier node's top tree_width
children become candidates. A row's draft is its budget's best candidates by cumulative
log-probability (a child never scores above its parent, so every chosen node's parent is chosen);
with tree_width 1 that is the greedy chain, which _chains drafts without the tree's scores and
masks, each chain ending before its first draft whose probability is below p_min (chains drafted
in CUDA graphs keep their captured depth). Drafts are the head's argmax choices: one-hot drafts, which greedy and rejection-sampling
verification keep lossless.

Where the target replays CUDA graphs, the catch-up of verified rows and the drafting of chains
replay graphs of their own (head_graphs.py), and a greedy step's chains are drafted inside the
target's own graph (HeadGraphStep, so that such a step can be launched ahead of the host's read),
as are its trees (HeadTreeGraphStep); prompt chunks, sampled rows' trees and the chains the
controller gives a tree head run the forwards here eagerly.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from outpace.config import MAX_NUM_DRAFT_TOKENS
from outpace.engine.scheduler import common_prefix
from outpace.kernels import cpu_kernels
from outpace.kernels.fused import linear, rope_store
from outpace.kernels.cpu_linear import QuantizedLinear, QuantizedParts, pack_linears, quantize_linears
from outpace.model.draft_head import DraftHead, attend
from outpace.model.eagle3 import load_eagle3_head
from outpace.model.mtp import load_mtp_head
from outpace.runner.calibrate import batch_buckets, settle
from outpace.runner.staging import to_device
from outpace.speculative.drafter import DraftBatch, DraftContext, Drafter, Drafts, KeptKeys, Prefilled, Verified
from outpace.speculative.head_graphs import (HeadGraphs, HeadGraphStep, HeadTreeGraphStep, frontier_depth,
                                             frontier_mask, grow_frontier)

# verify steps' pairs a row may hold pending beyond one step's before it catches up undrafted
PENDING_STEPS = 32
PRICE_DECAY = 0.9           # per drafting step, on the CPU's measured seconds of a catch-up and a drafted token
# a measure counts as at most this many times the larger of the price and the measure before it:
# one stalled propose (200 ms) had set the price of a drafted token to 100 times its work, and the
# head never drafted again to measure it anew; a slowdown that lasts is followed from its second
# measure on
PRICE_OUTLIER = 4.0
# per plain step of a batch bucket, on the CPU: the share of its prices kept, the rest moved toward
# the load-time measures. A slowdown that lasted long enough to price the head out left it priced
# out for good after it passed: a head that does not draft never measures its price again. At 1% a
# step the price comes back within a few hundred plain steps (a second or two), while a slowdown
# that lasts costs a drafting step now and then, which measures it again
PRICE_RELAX = 0.99
# (context, cache length) -> the head, loaded and checked against the target
HeadLoader = Callable[[DraftContext, int], DraftHead]


class HeadDrafter(Drafter):
    name = "head"
    priced_after_drafting = False       # every draft position costs a head forward
    # behind n-gram lookup: the shipped head's drafts beat a 1-token match's, a 2-token match's beat
    # the head's (benchmarks/head_acceptance.py; docs/BENCHMARKS.md, the EAGLE-3 head)
    lookup_yields_below = 2

    def __init__(self, load: HeadLoader, tree_width: int = 1, p_min: float = 0.0):
        self.load = load
        self.tree_width = tree_width
        self.p_min = p_min
        self.tokens: dict[int, list[int]] = {}      # seq_id -> its tokens: the prompt, then those accepted
        self.ready: dict[int, bool] = {}            # seq_id -> its prompt is caught up
        self.caught: dict[int, int] = {}            # seq_id -> pairs before this position are in the head's cache
        self.drafted: set[int] = set()              # sequences that drafted since their pairs were last caught up
        self.given_up: set[int] = set()             # sequences the head drafts no more for (pending path)
        self.per_token: dict[int, float] = {}       # batch bucket -> seconds per drafted token
        self.per_step: dict[int, float] = {}        # batch bucket -> seconds of a step's catch-up
        self.measured: dict[int, tuple[float, float]] = {}     # batch bucket -> both prices as measured at load
        self.last_measured: dict[tuple[str, int], float] = {}   # (price, bucket) -> its last measure
        self.caught_up = (0.0, 0)                   # the last propose's catch-up (_catch_up_pending's return)
        self.step: HeadGraphStep | None = None      # the head's part of the target's graph step, if any

    def bind(self, context: DraftContext) -> None:
        # past the context: a verify row's positions, and the entries of a tree's nodes
        self.cache_len = context.max_len + context.max_step_tokens + MAX_NUM_DRAFT_TOKENS * self.tree_width
        self.head = head = self.load(context, self.cache_len)
        head.fuse_qkv()
        if context.device.type == "cpu":        # its products in the CPU kernels, as the target's
            is_quantized = any(isinstance(m, (QuantizedLinear, QuantizedParts)) for m in context.target.modules())
            if is_quantized:
                # every product in Q4_0: a catch-up streams the head's weights from memory after
                # the target's step has pushed them out of the caches, so bytes are its time; on an
                # AVX-512 EPYC the head alone read 4% faster than with Q8_0 products (the LM head
                # Q4_0 in both), accepting as many drafts (docs/BENCHMARKS.md, "CPU: EAGLE-3 head")
                quantize_linears(head)
            else:
                pack_linears(head)
            head.kernels = cpu_kernels.pointwise_fits(context.dtype, context.device)
        # causal forwards (catch-ups, chains) in the target's attention kernel (_causal_forward)
        self.kernel_attention = cpu_kernels.attention_fits(head.cfg, context.dtype, context.device)
        cfg = head.cfg
        self.hidden_layers = cfg.target_layers
        self.kept_keys = KeptKeys(context.prefix_key)        # a slot's pairs: the tokens of those held, and one
        self.embed = head.embed if head.embed is not None else context.target.embed
        # and, where the kernels compute the whole head, each forward or chain in one call
        self.pair = head.cpu_pair_head(self.embed, context.dtype) if self.kernel_attention else None
        shape = (context.num_slots, cfg.num_kv_heads, self.cache_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.v_cache = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.last_out = torch.zeros(context.num_slots, cfg.hidden_size, dtype=context.dtype, device=context.device)
        self.device = context.device
        self._heads = torch.arange(cfg.num_kv_heads, device=self.device)[None, :, None]
        # on a GPU: the rotary tables in the activations' dtype, read by project_store's one kernel
        self.rope_tables = None
        if context.device.type == "cuda" and not cfg.qk_norm:
            self.rope_tables = (head.rope_cos.to(context.dtype), head.rope_sin.to(context.dtype))
        # where the target replays graphs the head's catch-up and chains do too (head_graphs.py)
        self.graphs = None
        if context.graphs:
            self.graphs = HeadGraphs(self, context.num_slots, context.max_len, context.max_step_tokens,
                                     context.max_step_tokens - 1, chains=self.tree_width == 1)
        else:       # verified pairs wait here until their row drafts (or the buffer fills)
            self.max_pending = context.max_step_tokens + PENDING_STEPS
            self.pending_hidden = torch.zeros(context.num_slots, self.max_pending, len(self.hidden_layers),
                                              cfg.target_hidden_size, dtype=context.dtype, device=self.device)
            self.pending_tokens = torch.zeros(context.num_slots, self.max_pending, dtype=torch.long,
                                              device=self.device)
        if self.graphs is not None and self.graphs.draft_shapes:
            self.per_token = self.graphs.measure()
        else:
            self._measure(context.num_slots)

    def _measure(self, num_slots: int) -> None:
        """By batch bucket, seconds per drafted token (a forward of b rows of one pair and its
        logits, over b) and of a step's catch-up (b rows of two pairs: an accepted draft and the
        target's own token). Writes entries at positions 0 and 1 of the slots it uses and their
        stored outputs; prefills overwrite them."""
        cfg = self.head.cfg
        for b in batch_buckets(num_slots):
            slots = torch.arange(b, device=self.device)
            zeros = torch.zeros(b, 1, dtype=torch.long, device=self.device)
            hidden = self.last_out.new_zeros(b, 2, len(self.hidden_layers), cfg.target_hidden_size)

            def draft():
                self._pick(self._causal_forward(self.last_out.new_zeros(b, 1, cfg.hidden_size), zeros, slots,
                                                zeros, 1)[:, 0])

            def catch_up():
                self._catch_up(hidden, torch.zeros(b, 2, dtype=torch.long, device=self.device), list(range(b)),
                               [0] * b, zeros[:, 0])

            self.per_token[b] = self._seconds(draft) / b
            self.per_step[b] = self._seconds(catch_up)
            self.measured[b] = (self.per_token[b], self.per_step[b])

    def _seconds(self, run: Callable[[], None]) -> float:
        """run()'s seconds, settled as the verify cost's shapes are (calibrate.settle: three
        timings at least, more on a busy machine until two agree)."""
        def once() -> float:
            t0 = time.perf_counter()
            run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - t0
        return settle(once, 3)[0]

    def cost_per_token(self, batch_size: int) -> float:
        # drafting inside the target's graphs is part of the verify forward the engine calibrates
        if self.step is not None:
            return 0.0
        return self.per_token[self._bucket(batch_size)]

    def step_cost(self, batch_size: int) -> float:
        """A drafting step's catch-up of the pairs its rows' last steps accepted: one forward of
        every drafting row, whatever their drafts' lengths (under graphs, the verify forward's)."""
        if self.step is not None or not self.per_step:
            return 0.0
        return self.per_step[self._bucket(batch_size)]

    def graph_step(self, max_rows: int, max_tokens: int) -> HeadGraphStep | None:
        """Where the head's catch-up replays graphs, its part of the target's graph step: greedy
        rows' chains (HeadGraphStep), or trees of tree_width (HeadTreeGraphStep), drafted and
        verified inside the target's graph."""
        if self.graphs is not None:
            self.step = (HeadGraphStep(self.graphs, max_rows, max_tokens) if self.tree_width == 1
                         else HeadTreeGraphStep(self.graphs, max_rows, max_tokens, self.tree_width))
        return self.step

    def _bucket(self, batch_size: int) -> int:
        return min((b for b in self.per_token if b >= batch_size), default=max(self.per_token))

    # ---- the head's forward over its cache ------------------------------------------------------
    def project_store(self, feature, tokens, slots, rope_positions, write_positions):
        """Pairs of B rows: feature [B, S, H], tokens [B, S] (the target's ids), slots [B], rotary
        and cache positions [B, S]. Writes the pairs' keys and values, returns (residual, q)."""
        if self.rope_tables is not None:
            # one product for q, k and v, then the rotation and both cache writes in one kernel
            # inside CUDA graphs (fused.rope_store), as the target's attention does
            cfg = self.head.cfg
            residual, qkv = self._qkv(feature, tokens)
            qkv = qkv.unflatten(-1, (-1, cfg.head_dim))                                 # [B, S, H+2KVH, D]
            cos, sin = (table[rope_positions].unsqueeze(-2) for table in self.rope_tables)
            split = cfg.num_heads + cfg.num_kv_heads
            q = rope_store(qkv[:, :, :split], qkv[:, :, split:], cos, sin, self.k_cache, self.v_cache, slots,
                           self._heads, write_positions)
            return residual, q.transpose(1, 2)
        residual, q, k, v = self.head.project(feature, self.embed(tokens), rope_positions)
        index = (slots[:, None, None], self._heads, write_positions[:, None, :])        # [B, KVH, S]
        self.k_cache.index_put_(index, k.transpose(1, 2).to(self.k_cache.dtype))
        self.v_cache.index_put_(index, v.transpose(1, 2).to(self.v_cache.dtype))
        return residual, q

    def _qkv(self, feature, tokens):
        """Pairs (feature [B, S, H], tokens [B, S]) -> (residual [B, S, H], their query, key and
        value heads in one product [B, S, (H + 2 KVH) D], unrotated)."""
        residual, x = self.head.attention_input(feature, self.embed(tokens))
        return residual, linear(x, self.head.qkv)

    def _forward(self, feature, tokens, slots, rope_positions, write_positions, mask) -> torch.Tensor:
        """project_store's pairs, each query attending to its slot's entries through mask
        [B, 1, S, L]: their outputs [B, S, H]."""
        residual, q = self.project_store(feature, tokens, slots, rope_positions, write_positions)
        L = mask.shape[-1]
        keys = self.k_cache[:, :, :L].index_select(0, slots)
        values = self.v_cache[:, :, :L].index_select(0, slots)
        return self.head.finish(residual, attend(q, keys, values, mask))

    def _causal_forward(self, feature, tokens, slots, positions, kv_len: int) -> torch.Tensor:
        """Pairs at positions [B, S] (rotary and cache positions alike, all below kv_len), each
        attending to its slot's entries up to its own position: their outputs [B, S, H]. On the CPU
        one call of the target's attention kernel rotates, writes and attends, where PyTorch takes
        a mask and a dozen calls (a head forward there is mostly such calls' overhead); where the
        kernels compute the whole head (self.pair), the whole forward is one call."""
        if not self.kernel_attention:
            mask = torch.arange(kv_len, device=self.device) <= positions[:, :, None]
            return self._forward(feature, tokens, slots, positions, positions, mask[:, None])
        if self.pair is not None:
            return self.pair.layer(feature, tokens, self.k_cache, self.v_cache, slots, positions)
        head, cfg = self.head, self.head.cfg
        residual, qkv = self._qkv(feature, tokens)
        qkv = qkv.contiguous()
        qk = None
        if head.q_norm is not None:
            heads = qkv.unflatten(-1, (-1, cfg.head_dim))
            qk = torch.cat([head.normed(head.q_norm, heads[..., :cfg.num_heads, :]),
                            head.normed(head.k_norm, heads[..., cfg.num_heads:cfg.num_heads + cfg.num_kv_heads, :])],
                           -2).contiguous()
        cos, sin = (table[positions].to(qkv.dtype) for table in (head.rope_cos, head.rope_sin))
        out = cpu_kernels.rope_attend(qkv, cfg.num_heads, cos, sin, self.k_cache, self.v_cache, slots, positions,
                                      None, qk)
        return head.finish(residual, out.view(*tokens.shape, -1))

    def _catch_up(self, hidden, tokens, slots: list[int], starts: list[int], last) -> None:
        """Pairs at positions starts[i] + j of B rows in slots (the target's hidden states
        [B, S, layers, H] there, tokens [B, S] the tokens after them), each attending causally to
        its slot's entries; the slot's stored output becomes that of pair last[i] ([B])."""
        B, S = tokens.shape
        device = self.device
        slots = to_device(slots, device)
        positions = to_device([list(range(start, start + S)) for start in starts], device)     # [B, S]
        out = self._causal_forward(self.head.features(hidden), tokens, slots, positions, max(starts) + S)
        self.last_out[slots] = out[torch.arange(B, device=device), last]

    # ---- sequences ------------------------------------------------------------------------------
    def begin(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self.tokens[seq_id] = list(token_ids)
        self.ready[seq_id] = False
        self.caught[seq_id] = 0

    def accept(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self.tokens[seq_id] += token_ids
        if self.graphs is not None:     # every verified pair was caught up in its step
            self.caught[seq_id] = len(self.tokens[seq_id]) - 1

    def _pairs_beginning(self, seq_id: int, held: list[int], num_pairs: int) -> int:
        """Of num_pairs pairs held for the tokens `held`, those that begin the sequence (pair p
        needs tokens p and p + 1 alike), short of its prompt's last pair, which a chunk computes so
        that the slot's stored output is the prompt's."""
        tokens = self.tokens[seq_id]
        return max(0, min(num_pairs, common_prefix(held, tokens) - 1, len(tokens) - 2))

    def reusable_prefix(self, seq_id: int, slot: int) -> int:
        """The pairs the slot kept that begin the sequence."""
        kept = self.kept_keys.matching(seq_id, slot)
        return self._pairs_beginning(seq_id, kept, len(kept) - 1)

    def shareable_prefix(self, source_id: int, seq_id: int) -> int:
        """The source's caught-up pairs that begin the sequence."""
        return self._pairs_beginning(seq_id, self.tokens[source_id], self.caught[source_id])

    def copy_prefix(self, source_id: int, source_slot: int, seq_id: int, slot: int, length: int) -> None:
        self.kept_keys.adopt(seq_id, slot)
        for cache in (self.k_cache, self.v_cache):
            cache[slot, :, :length] = cache[source_slot, :, :length]
        self.caught[seq_id] = length

    def end(self, seq_id: int) -> None:
        """The slot keeps the pairs before `caught`, for a later sequence."""
        if seq_id in self.tokens:
            self.kept_keys.end(seq_id, self.tokens[seq_id][:self.caught[seq_id] + 1])
        self.tokens.pop(seq_id, None)
        self.ready.pop(seq_id, None)
        self.caught.pop(seq_id, None)
        self.drafted.discard(seq_id)
        self.given_up.discard(seq_id)

    @torch.inference_mode()
    def prefilled(self, chunks: Prefilled) -> None:
        """Pairs of the cached prompt positions; the tokens after them come from the prompt."""
        S = max(chunks.lengths)
        tokens = [self.tokens[s][start + 1:start + 1 + n] + [0] * (S - n)
                  for s, start, n in zip(chunks.seq_ids, chunks.starts, chunks.lengths)]
        self._catch_up(chunks.hidden[:, :S], to_device(tokens, self.device), chunks.slots, chunks.starts,
                       to_device([n - 1 for n in chunks.lengths], self.device))
        for seq_id, slot, start, n in zip(chunks.seq_ids, chunks.slots, chunks.starts, chunks.lengths):
            self.kept_keys.adopt(seq_id, slot)     # the target reused no more than reusable_prefix
            self.ready[seq_id] = start + n == len(self.tokens[seq_id]) - 1
            self.caught[seq_id] = start + n

    @torch.inference_mode()
    def verified(self, result: Verified) -> None:
        """Every verified position of each row as a pair (junk past the accepted ones): caught up
        now where graphs replay the catch-up, else kept pending until the row drafts (or given up,
        module docstring)."""
        batch = result.batch
        S = result.out_tokens.shape[1]
        if self.measured and not any(batch.budget):       # a plain step (prices move on the CPU alone)
            self._relax(self._bucket(len(batch)))
        for seq_id, slot in zip(batch.seq_ids, batch.slots):     # a prompt of one token has no chunk
            self.kept_keys.adopt(seq_id, slot)
        if self.graphs is not None:
            if not self.graphs.catch_up(result):
                self._catch_up(result.hidden[:, :S], result.out_tokens, batch.slots, batch.positions,
                               result.num_out - 1)
            for seq_id in batch.seq_ids:
                self.ready[seq_id] = True
            return
        # the step's pairs start at each row's last token n (host-known), at offset n - caught of
        # its pending pairs; a row whose buffer would overflow catches up first where it drafted
        # since its last catch-up, and is given up where it did not
        full = [i for i, (s, n) in enumerate(zip(batch.seq_ids, batch.positions))
                if s not in self.given_up and n - self.caught[s] + S > self.max_pending]
        self._catch_up_pending(batch, [i for i in full if batch.seq_ids[i] in self.drafted])
        for i in full:
            s = batch.seq_ids[i]
            if s in self.drafted:
                self.drafted.discard(s)
            else:
                self.given_up.add(s)
                self.ready[s] = False
        kept = [i for i, s in enumerate(batch.seq_ids) if s not in self.given_up]
        if not kept:
            return
        if len(kept) < len(batch):
            index = to_device(kept, self.device)
            result = Verified(batch.subset(kept), result.out_tokens[index], result.num_out[index],
                              result.hidden[index])
            batch = result.batch
        # each row's pairs are S consecutive entries of its slot: on the CPU a slice copy a row (an
        # indexed write of them all took about 70 us more a step at one row), on a device one
        # indexed write (a launch a row would cost more)
        hidden, tokens = result.hidden[:, :S].to(self.pending_hidden.dtype), result.out_tokens[:, :S]
        offsets = [n - self.caught[s] for s, n in zip(batch.seq_ids, batch.positions)]
        if self.device.type == "cpu":
            for i, (slot, offset) in enumerate(zip(batch.slots, offsets)):
                self.pending_hidden[slot, offset:offset + S] = hidden[i]
                self.pending_tokens[slot, offset:offset + S] = tokens[i]
        else:
            at = to_device(offsets, self.device)[:, None] + torch.arange(S, device=self.device)    # [B, S]
            slots = to_device(batch.slots, self.device)[:, None].expand(-1, S)
            self.pending_hidden[slots, at] = hidden
            self.pending_tokens[slots, at] = tokens
        for seq_id in batch.seq_ids:        # a prompt of one token has no chunk to catch up
            self.ready[seq_id] = True

    def _catch_up_pending(self, batch: DraftBatch, rows: list[int]) -> tuple[float, int]:
        """The pending pairs of the batch's rows `rows` (whose last tokens sit at batch.positions n:
        pairs caught .. n - 1, complete) in one forward: each slot's stored output becomes pair
        n - 1's. Returns the seconds it took and the most pairs a row caught up (0, 0 where none
        had any)."""
        rows = [i for i in rows if batch.positions[i] > self.caught[batch.seq_ids[i]]]
        if not rows:
            return 0.0, 0
        t0 = time.perf_counter()
        seq_ids, slots = [batch.seq_ids[i] for i in rows], [batch.slots[i] for i in rows]
        ends = [batch.positions[i] for i in rows]
        starts = [self.caught[s] for s in seq_ids]
        counts = [n - start for n, start in zip(ends, starts)]
        S = max(counts)
        index = to_device(slots, self.device)
        self._catch_up(self.pending_hidden[index, :S], self.pending_tokens[index, :S], slots, starts,
                       to_device(counts, self.device) - 1)
        for s, n in zip(seq_ids, ends):
            self.caught[s] = n
        return time.perf_counter() - t0, S

    # ---- drafting -------------------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> Drafts:
        """Drafts of the rows with a budget. On the CPU, where a call's time is its work, the
        seconds drafting took price the next steps of its batch bucket (decayed means), not the
        load-time measures alone: between the target's steps the head's weights are no longer in
        the caches that measure found them in. The catch-up prices a step and the rest each drafted
        token: a step pays its catch-up once whatever its draft's length, so one price for both
        would make a second token look as dear as the first, catch-up and all. A catch-up of more
        pairs than a verify step at this step's budget gives a row (its first draft after steps
        without) is left out of the step's price: priced in, it could keep the head from drafting,
        and so from measuring the price again."""
        t0 = time.perf_counter()
        self.caught_up = (0.0, 0)
        drafts = self._propose(batch)
        if self.device.type == "cpu" and drafts.num_draft_host:
            b = self._bucket(len(batch))
            catch_up, pairs = self.caught_up
            if tokens := sum(drafts.num_draft_host):
                self._price(self.per_token, "token", b, (time.perf_counter() - t0 - catch_up) / tokens)
            # a step whose chains p_min cut to nothing still paid its catch-up
            if 0 < pairs <= 1 + max(batch.budget):
                self._price(self.per_step, "step", b, catch_up)
        return drafts

    def _price(self, prices: dict[int, float], name: str, bucket: int, seconds: float) -> None:
        """Move a price a step of PRICE_DECAY toward a measure, the measure held to PRICE_OUTLIER
        times the larger of the price and the last measure."""
        last = self.last_measured.get((name, bucket), prices[bucket])
        self.last_measured[name, bucket] = seconds
        seconds = min(seconds, PRICE_OUTLIER * max(prices[bucket], last))
        prices[bucket] = PRICE_DECAY * prices[bucket] + (1 - PRICE_DECAY) * seconds

    def _relax(self, bucket: int) -> None:
        """A plain step of the bucket moves its prices a step of PRICE_RELAX toward their load-time
        measures."""
        for prices, measured in zip((self.per_token, self.per_step), self.measured[bucket]):
            prices[bucket] = PRICE_RELAX * prices[bucket] + (1 - PRICE_RELAX) * measured

    @torch.inference_mode()
    def _propose(self, batch: DraftBatch) -> Drafts:
        rows = [i for i, (s, k) in enumerate(zip(batch.seq_ids, batch.budget)) if k > 0 and self.ready.get(s)]
        if not rows:
            return Drafts.empty(len(batch), self.device)
        if self.graphs is not None and self.graphs.draft_shapes:
            return self.graphs.propose(batch, rows)
        if self.graphs is None:
            self.caught_up = self._catch_up_pending(batch, rows)
            self.drafted.update(batch.seq_ids[i] for i in rows)
        budget = [batch.budget[i] for i in rows]
        slots = to_device([batch.slots[i] for i in rows], self.device)
        positions = [batch.positions[i] for i in rows]
        starts = to_device(positions, self.device)
        drafts: list[list[int]] = [[] for _ in range(len(batch))]
        width = batch.tree_width or self.tree_width      # the controller may ask a chain of a tree drafter
        if width == 1:
            chains, lengths = self._chains(slots, starts, max(budget), max(positions))
            # the one host read of drafting: each chain with its length as its last column
            for i, n, chain in zip(rows, budget, torch.cat([chains, lengths[:, None]], 1).tolist()):
                drafts[i] = chain[:min(n, chain[-1])]
            return Drafts.from_lists(drafts, device=self.device)
        tokens, scores, parents = self._candidates(slots, starts, max(budget), max(positions), width)
        best = torch.sort(-scores, dim=1, stable=True).indices[:, :max(budget)]   # ties: parents first
        trees: list[list[int]] = [[] for _ in range(len(batch))]
        # the one host read of drafting
        for i, n, order, toks, pars in zip(rows, budget, best.tolist(), tokens.tolist(), parents.tolist()):
            chosen = sorted(order[:n])                  # creation order: a parent before its children
            node = {c: j for j, c in enumerate(chosen)}
            drafts[i] = [toks[c] for c in chosen]
            trees[i] = [node[pars[c]] if pars[c] >= 0 else -1 for c in chosen]
        return Drafts.from_lists(drafts, device=self.device, parents=trees)

    def _chains(self, slots: torch.Tensor, starts: torch.Tensor, depth: int,
                max_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """_candidates' tree of width 1, without its scores and tree bookkeeping: the head's argmax
        chain [R, depth] (the target's ids) of R rows whose last tokens sit at starts [R], and each
        chain's length [R]: its drafts before the first whose probability is below p_min. Draft d
        (from 1) is fed at rotary position start + d - 1, writes its entry there and attends to
        it and every entry before it."""
        out = self.last_out[slots]                                              # [R, H]
        if self.pair is not None:       # it stops once every chain ended
            return self.pair.chain(out, self.k_cache, self.v_cache, slots, starts, depth, self.p_min)
        lengths = torch.full((len(slots),), depth, device=self.device)
        chain = []
        for d in range(depth):      # no host read to stop early where every chain ended: a device would wait
            if d:
                at = (starts + d - 1)[:, None]                                  # [R, 1]
                out = self._causal_forward(out[:, None], chain[-1][:, None], slots, at, max_start + d)[:, 0]
            ids, top = self._pick(out)
            chain.append(ids)
            if top is not None:
                lengths = torch.where((top < self.p_min) & (lengths == depth), d, lengths)
        return torch.stack(chain, 1), lengths

    def _pick(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's draft from outputs out [R, H] (the target's ids [R]) and, where p_min stops
        chains, its probability [R] (None where it does not)."""
        logits = self.head.logits(out)
        top = logits.float().softmax(-1).amax(-1) if self.p_min > 0 else None
        return self.head.to_target(logits.argmax(-1)), top

    def _candidates(self, slots: torch.Tensor, starts: torch.Tensor, num_nodes: int, max_start: int, k: int):
        """The candidate nodes of trees of width k for R rows whose last tokens sit at positions
        starts [R] (at most max_start): tokens
        (the target's ids), cumulative log-probabilities and parents (candidate indices, -1 for
        children of the last token), each [R, C] in creation order."""
        R = len(slots)
        depth = frontier_depth(num_nodes, k)
        T = (depth - 1) * k                                     # entries past each row's start the tree uses
        out = self.last_out[slots][:, None]                     # [R, 1, H]
        score, draft_ids = torch.log_softmax(self.head.logits(out[:, 0]), -1).topk(k)       # [R, k]
        frontier = torch.arange(k, device=self.device).expand(R, k)                         # candidate indices
        feature = out.expand(R, k, -1)
        tokens, scores, parents = [self.head.to_target(draft_ids)], [score], [torch.full_like(frontier, -1)]
        fed = tokens[0]                                         # the frontier's tokens
        seen = torch.zeros(R, k, max(T, 1), dtype=torch.bool, device=self.device)       # ancestors' entries
        L = max_start + T
        place = torch.arange(L, device=self.device)[None, :] - starts[:, None]             # [R, L]: key - start
        for d in range(1, depth):
            own = (d - 1) * k + torch.arange(k, device=self.device)                        # the frontier's entries
            seen[:, :, own] |= torch.eye(k, dtype=torch.bool, device=self.device)
            # keys before the row's start, and the node's own and its ancestors' entries
            mask = frontier_mask(seen, place)
            out = self._forward(feature, fed, slots, (starts + d - 1)[:, None].expand(R, k), starts[:, None] + own,
                                mask[:, None])
            score, frontier, fed, feature, seen = grow_frontier(self.head, out, score, frontier, tokens, scores,
                                                                parents, seen)
        return torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)


def eagle3_head(folder: str) -> HeadLoader:
    return lambda context, cache_len: load_eagle3_head(Path(folder).expanduser(), context.target.cfg, context.dtype,
                                                       context.device, cache_len)


def mtp_head(folder: str) -> HeadLoader:
    return lambda context, cache_len: load_mtp_head(Path(folder).expanduser(), context.target, context.dtype,
                                                    context.device, cache_len)


# SpecConfig method -> the head it loads from SpecConfig.draft_head
HEADS = {"eagle3": eagle3_head, "mtp": mtp_head}
