"""RowGroup: how a forward's tokens split into sequences for the recurrent layers.

A forward holds rows (decode, verify, or prompt chunks sent alone) laid out as [B, S] or packed
into their real tokens, and, packed after them, prompt chunks each of its own slot (layers.Packed).
Attention reads each token's slot and position; a recurrent layer instead runs each sequence's
tokens in order from its slot's state, so it takes them group by group: the rows as [B, S] (each
row's tokens first, padding after), then each chunk as [1, n]. The stream's tokens are the groups'
in order: rows' [0, T), then each chunk's. The C kernels (kernels/recurrent_kernels.c) and the
Triton ones (kernels/triton_recurrent.py) take the same sequences as one table, a row a sequence
with where its tokens sit in the stream.

The CUDA graph runner's static steps hold a row for every slot of their batch bucket, each padded
to the tier's tokens. A row of an idle slot (a dummy row, from batch.idle_start on) runs on the
state cache's sink slot from zero state; a real row's padding tokens run as tokens, writing only
the snapshots (or log entries) past the row's own, which no commit picks.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from outpace.errors import UnsupportedModelError
from outpace.model.layers import AttentionKind, ForwardBatch
from outpace.runner.state_cache import StateCache, StateRows

# rows of at most this many tokens run the Triton kernels on CUDA; longer prompt chunks run
# delta_rule.chunks in PyTorch (the kernels run a row's tokens one after another)
GPU_ROW_TOKENS = 32


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass
class RowGroup:
    start: int                      # its tokens are the stream's [start, stop)
    stop: int
    num_rows: int
    width: int
    index: torch.Tensor | None      # [stop - start] each token's flat index into [num_rows * width]; None: all real
    state: StateRows                # where the rows' recurrent state is read and written

    def lay_out(self, x: torch.Tensor) -> torch.Tensor:
        """The stream's x [N, ...] -> the group's [B, S, ...], padding zero."""
        x = x[self.start:self.stop]
        if self.index is not None:
            x = x.new_zeros(self.num_rows * self.width, *x.shape[1:]).index_copy_(0, self.index, x)
        return x.view(self.num_rows, self.width, *x.shape[1:])

    def tokens(self, y: torch.Tensor) -> torch.Tensor:
        """The group's y [B, S, ...] -> its real tokens [stop - start, ...], the stream's order."""
        y = y.reshape(self.num_rows * self.width, *y.shape[2:])
        return y if self.index is None else y.index_select(0, self.index)

    def table(self) -> torch.Tensor:
        """[num_rows, 8] int64, the kernels' row table (its columns: recurrent_kernels.c's ROW_*):
        slot, entry read, entry written (-1: a snapshot per token), fresh, convolution window start,
        first token's index in the stream, tokens, verify."""
        rows = self.state
        lengths = rows.lengths
        if self.index is None:      # every row holds `width` real tokens
            offsets = torch.arange(self.num_rows, device=lengths.device) * self.width
        else:                       # packed: each row's tokens after the previous row's
            offsets = lengths.cumsum(0) - lengths
        write = rows.final if rows.snapshots is None else torch.full_like(rows.read, -1)
        return torch.stack([rows.slots, rows.read, write, rows.fresh.long(), rows.conv_start, offsets + self.start,
                            lengths, torch.full_like(lengths, int(rows.verify))], dim=1)


@dataclass
class RowGroups:
    """A forward's groups, and the same sequences as the kernels' table (built on first use)."""

    groups: list[RowGroup]

    @functools.cached_property
    def table(self) -> torch.Tensor:
        return torch.cat([group.table() for group in self.groups]).contiguous()

    @property
    def max_width(self) -> int:
        return max(g.width for g in self.groups)

    def on_gpu_kernels(self, x: torch.Tensor) -> bool:
        """Whether the recurrent layers run kernels/triton_recurrent for activations x: on CUDA
        with Triton, every row at most GPU_ROW_TOKENS tokens."""
        return x.is_cuda and has_triton() and self.max_width <= GPU_ROW_TOKENS


def row_groups(batch: ForwardBatch, cache: StateCache) -> RowGroups:
    """The forward's groups, each with its StateRows from `cache` (a StateCache), which moves its
    slots to their state after this forward. Rows that return logits are verify rows."""
    static = batch.idle_start is not None
    if not static and (batch.attention is AttentionKind.GRAPH
                       or (batch.mask is not None and batch.mask.dtype != torch.bool)):
        # the CUDA graph runner's padded prompt chunks: a recurrent layer would take their padding
        # as tokens of the sequence
        raise UnsupportedModelError("hybrid models' prompt chunks do not run in CUDA graphs: the runner "
                                    "must run them eagerly")
    if not static:
        cache.begin_forward()
    B, S = batch.positions.shape
    device = batch.positions.device
    slots, fresh = batch.slots, batch.positions[:, 0] == 0
    if static:
        idle = batch.positions[:, 0] >= batch.idle_start
        slots, fresh = torch.where(idle, cache.sink, slots), fresh | idle
    packed = batch.packed
    if packed is None:
        index, num_tokens = None, B * S
        lengths = torch.full((B,), S, dtype=torch.long, device=device)
    else:
        index, num_tokens = packed.index, len(packed.index)
        lengths = torch.bincount(index // S, minlength=B)
    groups = [RowGroup(0, num_tokens, B, S, index, cache.rows(slots, lengths, fresh, S, batch.logits, static))]
    for chunk in packed.chunks if packed is not None else []:
        start = groups[-1].stop
        slots, lengths = torch.tensor([chunk.slot, chunk.n], device=device).view(2, 1)
        fresh = torch.tensor([chunk.end == chunk.n], device=device)
        groups.append(RowGroup(start, start + chunk.n, 1, chunk.n, None,
                               cache.rows(slots, lengths, fresh, chunk.n, False)))
    return RowGroups(groups)
