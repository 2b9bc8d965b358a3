"""Scheduler: which sequences run this step and how many prompt tokens each caches. Plain Python.

Capacity is fixed at start: at most `num_slots` running sequences (one KV slot each) and at most
`max_prefill_tokens` prompt tokens cached per step, so a long prompt is chunked and never stalls
the decoding of the others. Requests beyond capacity wait in a FIFO queue.
"""
from __future__ import annotations

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


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int):
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.free_slots = list(range(num_slots - 1, -1, -1))   # pop() hands out the lowest slot first
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
            seq.slot = self.free_slots.pop()
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

    def finish(self, seq: Sequence) -> None:
        """Free the sequence's slot at once (finished, cancelled or failed)."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
