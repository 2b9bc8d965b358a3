"""ParallelRunner: the driver's runner under tensor parallelism, with ModelRunner's interface.

Rank 0 runs the whole engine (scheduler, drafter, controller, sampling, the server) as with one
device; ranks 1..N-1 hold their shards and run `serve` (runner/workers.py starts them). Every
forward is one message from rank 0 (Channel: a small int64 buffer holding the call's options and
the rows' slots, starts and token ids, through shared memory on one host of GPUs, else one gloo
broadcast; a second broadcast only where the ids overflow it), after which every rank runs the same forward on the same rows with its own runner,
so their collectives meet in the same order. A rank's runner is rank 0's: rank 0 sends the
callable that builds it (a functools.partial of the runner class and its arguments), and each
rank calls it with its own shard of the model.

Drafts on the device (a device drafter's) are appended to their rows on the host first: drafting
happens on rank 0, every rank verifies the same tokens, and only rank 0 samples (its logits are
whole after the LM head's all-gather).
"""
from __future__ import annotations

import ctypes
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from outpace.model.tensor_parallel import wait_sliced
from outpace.runner.model_runner import ModelRunner, Row

LOGITS = ("all", "tokens", "none")      # ModelRunner.forward's logits options, by their code
STOP, FORWARD, OBJECT = 0, 1, 2         # what a message asks of the workers
HEADER = 2                              # [what, payload length]
INLINE = 4096                           # int64s a first broadcast holds: a decode step's fit


@dataclass
class ForwardCall:
    """The arguments of one ModelRunner.forward, as rank 0 called it."""

    rows: list[Row]
    logits: str
    hidden_layers: tuple[int, ...]
    chunks: list[Row]

    def encode(self) -> list[int]:
        """[logits code, rows, chunks, hidden layers, *hidden_layers, then per row and chunk:
        slot, start, n, *token_ids]."""
        out = [LOGITS.index(self.logits), len(self.rows), len(self.chunks), len(self.hidden_layers),
               *self.hidden_layers]
        for r in [*self.rows, *self.chunks]:
            out += [r.slot, r.start, len(r.token_ids), *r.token_ids]
        return out

    @classmethod
    def decode(cls, values: list[int]) -> "ForwardCall":
        logits, num_rows, num_chunks, num_hidden = values[:4]
        at = 4 + num_hidden
        rows = []
        for _ in range(num_rows + num_chunks):
            slot, start, n = values[at:at + 3]
            rows.append(Row(slot, values[at + 3:at + 3 + n], start))
            at += 3 + n
        return cls(rows[:num_rows], LOGITS[logits], tuple(values[4:4 + num_hidden]), rows[num_rows:])


class Mailbox:
    """Rank 0's messages to the workers of one host through shared memory: a worker sees a
    message microseconds after rank 0 writes it, where a gloo broadcast over loopback TCP costs a
    round trip and more (measured at 0.6-0.8 ms a decode step on two GPUs; benchmark-log). The
    buffer (a shared int64 tensor, read through ctypes) holds [sequence number, what, payload
    length, one acknowledgement a rank, payload]. Rank 0 writes the payload, then the sequence
    number; a worker copies the message, then writes the sequence number into its acknowledgement.
    Rank 0 writes the next message only once every worker acknowledged the last one. x86 keeps
    stores and loads in program order, which this protocol relies on (Channel uses a mailbox on
    x86-64 alone). A waiting worker spins for SPIN_S, then sleeps in short and then longer naps,
    so an idle engine's workers cost almost no CPU."""

    SEQ, WHAT, LENGTH, ACKS = 0, 1, 2, 3
    SPIN_S, NAP_S, IDLE_S, SLEEP_S = 0.005, 50e-6, 1.0, 1e-3

    def __init__(self, buffer: torch.Tensor, world_size: int):
        self.buffer = buffer                            # kept: the memory the view reads
        self.slots = (ctypes.c_int64 * buffer.numel()).from_address(buffer.data_ptr())
        self.world_size = world_size
        self.payload_at = self.ACKS + world_size
        self.capacity = buffer.numel() - self.payload_at
        self.seen = 0                                   # the last sequence number sent or read

    @staticmethod
    def allocate(world_size: int) -> torch.Tensor:
        """The shared buffer, made by rank 0 before it starts the workers (who get it as an argument)."""
        return torch.zeros(Mailbox.ACKS + world_size + INLINE, dtype=torch.long).share_memory_()

    def send(self, what: int, payload: list[int] | None, failed: Callable[[], bool],
             timeout: float | None = None) -> None:
        """Write a message of at most `capacity` int64s (None: its payload follows on gloo); waits
        for the last one's acknowledgements, raising RuntimeError where `failed()` says a worker
        ended meanwhile or `timeout` seconds pass."""
        slots, seq = self.slots, self.seen
        waited, t0 = 0, time.monotonic()
        while any(slots[self.ACKS + r] != seq for r in range(1, self.world_size)):
            waited += 1
            if waited % 1000 == 0:
                if failed():
                    raise RuntimeError("a tensor-parallel worker ended before it read rank 0's message")
                if timeout is not None and time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"a tensor-parallel worker did not read rank 0's message in {timeout} s")
                time.sleep(self.NAP_S)
        if payload is not None:
            slots[self.payload_at:self.payload_at + len(payload)] = payload
        slots[self.WHAT], slots[self.LENGTH] = what, -1 if payload is None else len(payload)
        self.seen = slots[self.SEQ] = seq + 1

    def receive(self, rank: int) -> tuple[int, list[int] | None]:
        """The next message: what, and its payload (None: it follows on gloo)."""
        slots, seq = self.slots, self.seen
        t0 = time.monotonic()
        while slots[self.SEQ] == seq:
            waited = time.monotonic() - t0
            if waited > self.SPIN_S:
                time.sleep(self.NAP_S if waited < self.IDLE_S else self.SLEEP_S)
        self.seen = seq + 1
        what, n = slots[self.WHAT], slots[self.LENGTH]
        payload = None if n < 0 else slots[self.payload_at:self.payload_at + n]
        slots[self.ACKS + rank] = self.seen
        return what, payload


