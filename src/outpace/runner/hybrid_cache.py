"""HybridCache: a hybrid model's cache, keys and values of its attention layers beside the
recurrent state of the others (runner/state_cache.py)."""
from __future__ import annotations

import torch

from outpace.runner.kv_cache import KVCache
from outpace.runner.state_cache import StateCache


class HybridCache:
    def __init__(self, kv: KVCache, state: StateCache):
        self.k, self.v = kv.k, kv.v             # [attention layers, slots, kv heads, max_len, head dim]
        self.max_len, self.num_slots = kv.max_len, kv.num_slots
        self.kv, self.state = kv, state

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.state.nbytes

    def commit(self, slots: list[int] | torch.Tensor, num_accepted: list[int] | torch.Tensor) -> None:
        """After a verify forward: each slot's state becomes the one after its row's token
        num_accepted (its first num_accepted drafts accepted). Keys and values need nothing: their
        rollback is the sequence's length."""
        self.state.commit(slots, num_accepted)
