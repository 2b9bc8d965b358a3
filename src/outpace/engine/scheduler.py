"""Scheduler: which sequences run this step and how many prompt tokens each caches. Plain Python.

Capacity is fixed at start: at most `num_slots` running sequences (one KV slot each) and at most
`max_prefill_tokens` prompt tokens cached per step, so a long prompt is chunked and never stalls
the decoding of the others. Requests beyond capacity wait in a FIFO queue.

Prefix caching: a freed slot's keys and values stay where they are, and the scheduler remembers
whose tokens they are (`kept`). A sequence given that slot later starts with them cached, as far
as its prompt begins with those tokens (a conversation's next turn: the last turn's prompt and
answer), and its prefill starts there. Keys of positions past a sequence's cached length are never
read (rollback by length), so a kept prefix is exactly what a fresh prefill of those tokens would
write, up to the arithmetic of the forwards that wrote it.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from outpace.engine.sequence import Sequence, Status


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int      # first position cached by this chunk
    end: int        # one past the last


@dataclass
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)   # each decodes its last token (+ draft)
    # a step launched ahead on the device (engine/step.py's Launched), to be read, not scheduled
    launched: object | None = None
    # the sequences running, those still caching their prompts included: the batch the decoding
    # rows are about to run in (0: the decoding rows alone)
    load: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass
class KeptPrefix:
    """The tokens whose keys and values a free slot still holds, from the sequence that ran there."""

    cache_salt: str
    token_ids: list[int]
    freed: int          # when the slot was freed, a counter: the slot freed longest ago goes first


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int, low_slots_first: bool = False,
                 reuse_bound=lambda seq, slot: None):
        """low_slots_first: a sequence that reuses no kept prefix takes the lowest free slot (a CUDA
        graph runner's batch bucket follows the highest slot in a step); otherwise the slot freed
        longest ago, so that the prefixes kept in the others last longest. reuse_bound(seq, slot):
        the most of a kept prefix seq may reuse in slot (a drafter's own cache there), None: no bound."""
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.low_slots_first = low_slots_first
        self.reuse_bound = reuse_bound
        self.free_slots = list(range(num_slots))
        self.kept: dict[int, KeptPrefix] = {}          # free slot -> what its cache holds
        self._freed = itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            self._place(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
        plan = StepPlan(load=len(self.running))
        budget = self.max_prefill_tokens
        for seq in self.running:
            if not seq.is_prefilling:
                plan.decode.append(seq)
            elif budget > 0:
                # cache the prompt up to its last token, which the first decode step feeds
                end = min(len(seq.token_ids) - 1, seq.num_cached + budget)
                plan.prefill.append(PrefillChunk(seq, seq.num_cached, end))
                budget -= end - seq.num_cached
        return plan

    def _place(self, seq: Sequence) -> None:
        """Give seq the free slot whose kept prefix covers most of its prompt (up to its last
        token, the first decode step's input; the same cache_salt), where seq may reuse one; with
        no such slot, the lowest free slot or the one freed longest ago (low_slots_first)."""
        def reused(slot: int) -> int:
            kept = self.kept.get(slot)
            if kept is None or not seq.reuse_prefix or kept.cache_salt != seq.cache_salt:
                return 0
            bound = self.reuse_bound(seq, slot)
            limit = len(seq.token_ids) - 1 if bound is None else min(bound, len(seq.token_ids) - 1)
            return min(common_prefix(kept.token_ids, seq.token_ids), limit)

        def freed(slot: int) -> int:        # never-used slots first
            kept = self.kept.get(slot)
            return -1 if kept is None else kept.freed

        lengths = {slot: reused(slot) for slot in self.free_slots}
        if self.low_slots_first:
            slot = min(self.free_slots, key=lambda s: (-lengths[s], s))
        else:
            slot = min(self.free_slots, key=lambda s: (-lengths[s], freed(s), s))
        self.free_slots.remove(slot)
        self.kept.pop(slot, None)
        seq.slot = slot
        seq.num_cached = seq.num_reused = lengths[slot]

    def take_scratch_slot(self) -> int:
        """A free slot for forwards outside the step (its keys are overwritten by the next
        sequence there); the prefix it kept is dropped."""
        if not self.free_slots:
            raise RuntimeError("no free cache slot: run scratch forwards when a slot is free")
        slot = self.free_slots[-1]
        self.kept.pop(slot, None)
        return slot

    def finish(self, seq: Sequence) -> None:
        """Free the sequence's slot at once (finished, cancelled or failed); the slot keeps the
        keys of the tokens the sequence cached."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            cached = seq.token_ids[:min(seq.num_cached, len(seq.token_ids))]
            self.kept[seq.slot] = KeptPrefix(seq.cache_salt, cached, next(self._freed))
        elif seq in self.waiting:
            self.waiting.remove(seq)
