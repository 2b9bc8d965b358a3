"""DeviceNgramDrafter: prompt lookup whose state is one token buffer on the device.

The same drafts as NgramDrafter (ngram.py), token for token: the semantics and the batched
tensor math are ngram_gpu.py's. The buffer `tokens [max_seqs, max_len]` holds prompt plus output of
every sequence that has drafted; one batched propose per step covers all of its rows, and the
verified tokens are appended on the device from the verifier's own output tensors, so drafting
costs no host round trip. On CUDA the propose over all rows is one captured CUDA graph.

Rows are taken lazily: a sequence keeps its tokens on the host (`pending`) until it first asks for
a draft, so requests waiting in the queue or decoding plainly hold no row, and at most max_seqs
(the running sequences) ever do. One more row, the scratch row, takes the writes of graph rows
that have no row of their own.

With CUDA graphs and greedy rows the whole step is one graph: GraphDrafting is the drafter's part of
the runner's captured step (drafting into each row's input tokens before the forward, greedy
verification and the append after it), replacing some forty small launches from the host.
"""
from __future__ import annotations

from typing import Sequence

import torch

from outpace.config import SpecConfig
from outpace.kernels.fused import cuda_compiled
from outpace.runner.staging import to_device
from outpace.speculative import ngram_gpu
from outpace.speculative.drafter import DraftBatch, Drafter, Drafts, Verified
from outpace.sampling.rejection import verify_greedy


