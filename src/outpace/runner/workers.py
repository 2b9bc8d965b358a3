"""Workers: the processes of ranks 1..N-1 under tensor parallelism, from start to shutdown.

Two ways to start them:
- spawned (the default): the driver, rank 0 (the process that builds the engine), starts N-1
  processes on this host with torch.multiprocessing's spawn, rank r on cuda:r (or the CPU, where
  each rank takes its share of the driver's threads), and forms the process group over a TCPStore
  on a free local port;
- torchrun (several hosts): torchrun starts every rank; rank 0 runs the outpace command and the
  others `run_worker()` (the outpace command calls it itself on ranks other than 0); the group
  forms from torchrun's environment, rank r on cuda:LOCAL_RANK.
Collectives of the model run in the default group (NCCL for CUDA tensors, gloo for CPU ones); the
channel (runner/parallel.py) through a mailbox in shared memory for spawned workers on x86-64,
and in a gloo group of its own, without a practical timeout, for what does not fit it and under
torchrun: a worker waits in it for as long as the engine is idle. Rank 0 sends each worker how to load its shard
(the loader, the device kind, the threads), then how to build its runner (ParallelRunner).

Shutdown, in every case without a process left behind:
- close() (LLMEngine.close, LLM.close, and at interpreter exit): STOP on the channel, then each
  worker leaves its loop, frees its CUDA graphs, leaves the group and exits; joined, killed after
  a grace period; then rank 0 frees its graphs and leaves the group (_leave_group). After a forward cut
  short (Ctrl-C in the driver) the workers wait in a collective that will never complete: killed
  at once.
- A worker dies: the driver's collective fails (gloo: mostly at once, the peer's sockets close,
  and else its wait, in slices, sees the monitor thread's word that the process ended; NCCL: the
  monitor thread aborts the communicators so that nothing waits on the dead rank) and
  collective() raises WorkerFailedError naming the rank and how it ended; the other workers are
  killed. A worker that dies while the engine is idle fails the next forward.
- The driver dies: each worker's watch thread sees its parent change and exits.
- Ctrl-C reaches every process of the terminal: workers ignore it; the driver closes them.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import multiprocessing.connection
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from outpace.errors import InvalidParameterError, WorkerFailedError
from outpace.model.config import ModelConfig
from outpace.model.registry import FAMILIES
from outpace.model.tensor_parallel import Shard, check_shardable
from outpace.runner.parallel import STOP, Channel, Mailbox, serve
from outpace.weights.loader import load_model

CHANNEL_TIMEOUT = datetime.timedelta(days=365)
STARTUP_TIMEOUT_S = 300         # spawn, import torch, join the group (not the model's load)
# spawned workers (one host) read rank 0's messages from shared memory where the CPU keeps stores
# in order (Mailbox); elsewhere, and under torchrun (several hosts), from gloo broadcasts
MAILBOX_MACHINE = platform.machine() in ("x86_64", "AMD64")
STOP_GRACE_S = 10               # a worker's time to leave its loop after STOP
LEAVE_GRACE_S = 10              # aborting the NCCL communicators, which blocks while a graph holds them
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class LoadSpec:
    """How a worker loads its shard: load(device=..., shard=...) -> the model."""

    load: Callable
    device: str                 # "cpu" or "cuda" (a worker takes cuda:<local rank>)
    threads: int                # torch threads a rank (the CPU)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) of a process torchrun started, else None."""
    if not all(k in os.environ for k in TORCHRUN_ENV) or int(os.environ["WORLD_SIZE"]) < 2:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _backend() -> str:
    return "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"


