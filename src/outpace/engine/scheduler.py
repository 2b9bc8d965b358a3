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

Prefix sharing: a request may also start from a running sequence's cached prefix (n choices of one
prompt, clients behind one system prompt). It takes a free slot as any request does, and the
plan's `copies` tell the engine to copy that prefix's keys and values from the running
sequence's slot into it before the step's forwards (a running sequence never rewrites entries
below its cached length). Where a running sequence is still caching a prompt the request shares
for SHARE_WAIT_TOKENS or more than it holds yet, the request waits for it, in its place in the
queue, rather than caching the same tokens beside it.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from outpace.engine.sequence import Sequence, Status

# a request waits for a running sequence still caching this many more tokens of their common prompt
SHARE_WAIT_TOKENS = 32


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
    # prefix sharing: (running sequence, sequence placed, n): the first n positions' keys and
    # values to copy from the running sequence's slot into the placed one's before the forwards
    copies: list[tuple[Sequence, Sequence, int]] = field(default_factory=list)

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
                 reuse_bound=lambda seq, slot: None, share_bound=None):
        """low_slots_first: a sequence that reuses no kept prefix takes the lowest free slot (a CUDA
        graph runner's batch bucket follows the highest slot in a step); otherwise the slot freed
        longest ago, so that the prefixes kept in the others last longest. reuse_bound(seq, slot):
        the most of a kept prefix seq may reuse in slot (a drafter's own cache there), None: no bound.
        share_bound(source, seq): likewise the most seq may take of a running sequence's prefix
        (prefix sharing, the top); None: no sharing."""
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.low_slots_first = low_slots_first
        self.reuse_bound = reuse_bound
        self.share_bound = share_bound
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
        plan, waits = StepPlan(), []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            if self._waits(seq):
                waits.append(seq)
                continue
            self._place(seq, plan)
            seq.status = Status.RUNNING
            self.running.append(seq)
        self.waiting.extendleft(reversed(waits))
        plan.load = len(self.running)
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

    def _shared(self, source: Sequence, seq: Sequence, cached: int) -> int:
        """How many of seq's first positions match source's first `cached` tokens (up to seq's
        last token, the first decode step's input; the same cache_salt), where seq may reuse a
        prefix and a source's may be shared."""
        if self.share_bound is None or not seq.reuse_prefix or source.cache_salt != seq.cache_salt:
            return 0
        return min(common_prefix(source.token_ids[:cached], seq.token_ids), len(seq.token_ids) - 1)

    def _waits(self, seq: Sequence) -> bool:
        """Whether seq waits for a running sequence of the same kind (both speculating or both
        not: a drafter caches a plain sequence's prompt for nobody) that is still caching at least
        SHARE_WAIT_TOKENS more of a prompt they share."""
        return any(source.is_prefilling and source.speculate == seq.speculate
                   and self._shared(source, seq, len(source.token_ids)) - source.num_cached >= SHARE_WAIT_TOKENS
                   for source in self.running)

    def _place(self, seq: Sequence, plan: StepPlan) -> None:
        """Give seq the free slot whose kept prefix covers most of its prompt (up to its last
        token, the first decode step's input; the same cache_salt), where seq may reuse one; with
        no such slot, the lowest free slot or the one freed longest ago (low_slots_first). Where
        a running sequence's cached prefix covers more, seq starts from a copy of it (the plan's
        copies) in the slot a sequence reusing nothing takes."""
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
        source, shared = None, max(lengths.values())
        for other in self.running:
            n = self._shared(other, seq, other.num_cached)
            if n > shared:
                bound = self.share_bound(other, seq)
                n = n if bound is None else min(n, bound)
                if n > shared:
                    source, shared = other, n
        if source is not None:          # the slot a sequence that reuses nothing takes
            lengths = dict.fromkeys(lengths, 0)
        if self.low_slots_first:
            slot = min(self.free_slots, key=lambda s: (-lengths[s], s))
        else:
            slot = min(self.free_slots, key=lambda s: (-lengths[s], freed(s), s))
        self.free_slots.remove(slot)
        self.kept.pop(slot, None)
        seq.slot = slot
        seq.num_cached = seq.num_reused = lengths[slot] if source is None else shared
        if source is not None:
            plan.copies.append((source, seq, shared))

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