class DeviceNgramDrafter(Drafter):
    name = "ngram-device"
    priced_after_drafting = False

    def __init__(self, spec: SpecConfig, max_seqs: int, max_len: int, device: torch.device | str,
                 use_graph: bool = True):
        self.min_ngram, self.max_ngram, self.match = spec.min_ngram, spec.max_ngram, spec.match
        self.num_draft_tokens = spec.num_draft_tokens
        self.device = torch.device(device)
        self.tokens, self.lengths = ngram_gpu.new_buffer(max_seqs + 1, max_len, self.device)
        self.scratch = max_seqs                        # the last row: writes nobody reads
        self.all_rows = torch.arange(max_seqs, device=self.device)
        self.rows: dict[int, int] = {}                 # seq_id -> buffer row
        self.free_rows = list(range(max_seqs - 1, -1, -1))
        self.pending: dict[int, list[int]] = {}        # seq_id -> host tokens, no row yet
        # propose's output for every row, [max_seqs, num_draft_tokens] and [max_seqs]: graph outputs
        self.draft_all = torch.zeros(max_seqs, self.num_draft_tokens, dtype=torch.long, device=self.device)
        self.num_all = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self.graph = None
        if use_graph and self.device.type == "cuda":
            self._capture()

    def _propose_all(self) -> None:
        draft, num = ngram_gpu.propose(self.tokens, self.lengths, self.all_rows, self.num_draft_tokens,
                                       self.min_ngram, self.max_ngram, self.match)
        self.draft_all.copy_(draft)
        self.num_all.copy_(num)

    def _capture(self) -> None:
        self._propose_all()                             # warm-up outside the capture
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._propose_all()

    # ---- the Drafter interface -----------------------------------------------------------------
    def begin(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self.pending[seq_id] = list(token_ids)

    def accept(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Host tokens: only sequences without a row need them (rows take append's device tensors)."""
        if seq_id in self.pending:
            self.pending[seq_id] += token_ids

    def end(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Drafts:
        """Drafts of at most budget[i] (<= num_draft_tokens) tokens, on the device; K = max(budget)."""
        for seq_id, k in zip(batch.seq_ids, batch.budget):
            if k > 0 and seq_id not in self.rows:
                self._take_row(seq_id)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._propose_all()
        rows = [self.rows.get(s, 0) for s in batch.seq_ids]     # a sequence without a row asks for 0
        rows_t, budget = to_device([rows, list(batch.budget)], self.device)
        tokens = self.draft_all.index_select(0, rows_t)[:, :max(batch.budget)]       # [B, K]
        num = torch.minimum(self.num_all.index_select(0, rows_t), budget)             # [B]
        return Drafts(tokens, num)

    @torch.inference_mode()
    def verified(self, result: Verified) -> None:
        """out_tokens[i, :num_out[i]] join sequence i's row, on the device. Tokens past a stop the
        host finds later are appended too: that sequence ends."""
        seq_ids = result.batch.seq_ids
        index = [i for i, s in enumerate(seq_ids) if s in self.rows]
        if not index:
            return
        rows_t, index_t = to_device([[self.rows[seq_ids[i]] for i in index], index], self.device)
        out_tokens, num_out = result.out_tokens, result.num_out
        if len(index) < len(seq_ids):
            out_tokens, num_out = out_tokens.index_select(0, index_t), num_out.index_select(0, index_t)
        ngram_gpu.append(self.tokens, self.lengths, rows_t, out_tokens, num_out)

    def graph_step(self, max_rows: int, max_tokens: int) -> "GraphDrafting":
        return GraphDrafting(self, max_rows, max_tokens)

    def _take_row(self, seq_id: int) -> None:
        if not self.free_rows:
            raise RuntimeError("the n-gram token buffer has no free row: more drafting sequences than max_seqs")
        row = self.free_rows.pop()
        ngram_gpu.write_row(self.tokens, self.lengths, row, self.pending.pop(seq_id))
        self.rows[seq_id] = row


class GraphDrafting:
    """The drafter's part of CudaGraphRunner's step, for graph rows r < b holding t tokens:
    before the forward, row r drafts up to room[r] <= t-1 tokens from buffer row src[r] into its
    input tokens 1..t-1 (room 0 leaves what the host wrote there); after it, greedy verification
    appends the verified tokens to buffer row dst[r] and writes result[r] = [tokens out, tokens
    drafted, target tokens [t]]. Host inputs: `inputs` [3, max_rows] = src, dst, room, a view the
    runner binds into its one input copy. Rows without a step (idle slots, runner.forward called
    without inputs) get neutral() values: the scratch row and room 0."""

    width = 3
    max_paid = 0                # a chain's paying drafter drafts outside this step (GraphStep)

    def __init__(self, drafter: DeviceNgramDrafter, max_rows: int, max_tokens: int):
        self.drafter = drafter
        device = drafter.device
        # what its work in a step depends on (calibrate.measure_verify_cost's key)
        self.cost_key = f"ngram {drafter.max_ngram} {drafter.tokens.shape[1]}"
        self.inputs_view: torch.Tensor | None = None    # [3, rows], bound by the runner
        self.num_draft = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.result = torch.zeros(max_rows, 2 + max_tokens, dtype=torch.long, device=device)

    def inputs(self, seq_ids: Sequence[int], room: Sequence[int],
               claim: Sequence[bool] | None = None) -> list[tuple[int, int, int]]:
        """The host inputs per row of a greedy step: (row to draft from, row to append to, room).
        A sequence without a buffer row takes one now if it asks (room > 0) or claims one
        (claim[i]). (A sampled step verifies and appends on the host; its graph rows get
        neutral(), so the graph touches only the scratch row.)"""
        d = self.drafter
        out = []
        for i, (seq_id, k) in enumerate(zip(seq_ids, room)):
            if (k > 0 or (claim is not None and claim[i])) and seq_id not in d.rows:
                d._take_row(seq_id)
            row = d.rows.get(seq_id, d.scratch)
            out.append((row if k > 0 else d.scratch, row, k))
        return out

    def has_row(self, seq_id: int) -> bool:
        """Whether the sequence holds a buffer row (a launched step can draft only for those)."""
        return seq_id in self.drafter.rows

    def bind(self, inputs: torch.Tensor, starts: torch.Tensor) -> None:
        self.inputs_view = inputs.view(3, -1)

    def neutral(self) -> tuple[int, int, int]:
        return self.drafter.scratch, self.drafter.scratch, 0

    def before(self, b: int, t: int, input_ids: torch.Tensor) -> None:
        d = self.drafter
        d.lengths[d.scratch:].zero_()                   # the scratch row restarts empty every step
        if t == 1:
            self.num_draft[:b].zero_()
            return
        _draft_into(input_ids, d.tokens, d.lengths, self.inputs_view[0, :b], self.inputs_view[2, :b], self.num_draft[:b],
                    d.min_ngram, d.max_ngram, d.match)

    def after(self, b: int, t: int, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        d = self.drafter
        _verify_append(logits, input_ids, self.num_draft[:b], d.tokens, d.lengths, self.inputs_view[1, :b], self.result[:b])


@cuda_compiled
def _draft_into(input_ids, tokens, lengths, src, room, num_draft, min_ngram: int, max_ngram: int, match: str) -> None:
    """Rows with room draft from buffer rows src into input_ids[:, 1:] (num_draft: how many)."""
    draft, num = ngram_gpu.propose(tokens, lengths, src, input_ids.shape[1] - 1, min_ngram, max_ngram, match)
    num = torch.minimum(num, room)
    num_draft.copy_(num)
    input_ids[:, 1:] = torch.where(room[:, None] > 0, draft, input_ids[:, 1:])


@cuda_compiled
def _verify_append(logits, input_ids, num_draft, tokens, lengths, dst, result) -> None:
    """Greedy verification of input_ids[:, 1:], the verified tokens appended to buffer rows dst,
    result = [tokens out, tokens drafted, target tokens]."""
    target, num_out = verify_greedy(logits, input_ids[:, 1:], num_draft)
    ngram_gpu.append(tokens, lengths, dst, target, num_out)
    result[:, 0] = num_out
    result[:, 1] = num_draft
    result[:, 2:2 + target.shape[1]] = target