def exit_status(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Workers:
    """The driver's side of ranks 1..N-1: the channel to them, their processes (none under
    torchrun), and the rule that a failed collective ends the engine with a clear error."""

    def __init__(self, world_size: int, channel: Channel, processes: list, device: str, threads: int):
        self.shard = Shard(0, world_size, failed=lambda: self.failure is not None)
        self.channel, self.processes, self.device = channel, processes, device
        self.threads_before = torch.get_num_threads()
        if device == "cpu":
            torch.set_num_threads(threads)
        self.failure: str | None = None     # set once the engine cannot go on
        self.in_flight = False              # a collective began and did not end
        self.closed = False
        self.runner = None                  # rank 0's runner (ParallelRunner sets it): its graphs go first
        atexit.register(self.close)
        if processes:
            threading.Thread(target=self._monitor, name="outpace-tp-monitor", daemon=True).start()

    @classmethod
    def start(cls, world_size: int, device: str, load: Callable) -> "Workers":
        """Start ranks 1..world_size-1 (or join torchrun's), form the group, and send each the
        loader of its shard. device: the driver's, "cpu" or "cuda"."""
        if dist.is_initialized():
            raise InvalidParameterError("this process holds a torch.distributed process group already: one "
                                        "tensor-parallel engine a process (close the other one first)")
        if device not in ("cpu", "cuda"):
            raise InvalidParameterError(f"under tensor parallelism rank r runs on cuda:r (or the CPU); pass "
                                        f"--device cuda or cpu, not {device}")
        launched = torchrun_rank()
        if device == "cuda" and launched is None and torch.cuda.device_count() < world_size:
            raise InvalidParameterError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs; torch sees "
                                        f"{torch.cuda.device_count()}")
        threads = max(1, torch.get_num_threads() // world_size)
        processes, init, mailbox = [], dict(init_method="env://"), None
        if launched is not None and (launched[1] != world_size or launched[0] != 0):
            raise InvalidParameterError(f"torchrun started {launched[1]} processes; run with "
                                        f"--tensor-parallel-size {launched[1]} (this is rank {launched[0]})")
        try:
            if launched is None:
                store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
                init = dict(store=store)
                mailbox = Mailbox.allocate(world_size) if MAILBOX_MACHINE else None
                context = mp.get_context("spawn")
                processes = [context.Process(target=_spawned, args=(rank, world_size, store.port, mailbox),
                                             name=f"outpace-tp-{rank}", daemon=True) for rank in range(1, world_size)]
                for p in processes:
                    p.start()
                _wait_joined(store, processes)
            if device == "cuda":
                torch.cuda.set_device(0 if launched is None else launched[2])
            dist.init_process_group(_backend(), rank=0, world_size=world_size, **init)
            channel = Channel(dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT), 0,
                              None if mailbox is None else Mailbox(mailbox, world_size),
                              failed=lambda: any(p.exitcode is not None for p in processes))
        except BaseException:
            _kill(processes)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        workers = cls(world_size, channel, processes, device, threads)
        with workers.collective():
            channel.send_object(LoadSpec(load, device, threads))
        return workers

    @contextlib.contextmanager
    def collective(self):
        """Around work that every rank must take part in. Where it fails, the ranks are out of
        step for good: the workers are stopped and WorkerFailedError says why."""
        if self.failure is not None:        # the monitor saw a worker end
            self.close()
            raise WorkerFailedError(self.failure)
        self.in_flight = True
        try:
            yield
        except RuntimeError as error:       # torch.distributed's errors included
            raise self._fail(error) from error
        except BaseException:               # Ctrl-C, or a bug: the workers wait in a collective
            self.failure = "a tensor-parallel forward was cut short; the engine cannot go on: start it again"
            self.close()
            raise
        self.in_flight = False

    def _fail(self, error: BaseException) -> WorkerFailedError:
        # a collective notices a dead peer's closed sockets before its process is reaped
        deadline = time.monotonic() + 2.0
        dead = []
        while not dead and time.monotonic() < deadline:
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes, 1) if p.exitcode is not None]
            time.sleep(0.02)
        if dead:
            rank, code = dead[0]
            self.failure = f"tensor-parallel worker {rank} {exit_status(code)}"
        else:
            self.failure = f"a tensor-parallel forward failed ({str(error)[:300]})"
        self.failure += "; the engine cannot go on: start it again"
        self.close()
        return WorkerFailedError(self.failure)

    def _monitor(self) -> None:
        """Watch the workers' processes; on CUDA, free a driver that waits on a dead rank."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
        ended = multiprocessing.connection.wait(list(sentinels))
        if self.closed:
            return
        rank = sentinels[ended[0]]
        self.failure = (f"tensor-parallel worker {rank} {exit_status(self.processes[rank - 1].exitcode)}; "
                        f"the engine cannot go on: start it again")
        if self.device == "cuda":
            # NCCL kernels of a collective with a dead rank never finish; aborting the
            # communicators ends them, and the driver's next collective raises
            print(f"outpace: {self.failure}", file=sys.stderr)
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        graceful = self.failure is None and not self.in_flight
        if graceful:
            try:
                self.channel.send(STOP, timeout=STOP_GRACE_S)
            except RuntimeError:
                graceful = False
        deadline = time.monotonic() + (STOP_GRACE_S if graceful else 0)
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        _kill(self.processes)
        if self.runner is not None:
            self.runner.release_graphs()
        _leave_group(self.device, cut=not graceful)
        if self.device == "cpu":
            torch.set_num_threads(self.threads_before)


def _wait_joined(store: dist.TCPStore, processes: list) -> None:
    """Wait until every spawned worker is about to join the group (a worker that fails to start
    would leave rank 0 waiting in init_process_group for good)."""
    keys = [f"outpace/joined/{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        failed = [(rank, p.exitcode) for rank, p in enumerate(processes, 1) if p.exitcode is not None]
        if failed or time.monotonic() > deadline:
            _kill(processes)
            rank, code = failed[0] if failed else (1, None)
            raise WorkerFailedError(f"tensor-parallel worker {rank} {exit_status(code)} while starting "
                                    f"(its error is above)")
        time.sleep(0.02)


def _kill(processes: list) -> None:
    """Kill those still running, and reap them all (those never started: nothing to do)."""
    for p in processes:
        if p.pid is None:
            continue
        if p.exitcode is None:
            p.kill()
        p.join()


# ---- the worker's side ----------------------------------------------------------------------
def _spawned(rank: int, world_size: int, port: int, mailbox: torch.Tensor | None) -> None:
    """A spawned worker process (mailbox: rank 0's shared buffer, where the machine allows one)."""
    store = dist.TCPStore("127.0.0.1", port, world_size, False)
    store.set(f"outpace/joined/{rank}", "1")
    _serve(rank, world_size, rank, dict(store=store), None if mailbox is None else Mailbox(mailbox, world_size))


def run_worker() -> None:
    """Rank r > 0 of a torchrun launch: load this rank's shard as rank 0 says and serve its
    forwards until rank 0 stops."""
    rank, world_size, local_rank = torchrun_rank()
    _serve(rank, world_size, local_rank, dict(init_method="env://"))


def _serve(rank: int, world_size: int, local_rank: int, init: dict, mailbox: Mailbox | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is the driver's to handle
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `kill -USR1`: where a worker waits
    _watch_parent(rank)
    if local_rank < torch.cuda.device_count():          # NCCL's communicator forms on the current device
        torch.cuda.set_device(local_rank)
    dist.init_process_group(_backend(), rank=rank, world_size=world_size, **init)
    channel = Channel(dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT), rank, mailbox)
    try:
        spec: LoadSpec = channel.receive_object()
        if spec.device == "cpu":
            torch.set_num_threads(spec.threads)
        model = spec.load(device=f"cuda:{local_rank}" if spec.device == "cuda" else "cpu",
                          shard=Shard(rank, world_size))
        runner = channel.receive_object()(model)
        serve(runner, channel)
        runner.release_graphs()
    except RuntimeError:
        # a collective fails at once when the driver's process ends; the watch thread then ends
        # this one with a line rather than this traceback
        time.sleep(1.0)
        raise
    _leave_group(spec.device)


def _leave_group(device: str, cut: bool = False) -> None:
    """Leave the process group without waiting for the other ranks. NCCL's orderly destroy
    waits until every rank destroys its communicators too, so a rank that has exited, been killed
    or not got there yet hangs it: on CUDA the communicators are aborted instead, which is local,
    but NCCL ends the abort only once no CUDA graph that captured their collectives exists
    (release_graphs first). If it has not ended in LEAVE_GRACE_S, the group is left as it is:
    this process cannot form another one.
    cut: a collective may still be in flight (a forward cut short, a worker gone). gloo runs it on
    a thread of its own, which waits for the other ranks until the group's timeout (30 minutes),
    and freeing the group joins that thread: the driver would hang there. So the groups are taken
    out of torch.distributed, which can then form new ones, and are never freed."""
    if device == "cuda":
        aborting = threading.Thread(target=_abort, name="outpace-tp-abort", daemon=True)
        aborting.start()
        aborting.join(LEAVE_GRACE_S)
        if aborting.is_alive():
            print(f"outpace: the NCCL communicators did not close in {LEAVE_GRACE_S} s (a CUDA graph that "
                  f"captured their collectives is still alive); left open", file=sys.stderr)
            return
    if dist.is_initialized():
        if cut:
            for group in list(dist.distributed_c10d._world.pg_map):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))     # never freed: see above
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _abort() -> None:
    with contextlib.suppress(Exception):
        dist.distributed_c10d._abort_process_group()


def _watch_parent(rank: int) -> None:
    """Exit when the process that started this one is gone (the driver, or torchrun's agent)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        print(f"outpace: tensor-parallel worker {rank}: its driver (pid {parent}) is gone; exiting", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="outpace-tp-watch", daemon=True).start()


def start_workers(folder, dtype: torch.dtype, device: str, max_len: int, world_size: int) -> Workers:
    """Workers for the model in folder, each loading its shard of it; a model that cannot be
    split over world_size ranks is refused before any process starts."""
    cfg = ModelConfig.from_folder(folder)
    check_shardable(cfg, world_size, FAMILIES[cfg.family])
    return Workers.start(world_size, device, partial(load_model, folder, dtype, max_len=max_len))
