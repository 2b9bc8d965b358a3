"""The KV cache: allocated once, written at given positions, never reallocated.

Layout per layer: [num_slots, num_kv_heads, max_len, head_dim]. A sequence owns one slot; its
valid length lives on the host (engine.sequence). Dropping rejected draft tokens is a change of
that length: their entries stay in place and are overwritten by the next step's writes, and the
attention mask never lets a query see a position beyond its own. Entries move only within the
cache: a token tree's accepted path into place (compact), a running sequence's prefix into the
slot of a sequence that shares it (copy_prefix).
"""
from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, but on the CPU from anonymous pages the OS zeroes as they are first touched:
    torch.zeros writes every byte at once, 0.1-0.4 s for a 0.5 GB cache at every start, most of
    which a short conversation never reaches. The pages stay small (MADV_NOHUGEPAGE): on huge
    pages (numpy's zeros asks for them) a request's first writes to a slot fault in 2 MB pages
    that hold every layer's whole slot, about 120 MB for the default model, which took 75-360 ms
    on an EPYC (THP compaction on first touch); the first requests of a new server each paid it.
    Decoding reads the cache as fast from small pages (docs/BENCHMARKS.md, "KV cache pages")."""
    size = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or size == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, size)
    if hasattr(pages, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)      # the tensor keeps the mapping


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def compact(self, slots: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Move entries (every layer, keys and values) of slot slots[i] from position sources[i] to
        destinations[i]: a token tree's accepted path into consecutive positions. All entries are
        read before any is written, so a destination may be another pair's source."""
        self.k[:, slots, :, destinations] = self.k[:, slots, :, sources]
        self.v[:, slots, :, destinations] = self.v[:, slots, :, sources]

    def copy_prefix(self, source_slot: int, slot: int, length: int) -> None:
        """Positions [0, length) of source_slot into slot, every layer, keys and values."""
        self.k[:, slot, :, :length] = self.k[:, source_slot, :, :length]
        self.v[:, slot, :, :length] = self.v[:, source_slot, :, :length]

    def commit(self, slots, num_accepted) -> None:
        """Nothing to do after a verify forward: rejected tokens' entries stay, masked, and are
        overwritten (a hybrid model's cache rolls its recurrent state back here)."""