class Channel:
    """Messages from rank 0 to every other rank: over a gloo group (CPU tensors, so rank 0 never
    waits for its device to send, and a worker blocked there waits without a timeout while the
    engine is idle: the group is made with a timeout of a year), and on one host of GPUs through
    a Mailbox in shared memory, which then carries every message that fits it and announces those
    that do not, which follow on the gloo group."""

    def __init__(self, group, rank: int = 0, mailbox: Mailbox | None = None,
                 failed: Callable[[], bool] = lambda: False):
        self.group, self.rank, self.mailbox, self.failed = group, rank, mailbox, failed
        self.buffer = torch.zeros(INLINE, dtype=torch.long)

    def send(self, what: int, payload: list[int] = (), timeout: float | None = None) -> None:
        """timeout: how long a mailbox may wait for the workers to read the last message."""
        if self.mailbox is not None:
            if len(payload) <= self.mailbox.capacity:
                self.mailbox.send(what, list(payload), self.failed, timeout)
                return
            self.mailbox.send(what, None, self.failed, timeout)     # the payload follows on gloo
        message = [what, len(payload), *payload]
        inline = message if len(message) <= INLINE else message[:HEADER]
        self.buffer[:len(inline)] = torch.tensor(inline)
        wait_sliced(dist.broadcast(self.buffer, 0, group=self.group, async_op=True), self.failed)
        if len(inline) < len(message):
            wait_sliced(dist.broadcast(torch.tensor(payload), 0, group=self.group, async_op=True), self.failed)

    def receive(self) -> tuple[int, list[int]]:
        if self.mailbox is not None:
            what, payload = self.mailbox.receive(self.rank)
            if payload is not None:
                return what, payload
        dist.broadcast(self.buffer, 0, group=self.group)
        what, n = self.buffer[:HEADER].tolist()
        if HEADER + n <= INLINE:
            return what, self.buffer[HEADER:HEADER + n].tolist()
        payload = torch.empty(n, dtype=torch.long)
        dist.broadcast(payload, 0, group=self.group)
        return what, payload.tolist()

    def send_object(self, obj) -> None:
        """A picklable object (the model's loader, the runner's builder) to every rank."""
        self.send(OBJECT, list(pickle.dumps(obj)))

    def receive_object(self):
        what, payload = self.receive()
        if what != OBJECT:
            raise RuntimeError(f"rank 0 sent message {what} where an object was expected")
        return pickle.loads(bytes(payload))


class ParallelRunner:
    """Rank 0's runner: each forward is sent to the workers, then run on rank 0's shard.
    `workers` (runner/workers.Workers) holds the channel and turns a failed collective into a
    clear error."""

    def __init__(self, make_runner: Callable[..., ModelRunner], model, workers):
        with workers.collective():          # building a CUDA graph runner captures collectives
            workers.channel.send_object(make_runner)
            self.inner = make_runner(model)
        self.workers = workers
        workers.runner = self.inner
        inner = self.inner
        self.model, self.device, self.dtype, self.cache = inner.model, inner.device, inner.dtype, inner.cache
        self.packs_rows, self.greedy_logits = inner.packs_rows, inner.greedy_logits

    def forward(self, rows: list[Row], logits: str = "all", hidden_layers: tuple[int, ...] = (),
                chunks: list[Row] = (), draft_tokens: torch.Tensor | None = None):
        """As ModelRunner.forward, on every rank."""
        if draft_tokens is not None:        # [B, K] on the device: every rank needs the tokens
            rows = [Row(r.slot, r.token_ids + d, r.start) for r, d in zip(rows, draft_tokens.tolist())]
        call = ForwardCall(list(rows), logits, tuple(hidden_layers), list(chunks))
        with self.workers.collective():
            self.workers.channel.send(FORWARD, call.encode())
            return self.inner.forward(call.rows, call.logits, call.hidden_layers, call.chunks)


def serve(runner: ModelRunner, channel: Channel) -> None:
    """A worker's loop: run each forward rank 0 sends, until it sends STOP."""
    while True:
        what, payload = channel.receive()
        if what == STOP:
            return
        call = ForwardCall.decode(payload)
        runner.forward(call.rows, call.logits, call.hidden_layers, call.chunks)
