"""CudaGraphRunner: decode and verify steps replay CUDA graphs captured once at start.

One graph per step shape (b, t, L): b a batch-size bucket, t the tokens per row (1 for plain
decoding, 1+k for verifying k drafts: one tier per draft length; exact mode has the one tier
1+num_draft_tokens), L a key-length bucket. Every graph reads and writes the same buffers,
allocated once at the largest shape (max_slots rows of max_tokens tokens over the whole cache): a
shape views their first entries ([b, t], [b, 1, t, L]). Switching shapes picks another graph;
nothing is reallocated or recaptured (a reallocation would leave every captured graph pointing at
freed memory).

A step's shape is static, so is everything in it:
  - keys: attention reads cache positions [0, L) of each slot, positions beyond a query's own
    masked. L is the smallest bucket (512, 1024, 2048, ... and the cache length) holding every
    row's positions, so attention's cost follows the context rather than the cache size. The cache
    length is rounded up to a multiple of 64: attention kernels run markedly slower on unaligned keys.
    Exact mode keeps L = the cache length, so no forward's arithmetic depends on the context either;
  - rows: graph row r is KV slot r for r < b, so the cache is read as a view. b is the smallest
    bucket above the highest slot in the step (the scheduler hands out the lowest free slot first,
    unless a higher one keeps a prefix of the prompt).
    A slot in the bucket with no row this step gets a dummy row whose writes land at positions
    >= max_len, the spare region no real query attends.
An extension (the drafter's graph_step, e.g. ngram_device.GraphDrafting) adds its own work before and after the model inside
every graph, fed by host values per graph row in the same input copy.

Overlap: a greedy step's successor can be launched before the host has read the step's tokens
(replay_next): each row's start and last token are derived on the device from the step's result,
so the GPU never idles while the host reads a step, and the host reads a step with a copy that
waits for that step alone (start_read, read_back), not for the one queued behind it.
Prompt chunks replay graphs too, one chunk at a time: shape (n, L) with n a prompt tier (16, 32,
64, ... up to max_prefill_tokens) holding the chunk, padded; the padding's keys land past the
chunk's end, where no query of the chunk attends and later tokens overwrite them. An eager
forward of a chunk was bound by its kernel launches (22-37 ms a Spec-Bench prompt on an H100).
Hidden states (a head drafter's): a runner built with hidden_layers has every graph, steps' and
chunks' alike, also write the residual stream after those layers into one static buffer
([queries, layers, H] at the largest step's or chunk's queries); a forward asking for exactly those
layers gets a view of it (a step's) or a copy (chunks', each replay overwriting the last). Built
without them, the runner allocates and copies nothing. Other layers, and shapes beyond the largest
tier, run eagerly through ModelRunner. With use_graphs=False (or on the CPU) decode steps run the
same static-buffer step eagerly (that is `--no-cuda-graphs`, and what the CPU tests check), and
prompt chunks run ModelRunner's unpadded forward.
"""
from __future__ import annotations

import bisect
import sys
import time

import torch
from tqdm import tqdm

from outpace.runner.calibrate import batch_buckets
from outpace.runner.model_runner import ModelRunner, Row
from outpace.runner.staging import HostSide, to_device
from outpace.kernels import fused
from outpace.model.decoder import DecoderLM
from outpace.model.layers import AttentionKind, ForwardBatch


