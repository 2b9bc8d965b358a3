"""ParallelRunner: the driver's runner under tensor parallelism, with ModelRunner's interface.

Rank 0 runs the whole engine (scheduler, drafter, controller, sampling, the server) as with one
device; ranks 1..N-1 hold their shards and run `serve` (runner/workers.py starts them). Every
forward is one message from rank 0 (Channel: one broadcast of a small int64 buffer holding the
call's options and the rows' slots, starts and token ids; a second broadcast only where the ids
overflow it), after which every rank runs the same forward on the same rows with its own runner,
so their collectives meet in the same order. A rank's runner is rank 0's: rank 0 sends the
callable that builds it (a functools.partial of the runner class and its arguments), and each
rank calls it with its own shard of the model.

Drafts on the device (a device drafter's) are appended to their rows on the host first: drafting
happens on rank 0, every rank verifies the same tokens, and only rank 0 samples (its logits are
whole after the LM head's all-gather).
"""
from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


class Channel:
    """Messages from rank 0 to every other rank over a gloo group: CPU tensors, so rank 0 never
    waits for its device to send, and a worker blocked here waits without a timeout while the
    engine is idle (the group is made with a timeout of a year)."""

    def __init__(self, group):
        self.group = group
        self.buffer = torch.zeros(INLINE, dtype=torch.long)

    def send(self, what: int, payload: list[int] = ()) -> None:
        message = [what, len(payload), *payload]
        inline = message if len(message) <= INLINE else message[:HEADER]
        self.buffer[:len(inline)] = torch.tensor(inline)
        dist.broadcast(self.buffer, 0, group=self.group)
        if len(inline) < len(message):
            dist.broadcast(torch.tensor(payload), 0, group=self.group)

    def receive(self) -> tuple[int, list[int]]:
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
