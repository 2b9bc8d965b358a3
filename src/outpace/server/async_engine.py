"""AsyncEngine: the LLMEngine driven by one thread, fed from asyncio request handlers.

Threads: the engine thread alone touches the engine and its Sequences (`outpace serve` runs the
loop in the thread that built the engine, the HTTP server beside it: see run()). Handlers talk to
it through `commands`, a thread-safe FIFO that the thread drains between steps (adds and aborts
land at a step boundary, so a cancelled request's slot is free for the very next step). Results
come back as immutable `Update` snapshots, put on each request's asyncio queue with
call_soon_threadsafe.

Faults: an exception inside a step fails the requests running in that step (their streams get a
500-style error, their slots are freed) and the loop goes on serving the others.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from outpace.config import SamplingParams
from outpace.engine.llm_engine import LLMEngine
from outpace.engine.sequence import Sequence, SpecStats
from outpace.server.metrics import Metrics

log = logging.getLogger("outpace.server")

_STOP = object()


class EngineFailure(RuntimeError):
    """The engine failed while running this request (a server fault, not the client's)."""


@dataclass(frozen=True)
class Update:
    """A request's state after a step. text only grows; finish_reason set on the last update."""

    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    spec: dict | None = None        # speculation figures, on the last update only
    num_cached_tokens: int = 0      # prompt tokens found cached from an earlier or a running request
    # where the request asks for logprobs: its sequence's list of them, which only grows (the
    # engine thread appends to it): token_logprobs is this update's share
    logprobs: list | None = None
    prompt_logprobs: list | None = None     # where it asks for them: whole from the first update on

    @property
    def token_logprobs(self) -> list | None:
        return None if self.logprobs is None else self.logprobs[:self.num_output_tokens]

    @property
    def usage(self) -> dict:
        return usage_body(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens, self.spec)


def usage_body(prompt_tokens: int, output_tokens: int, cached_tokens: int, spec: dict | None) -> dict:
    """A response's usage in OpenAI's layout, with the speculation figures (spec_figures) where given."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens,
             "total_tokens": prompt_tokens + output_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if spec is not None:
        usage["speculation"] = spec
    return usage


SPEC_COUNTS = ("num_verify_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_figures(stats: SpecStats) -> dict:
    """The speculation figures a response's usage carries: the counts and the rates they give."""
    d = stats.as_dict()
    return {k: d[k] for k in SPEC_COUNTS + ("acceptance_rate", "mean_acceptance_length")}


class RequestStream:
    """The handler's side of one request: its asyncio queue of Updates (or an error)."""

    def __init__(self, owner: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.owner, self.request_id, self.loop = owner, request_id, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()   # the engine took (or refused) the request
        self.arrival = time.perf_counter()
        self.is_done = False
        # engine-thread side, touched only by that thread
        self.seq: Sequence | None = None
        self.num_tokens_counted = 0

    async def next(self) -> Update:
        """The latest update (updates queued meanwhile are skipped: each holds the whole text)."""
        item = await self.queue.get()
        while not self.queue.empty() and not isinstance(item, BaseException) and item.finish_reason is None:
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.is_done = True
            raise item
        self.is_done = item.finish_reason is not None
        return item

    def cancel(self) -> None:
        """Abort the request if it is still queued or running (client gone); no-op once finished."""
        if not self.is_done:
            self.is_done = True
            self.owner.submit(("abort", self))

    # ---- called from the engine thread --------------------------------------------------
    def push(self, item) -> None:
        self._call(self.queue.put_nowait, item)

    def resolve(self, error: BaseException | None) -> None:
        def settle():
            if not self.accepted.done():
                self.accepted.set_result(None) if error is None else self.accepted.set_exception(error)
        self._call(settle)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:        # the event loop is closed: the server is shutting down
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics, log_interval_s: float = 10.0):
        self.engine = engine
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, RequestStream] = {}     # seq_id -> stream, engine thread only
        # published by the engine thread after every step, read by /health and /metrics
        self.num_running = 0
        self.num_waiting = 0
        self.error: BaseException | None = None          # set if the loop itself died
        self.is_running = False
        self.thread = threading.Thread(target=self.run, name="outpace-engine", daemon=True)

    # ---- handler side ---------------------------------------------------------------------
    def start(self) -> None:
        """Run the loop in a background thread."""
        self.is_running = True
        self.thread.start()

    def run(self) -> None:
        """Run the loop in the calling thread until stop(). Serve from the thread that built the
        engine: PyTorch's CPU thread pool belongs to the thread that runs an operation, and
        stepping from a second thread beside the one that had loaded the model made serving about
        17% slower on 2 cores (16 sequences in the engine alone: 127 against 153 tokens/s)."""
        self.is_running = True
        try:
            self._loop()
        finally:
            self.is_running = False

    def stop(self) -> None:
        self.submit(_STOP)
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def shutdown(self) -> None:
        """Fail every request still held (the loop is not running): the server is going away."""
        for stream in list(self.streams.values()):
            self._abort(stream)
            stream.push(EngineFailure("the server is shutting down; send the request again later"))

    @property
    def is_alive(self) -> bool:
        return self.is_running and self.error is None

    def submit(self, command) -> None:
        self.commands.put(command)

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  speculate: bool = True, cache_salt: str = "") -> RequestStream:
        """Queue a request; returns once the engine holds it. Raises what add_request raises."""
        if not self.is_alive:
            raise EngineFailure("the engine loop is not running; restart the server")
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self.submit(("add", stream, prompt_ids, params, speculate, cache_salt))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            stream.cancel()
            raise
        return stream

    # ---- engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        last_summary = time.monotonic()
        try:
            while self._apply_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                self._publish_counts()
                if time.monotonic() - last_summary >= self.log_interval_s:
                    last_summary = time.monotonic()
                    self.metrics.log_summary(self.num_running, self.num_waiting)
        except Exception as error:              # a bug in the loop itself: fail everyone, say so
            log.exception("engine loop died")
            self.error = error
            failure = EngineFailure(f"the engine loop died: {error!r}; restart the server")
            for stream in list(self.streams.values()):
                stream.push(failure)
            self.streams.clear()
            while True:                         # requests queued behind the fault: refuse them
                try:
                    command = self.commands.get_nowait()
                except queue.Empty:
                    break
                if command is not _STOP and command[0] == "add":
                    command[1].resolve(failure)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; when idle, wait for one. False once asked to stop."""
        try:
            command = self.commands.get(timeout=self.log_interval_s) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                self.shutdown()
                return False
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, stream: RequestStream, prompt_ids, params, speculate, cache_salt) -> None:
        try:
            stream.seq = self.engine.add_request(prompt_ids, params, speculate, cache_salt)
        except Exception as error:      # invalid input the handler did not catch: the client's 400
            stream.resolve(error)
            return
        self.streams[stream.seq.seq_id] = stream
        self.metrics.on_add(len(prompt_ids))
        stream.resolve(None)

    def _abort(self, stream: RequestStream) -> None:
        # FIFO commands: an abort always follows its add, so seq is set unless the add was refused
        seq = stream.seq
        if seq is None or self.streams.get(seq.seq_id) is not stream:
            return
        self.engine.abort(seq.seq_id)
        self._finish(stream, seq, "abort")

    def _step(self) -> None:
        try:
            seqs = self.engine.step()
        except Exception as error:
            log.exception("engine step failed; failing the requests running in it")
            self._fail_running(error)
            return
        for seq in seqs:
            stream = self.streams.get(seq.seq_id)
            if stream is None:
                continue
            self.metrics.on_tokens(seq.num_output_tokens - stream.num_tokens_counted)
            stream.num_tokens_counted = seq.num_output_tokens
            finished = seq.finish_reason is not None
            stream.push(Update(seq.text, seq.num_prompt_tokens, seq.num_output_tokens, seq.finish_reason,
                               spec_figures(seq.stats) if finished else None, seq.num_reused, seq.logprobs,
                               seq.prompt_logprobs))
            if finished:
                self._finish(stream, seq, seq.finish_reason)

    def _fail_running(self, error: Exception) -> None:
        # the scheduler moved this step's sequences to running before the step ran
        for seq in list(self.engine.scheduler.running):
            stream = self.streams.get(seq.seq_id)
            try:
                self.engine.abort(seq.seq_id)
            except Exception:
                log.exception("aborting sequence %d after a failed step failed too", seq.seq_id)
            if stream is not None:
                stream.push(EngineFailure(f"the engine failed while running this request: {error!r}"))
                self._finish(stream, seq, "error")

    def _finish(self, stream: RequestStream, seq: Sequence, status: str) -> None:
        self.streams.pop(seq.seq_id, None)
        self.metrics.on_finish(stream.request_id, seq, status, stream.arrival)

    def _publish_counts(self) -> None:
        scheduler = self.engine.scheduler
        self.num_running, self.num_waiting = scheduler.num_running, scheduler.num_waiting