class CudaGraphRunner(ModelRunner):
    greedy_logits = "all"       # a graph step's argmax is taken in the graph (step_result)

    def __init__(self, model: DecoderLM, num_slots: int, max_len: int, max_step_tokens: int,
                 exact_width: int | None = None, num_draft_tokens: int = 0, use_graphs: bool = True,
                 batch_sizes: list[int] | None = None, kv_lens: list[int] | None = None, progress: bool = True,
                 extension=None, max_prefill_tokens: int = 0, hidden_layers: tuple[int, ...] = (),
                 snapshots: bool = True):
        """num_draft_tokens: the most drafts a verify row holds (rows of 1 .. 1 + num_draft_tokens tokens).
        batch_sizes: the buckets (default 1, 2, 4, ... up to num_slots); kv_lens: the key-length
        buckets (default 512, 1024, ... below the cache length, and the cache length);
        max_prefill_tokens: the longest prompt chunk a graph holds (0: chunks run eagerly);
        hidden_layers: the layers whose hidden states every graph also writes (the drafter's; empty:
        none, at no cost); snapshots: a recurrent model's rollback (ModelRunner)."""
        cache_len = -(-(max_len + max_step_tokens) // 64) * 64
        super().__init__(model, num_slots, max_len, cache_len - max_len, exact_width, num_draft_tokens + 1, snapshots)
        if max(num_draft_tokens + 1, exact_width or 0) > max_step_tokens:
            raise ValueError(f"a step of {num_draft_tokens + 1} tokens per row needs max_step_tokens >= that")
        self.tiers = [exact_width] if exact_width else list(range(1, num_draft_tokens + 2))
        self.buckets = sorted(set(batch_sizes or batch_buckets(num_slots)))
        if self.buckets[-1] > num_slots:
            raise ValueError(f"batch size {self.buckets[-1]} exceeds the {num_slots} cache slots")
        self.cache_len = self.cache.max_len
        self.kv_lens = [self.cache_len] if exact_width else sorted(set(kv_lens or doublings(512, self.cache_len)))
        if max_prefill_tokens > max_step_tokens:
            raise ValueError(f"prompt chunks of {max_prefill_tokens} tokens need max_step_tokens >= that")
        # a recurrent model's prompt chunks run eagerly: a padded chunk's padding would be its tokens
        self.prefill_tiers = doublings(16, max_prefill_tokens) if max_prefill_tokens and not model.is_recurrent else []
        rows, tokens, vocab = self.buckets[-1], max(self.tiers), model.logit_rows
        device = self.device
        # The buffers, at the largest shape; shape (b, t) uses views of their first entries.
        # inputs: one buffer, so a step's host inputs arrive in one copy: [starts | extension's | input ids]
        self.extension = extension
        ext = rows * extension.width if extension else 0
        self.inputs = torch.zeros(rows + ext + rows * tokens, dtype=torch.long, device=device)
        self.starts = self.inputs[:rows]                                                # [b] position of token 0
        self.input_ids = self.inputs[rows + ext:]                                       # [b*t] -> [b, t]
        self.ids_at = rows + ext
        self.inputs_host = HostSide(self.inputs)        # written in place each step, sent in one copy
        is_cuda = torch.device(device).type == "cuda"
        if extension:
            extension.bind(self.inputs[rows:rows + ext], self.starts)
        # a prompt chunk's inputs: [slot, start, input ids], with their own host side
        chunk = max(self.prefill_tiers, default=0)
        self.chunk_inputs = torch.zeros(2 + chunk, dtype=torch.long, device=device)
        self.chunk_host = HostSide(self.chunk_inputs)
        queries = max(rows * tokens, chunk)             # a step's queries, or a chunk's
        self.positions = torch.zeros(queries, dtype=torch.long, device=device)          # [b*t] -> [b, t]
        # token trees' rotary positions (an extension that drafts them: its nodes' depths past the start)
        self.rope_positions = torch.zeros(queries, dtype=torch.long, device=device)
        self.mask = torch.zeros(queries * self.cache_len, dtype=torch.bool, device=device)  # -> [b, 1, t, L]
        # the mask as the additive bias attention takes without converting it in every layer
        self.bias = torch.zeros(queries * self.cache_len, dtype=self.dtype, device=device)  # -> [b, 1, t, L]
        self.bias_values = torch.tensor([0.0, float("-inf")], dtype=self.dtype, device=device)
        self.logits = torch.zeros(rows * tokens, vocab, dtype=torch.float32, device=device)       # -> [b, t, V]
        self.hidden_layers = tuple(hidden_layers)
        self.hidden = (torch.zeros(queries, len(hidden_layers), model.cfg.hidden_size, dtype=self.dtype, device=device)
                       if hidden_layers else None)                      # [b*t or n, layers, H] -> [b, t, layers, H]
        self.slot_ids = torch.arange(rows, device=device)
        self.plain_columns = torch.tensor([[1, 0]] * rows, device=device)   # a plain row: 1 token out, 0 drafted
        self.last_shape: tuple[int, int, int] | None = None     # the last step's graph shape (None: eager)
        self._read: torch.Tensor | None = None                  # start_read's copy on the host
        self._reads: dict[tuple[int, ...], torch.Tensor] = {}   # pinned host buffers by shape
        self.read_done = torch.cuda.Event() if is_cuda else None
        self._outputs: dict[tuple[int, int, int], tuple] = {}   # (b, t, rows) -> (logits, hidden) views
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.chunk_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}    # (tier, L) of prompt chunks
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.packs_rows = False         # decode steps have static [b, t] shapes
        self.capture_s = 0.0
        self.capture_bytes = 0
        if self.use_graphs:
            self.capture(progress)

    # ---- the step ---------------------------------------------------------------------------
    def _run_step(self, b: int, t: int, L: int) -> None:
        """The captured body: inputs in input_ids/starts, logits out in self.logits[:b*t] (and the
        hidden states of hidden_layers in self.hidden[:b*t])."""
        positions = self.positions[:b * t].view(b, t)
        torch.add(self.starts[:b, None], self._arange[:t], out=positions)              # [b, t]
        cfg = self.model.cfg
        input_ids = self.input_ids[:b * t].view(b, t)
        if self.extension:
            self.extension.before(b, t, input_ids)
        trees = t > 1 and getattr(self.extension, "trees", False)
        # the attention kernel takes trees as words of ancestor bits, but applies a sliding window
        # from a query's first position, not its depth's
        queries = cfg.num_heads // cfg.num_kv_heads * t
        kernel = (fused.graph_attention(self.dtype, cfg.head_dim, self.device, queries) if not trees else
                  not self.window and fused.graph_tree_attention(self.dtype, cfg.head_dim, self.device, queries))
        rope = words = bias = None
        if trees:       # the extension's token trees: each node rotated at its depth, seeing its ancestors
            rope = self.rope_positions[:b * t].view(b, t)
            torch.add(self.starts[:b, None], self.extension.depths[:b, :t], out=rope)
            ancestors = self.extension.ancestors[:b, :t, :t - 1]
            if kernel:
                words = fused.tree_words(ancestors)
            else:
                bias = self._bias(positions, L, rope, ancestors)
        elif not kernel:
            bias = self._bias(positions, L)
        batch = ForwardBatch(input_ids=input_ids, positions=positions, slots=self.slot_ids[:b], kv_len=L,
                             attention=AttentionKind.GRAPH if kernel else AttentionKind.DENSE, mask=bias,
                             slot_start=0, window=self.window, idle_start=self.max_len, rope_positions=rope,
                             tree_words=words)
        out, hidden = self.model(batch, self.cache, self.hidden_layers)                 # [b*t, V], [b*t, layers, H]
        self.logits[:b * t].copy_(out)
        if hidden is not None:
            self.hidden[:b * t].copy_(hidden)
        if self.extension:
            self.extension.after(b, t, input_ids, self.logits[:b * t].view(b, t, -1))
        if trees:
            self._compact(b, t)

    def _compact(self, b: int, t: int) -> None:
        """After a step of token trees: each row's accepted path (the extension's path: the row
        position of its node at each depth) moved into consecutive positions, its keys and values
        in the cache and its hidden states in the step's buffer, so the step reads as a chain's."""
        depth = self._arange[1:t]                                                       # [t - 1]
        moved = depth < self.extension.result[:b, :1]
        order = torch.where(moved, self.extension.path[:b, :t - 1], depth)               # [b, t - 1]
        starts = self.starts[:b, None]
        self.cache.compact(self.slot_ids[:b, None].expand(b, t - 1).flatten(), (starts + order).flatten(),
                           (starts + depth).flatten())
        if self.hidden is not None:
            hidden = self.hidden[:b * t].view(b, t, -1)
            hidden[:, 1:] = hidden[:, 1:].gather(1, (order - 1)[:, :, None].expand(b, t - 1, hidden.shape[-1]))

    def _bias(self, positions: torch.Tensor, L: int, rope: torch.Tensor | None = None,
              ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """The additive mask [b, 1, t, L] of queries at positions [b, t]: keys up to each query's
        position (and within the sliding window), in the static buffers. Token trees (rope [b, t]
        their rotary positions, ancestors [b, t, t - 1]: row position j's ancestors and itself
        among the nodes; the last token, j = 0, has none): every query sees the row's keys up to
        its last token, within the window of its rotary position, and its ancestors' and own
        entries at positions 1 .. t - 1 past it."""
        b, t = positions.shape
        mask = self.mask[:b * t * L].view(b, 1, t, L)
        keys = self._arange[:L]
        seen, rotated = (positions, positions) if ancestors is None else (positions[:, :1].expand(b, t), rope)
        torch.le(keys, seen[:, None, :, None], out=mask)                               # key <= query position
        if self.window:
            mask &= keys > rotated[:, None, :, None] - self.window
        if ancestors is not None:   # the nodes' entries (an idle row's positions clamped)
            nodes = positions[:, None, None, 1:].clamp(max=L - 1).expand(b, 1, t, t - 1)
            mask.scatter_(3, nodes, ancestors[:, None])
        bias = self.bias[:b * t * L].view(b, 1, t, L)
        return torch.where(mask, self.bias_values[0], self.bias_values[1], out=bias)

    def _run_chunk(self, n: int, L: int) -> None:
        """The captured body of a prompt chunk of tier n (inputs in chunk_inputs): its keys and
        values cached, padding included, and the hidden states of hidden_layers in self.hidden[:n]."""
        slot, start = self.chunk_inputs[:1], self.chunk_inputs[1:2]
        positions = self.positions[:n].view(1, n)
        torch.add(start[:, None], self._arange[:n], out=positions)
        batch = ForwardBatch(input_ids=self.chunk_inputs[2:2 + n].view(1, n), positions=positions, slots=slot,
                             kv_len=L, mask=self._bias(positions, L), logits=False, planless=True)
        _, hidden = self.model(batch, self.cache, self.hidden_layers)                   # [n, layers, H]
        if hidden is not None:
            self.hidden[:n].copy_(hidden)

    def chunk_shape(self, row: Row) -> tuple[int, int] | None:
        """(tier, key length) of a prompt chunk's graph, or None when no tier holds it."""
        i = bisect.bisect_left(self.prefill_tiers, len(row.token_ids))
        if i == len(self.prefill_tiers):
            return None
        n = self.prefill_tiers[i]
        return n, self.kv_lens[bisect.bisect_left(self.kv_lens, row.start + n)]

    def _replay_chunks(self, rows: list[Row], shapes: list[tuple[int, int]], with_hidden: bool) -> torch.Tensor | None:
        """Prompt chunks through their graphs, one after the other; with_hidden: their hidden states
        [C, S, layers, H] (S the longest chunk, zeros past each chunk's end), else None."""
        hidden = None
        if with_hidden:
            hidden = self.hidden.new_zeros(len(rows), max(len(r.token_ids) for r in rows), *self.hidden.shape[1:])
        for i, (row, shape) in enumerate(zip(rows, shapes)):
            self._replay_chunk(row, shape)
            if hidden is not None:              # the next chunk's replay overwrites the buffer
                hidden[i, :len(row.token_ids)] = self.hidden[:len(row.token_ids)]
        return hidden

    def _replay_chunk(self, row: Row, shape: tuple[int, int]) -> None:
        """A prompt chunk through its graph: its inputs in one copy, then the replay."""
        host_side, end = self.chunk_host, 2 + shape[0]
        host = host_side.writable()
        host[:2] = row.slot, row.start
        host[2:2 + len(row.token_ids)] = row.token_ids
        host[2 + len(row.token_ids):end] = 0
        host_side.send(0, end)
        if self.use_graphs:
            self.chunk_graphs[shape].replay()
        else:                                           # the same body eagerly (tests on the CPU)
            with torch.inference_mode():
                self._run_chunk(*shape)

    def shape_for(self, rows: list[Row], num_device_tokens: int = 0) -> tuple[int, int, int] | None:
        """(bucket, tier, key length) of a decode/verify step, or None when no graph shape holds it."""
        t = max(len(r.token_ids) for r in rows) + num_device_tokens
        i = bisect.bisect_left(self.tiers, t)                              # the smallest tier >= t
        j = bisect.bisect_right(self.buckets, max(r.slot for r in rows))   # the smallest bucket > every slot
        if i == len(self.tiers) or j == len(self.buckets):
            return None
        tier = self.tiers[i]
        end = max(r.start for r in rows) + tier          # every row's positions (padding too) lie below
        return self.buckets[j], tier, self.kv_lens[bisect.bisect_left(self.kv_lens, min(end, self.cache_len))]

    def release_graphs(self) -> None:
        """Destroy the captured graphs; the runner cannot replay them afterwards. NCCL frees a
        communicator, even by abort, only once every graph that captured its collectives is gone
        (a graph still running is freed when it ends, which an aborted communicator makes it do)."""
        for graphs in (self.graphs, self.chunk_graphs):
            for graph in graphs.values():
                graph.reset()
            graphs.clear()

    def forward(self, rows: list[Row], logits: str = "all", hidden_layers: tuple[int, ...] = (),
                chunks: list[Row] = (), draft_tokens: torch.Tensor | None = None,
                step_inputs: list[tuple] | None = None, num_device_tokens: int = 0):
        """As ModelRunner.forward. draft_tokens [len(rows), K] (on the device) are appended after
        each row's host tokens, which must then be one per row (its last token: a verify step whose
        drafts never visit the host, except in an eager forward) or none (a draft model's forward
        of the tokens it drafted the forward before). step_inputs: the extension's values per row, whose drafts
        (at most num_device_tokens) the graph writes itself; the step must then have a shape
        (shape_for). Returns (logits [B, S, V], hidden [B, S, layers, H] or None) with S the tier;
        prompt chunks (logits='none') that a tier holds replay one chunk graph each and return
        (None, hidden or None). The hidden states of a graph step are a view of the runner's
        buffer, valid until its next forward. Only hidden_layers equal to the runner's (or none)
        replay graphs. A replay needs no inference mode (it records nothing), so only the eager
        paths enter it: it costs microseconds a step."""
        if chunks:
            raise ValueError("only a packing runner caches prompt chunks in a decode forward")
        in_graphs = not hidden_layers or tuple(hidden_layers) == self.hidden_layers    # graphs write these
        if logits == "none" and in_graphs and self.use_graphs:
            shapes = [self.chunk_shape(r) for r in rows]
            if all(shapes):
                hidden = self._replay_chunks(rows, shapes, bool(hidden_layers))
                self.last_shape = None
                return None, hidden
        num_device = num_device_tokens if draft_tokens is None else draft_tokens.shape[1]
        shape = self.shape_for(rows, num_device) if logits == "all" and in_graphs else None
        if shape is None and step_inputs is not None:
            raise ValueError("a step with extension inputs needs a graph shape (check shape_for first)")
        self.last_shape = shape
        if shape is None:
            return super().forward(rows, logits, hidden_layers, draft_tokens=draft_tokens)
        b, t, L = shape
        self._write_inputs(rows, b, t, step_inputs)
        if draft_tokens is not None:
            held = len(rows[0].token_ids)
            if held > 1 or any(len(r.token_ids) != held for r in rows):
                raise ValueError("with draft_tokens every row holds exactly its last token, or every row none")
            slots = to_device([r.slot for r in rows], self.device)
            self.input_ids[:b * t].view(b, t)[slots, held:held + num_device] = draft_tokens
        self._replay(shape)
        slots = [r.slot for r in rows]
        in_order = slots == list(range(len(rows)))
        out, hidden = self._output(b, t, len(rows) if in_order else b)
        hidden = hidden if hidden_layers else None
        if not in_order:                                # graph row r is slot r: the rows' own, in their order
            index = to_device(slots, self.device)
            out = out.index_select(0, index)
            hidden = hidden.index_select(0, index) if hidden is not None else None
        return out, hidden

    def _replay(self, shape: tuple[int, int, int]) -> None:
        if self.use_graphs:
            self.graphs[shape].replay()
        else:
            with torch.inference_mode():
                self._run_step(*shape)
        if self.model.is_recurrent:         # its rows were captured: the host records the verify
            self.cache.state.begin_verify(shape[1])

    # ---- overlapped steps -------------------------------------------------------------------
    def step_result(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """A greedy graph step's outcome by graph row, on the device: [b, 2 + t] = tokens out,
        tokens drafted, the tokens. The extension's result, or for a step without one (t = 1),
        each row's argmax."""
        b, t, _ = shape
        if self.extension:
            return self.extension.result[:b, :2 + t]
        with torch.inference_mode():
            tokens = self.logits[:b * t].view(b, t, -1)[:, 0].argmax(-1, keepdim=True)
            return torch.cat([self.plain_columns[:b], tokens], dim=1)

    @torch.inference_mode()
    def replay_next(self, previous: torch.Tensor, active: torch.Tensor, shape: tuple[int, int, int],
                    rows: list[Row], step_inputs: list[tuple] | None = None) -> None:
        """Launch step `shape` after the step whose step_result is `previous`, before the host has
        read it: every active graph row ([b] 1 or 0) advances by its tokens out and feeds its last
        token (dummy rows stay in the spare region); only the extension's values (step_inputs, by
        rows' slots) come from the host. rows: the step's rows (slot; their tokens are unused). The
        hidden-state buffer then holds the launched step's: the step being read has lost its own,
        so GraphStep launches no step for a drafter that reads hidden states."""
        b, t, _ = shape
        num = previous[:, 0]
        last = previous.gather(1, num[:, None] + 1)                                   # [b, 1]
        self.starts[:b].add_(num * active)
        self.input_ids[:b * t].view(b, t)[:, :1] = last
        if self.extension:
            self._write_extension(rows, step_inputs)
        self._replay(shape)
        self.last_shape = shape

    def start_read(self, values: torch.Tensor) -> None:
        """Queue a copy of a small int64 device tensor to the host, for read_back. Unlike .tolist(),
        read_back then waits for the work queued before this call only, not for a step launched
        after it."""
        if self.read_done is None:
            self._read = values.clone()                 # the next step, run eagerly, overwrites values
            return
        buffer = self._reads.get(tuple(values.shape))
        if buffer is None:
            buffer = self._reads[tuple(values.shape)] = torch.empty(values.shape, dtype=values.dtype,
                                                                    pin_memory=True)
        buffer.copy_(values, non_blocking=True)
        self.read_done.record()
        self._read = buffer

    def read_back(self) -> list[list[int]]:
        """start_read's values as lists, once its copy has landed."""
        if self.read_done is not None:
            self.read_done.synchronize()
        return self._read.tolist()

    def step_logits(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """The logits [b, t, V] of the last graph step of `shape`, by graph row."""
        return self._output(shape[0], shape[1], shape[0])[0]

    def step_hidden(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """The hidden states [b, t, layers, H] of the last graph step of `shape`, by graph row."""
        return self._output(shape[0], shape[1], shape[0])[1]

    def _output(self, b: int, t: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits [n, t, V] and hidden states [n, t, layers, H] (None without hidden layers) of
        graph rows [0, n) of shape (b, t): views made once."""
        out = self._outputs.get((b, t, n))
        if out is None:
            hidden = None if self.hidden is None else self.hidden[:b * t].view(b, t, *self.hidden.shape[1:])[:n]
            out = self._outputs[(b, t, n)] = self.logits[:b * t].view(b, t, -1)[:n], hidden
        return out

    def _write_inputs(self, rows: list[Row], b: int, t: int, step_inputs: list[tuple] | None = None) -> None:
        """Rows to graph row = slot; slots without a row get a dummy row in the spare region (and
        the extension's neutral values). Written into the host buffer [starts | extension's | the
        first b*t input ids], which then reaches the device in one copy."""
        num_rows = self.starts.shape[0]
        ids_at = self.ids_at
        n = ids_at + b * t
        host = self.inputs_host.writable()
        host[:num_rows] = self.max_len
        host[ids_at:n] = 0
        for r in rows:
            host[r.slot] = r.start
            at = ids_at + r.slot * t
            host[at:at + len(r.token_ids)] = r.token_ids
        if self.extension:
            self._extension_values(host, rows, step_inputs)
        self.inputs_host.send(0, n)

    def _extension_values(self, host, rows: list[Row], step_inputs: list[tuple] | None) -> None:
        """The extension's values per graph row into the host values (neutral where no row is)."""
        num_rows = self.starts.shape[0]
        per_row = [self.extension.neutral()] * num_rows
        for r, values in zip(rows, step_inputs or []):
            per_row[r.slot] = values
        host[num_rows:self.ids_at] = [v for column in zip(*per_row) for v in column]   # [width, rows]

    def _write_extension(self, rows: list[Row], step_inputs: list[tuple] | None) -> None:
        """The extension's part of the inputs alone, from the host (starts and ids stay as they are)."""
        self._extension_values(self.inputs_host.writable(), rows, step_inputs)
        self.inputs_host.send(self.starts.shape[0], self.ids_at)

    # ---- capture ----------------------------------------------------------------------------
    def capture(self, progress: bool = True) -> None:
        """Capture every (bucket, tier, key length), and every (prompt tier, key length) of a prompt
        chunk, largest first so that smaller graphs reuse the pool."""
        shapes = [(b, t, L) for b in reversed(self.buckets) for t in reversed(self.tiers) for L in reversed(self.kv_lens)]
        shapes += [(n, L) for n in reversed(self.prefill_tiers) for L in reversed(self.kv_lens) if L >= n]
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.starts.fill_(self.max_len)                 # dummy rows: writes land in the spare region
        self.input_ids.zero_()
        self.chunk_inputs[:2] = torch.tensor([0, self.max_len])     # a chunk in the spare region of slot 0
        if self.extension:
            for column, value in zip(self.extension.inputs_view, self.extension.neutral()):
                column.fill_(value)
        bar = tqdm(shapes, desc="outpace: capturing CUDA graphs", unit="graph", file=sys.stderr,
                   disable=None if progress else True)         # None: shown on a terminal only
        with torch.inference_mode(), fused.for_graphs():
            for shape in bar:
                body, graphs = (self._run_step, self.graphs) if len(shape) == 3 else (self._run_chunk, self.chunk_graphs)
                body(*shape)                            # warm-up: kernels chosen and loaded eagerly
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    body(*shape)
                graphs[shape] = graph
                used = free_before - torch.cuda.mem_get_info(self.device)[0]
                what = "batch {} x {} tokens".format(*shape) if len(shape) == 3 else f"a prompt chunk of {shape[0]}"
                bar.set_postfix_str(f"{what} x {shape[-1]} keys, {used / 2**20:.0f} MiB")
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - started
        self.capture_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        if progress:
            chunks = f"; {len(self.chunk_graphs)} of prompt chunks (tokens {self.prefill_tiers})" if self.chunk_graphs else ""
            print(f"outpace: captured {len(self.graphs)} CUDA graphs (batch {self.buckets} x tokens "
                  f"{self.tiers[0]}..{self.tiers[-1]} x keys {self.kv_lens}){chunks} in {self.capture_s:.1f} s, "
                  f"{self.capture_bytes / 2**20:.0f} MiB", file=sys.stderr)


def doublings(first: int, last: int) -> list[int]:
    """first, 2 x first, 4 x first, ... below last, then last: the sizes graphs are captured at."""
    return [n for n in (first * 2 ** i for i in range(16)) if n < last] + [last]
