"""Tensor parallelism on the CPU: gloo, worker processes spawned by the engine itself.

Greedy output split over N ranks equals one rank's token for token in float32 (row-parallel sums
round differently in the last bits, which these models never bring near a tie), with batching
beyond the slots, prompt chunks beside decode rows, a vocabulary that does not divide by N and a
message longer than the channel's first broadcast; n-gram speculation under N = 2 equals plain
N = 1; a dead worker or driver ends the other side within seconds, and no process is left.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from outpace.config import SamplingParams
from outpace.errors import InvalidParameterError, UnsupportedModelError, WorkerFailedError
from outpace.llm import LLM
from outpace.model.tensor_parallel import Shard
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import Row
from outpace.runner.parallel import ForwardCall, ParallelRunner
from outpace.runner.workers import Workers
from outpace.weights.loader import load_model
from tiny import make_tiny

# repeating prompts (n-gram drafts) and short ones
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42], list(range(500, 520)) * 2]
LONG = list(range(1000, 1600)) * 7         # its one prompt chunk overflows the channel's first broadcast
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def options(**kw):
    """Fewer slots than prompts, small prompt chunks riding in decode forwards."""
    return dict(dtype="float32", device="cpu", max_num_seqs=3, max_model_len=4300, max_prefill_tokens=8,
                calibrate=False) | kw


def assert_no_workers_left() -> None:
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-tp")
    # 49155 = 2 x 24577 + 1: the last rank's vocabulary rows are padded
    make_tiny("llama", folder, vocab_size=49155, tokenizer_from=default_model_dir)
    return folder


@pytest.fixture(scope="module")
def plain_outputs(tiny_folder):
    """One rank, each prompt cached in one chunk."""
    with LLM(str(tiny_folder), spec="none", **options(max_prefill_tokens=len(LONG))) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS + [LONG], PARAMS)]


def test_two_ranks_equal_one(tiny_folder, plain_outputs):
    with LLM(str(tiny_folder), spec="none", tensor_parallel_size=2, **options()) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert outputs == plain_outputs[:len(PROMPTS)]
    assert_no_workers_left()


def test_ngram_speculation_on_two_ranks_equals_plain_one(tiny_folder, plain_outputs):
    """Rank 0 drafts; every rank verifies the same tokens."""
    with LLM(str(tiny_folder), spec="ngram", tensor_parallel_size=2, **options(max_prefill_tokens=len(LONG))) as llm:
        outs = llm.generate(PROMPTS + [LONG], PARAMS)
    assert [o.token_ids for o in outs] == plain_outputs
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0
    assert_no_workers_left()


def test_default_model_on_three_ranks_equals_one(default_model_dir):
    """smollm2-135m: 9 query heads and 3 key/value heads split over 3 ranks (not 2: see below)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    opts = options(max_num_seqs=2, max_model_len=256, max_prefill_tokens=16)
    with LLM("smollm2-135m", spec="none", weights="fp32", **opts) as llm:   # as the ranks: the float copy
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("smollm2-135m", spec="ngram", tensor_parallel_size=3, **opts) as llm:
        split = [o.token_ids for o in llm.generate(prompts, params)]
    assert split == plain
    assert_no_workers_left()


def test_heads_that_do_not_divide_are_refused_before_any_process_starts(default_model_dir):
    with pytest.raises(InvalidParameterError, match="9 query heads do not divide by --tensor-parallel-size 2"):
        LLM("smollm2-135m", tensor_parallel_size=2, device="cpu", calibrate=False)
    assert_no_workers_left()


def test_recurrent_models_are_refused(tmp_path, default_model_dir):
    make_tiny("qwen3_5", tmp_path, vocab_size=49152, tokenizer_from=default_model_dir)
    with pytest.raises(UnsupportedModelError, match="tensor-parallel-size 1"):
        LLM(str(tmp_path), tensor_parallel_size=2, device="cpu", calibrate=False)
    assert_no_workers_left()


def test_forward_calls_survive_the_channel_encoding():
    call = ForwardCall([Row(2, [5, 6, 7], 40), Row(0, [9], 3)], "tokens", (1, 3), [Row(1, list(range(20)), 0)])
    assert ForwardCall.decode(call.encode()) == call


def test_a_graph_runner_under_two_ranks(tiny_folder):
    """The CUDA graph runner's static-buffer steps (run eagerly on the CPU) built on every rank
    from rank 0's arguments: a prompt chunk, then padded verify rows on scattered slots; logits
    as one rank's to rounding, the same argmax."""
    make = partial(CudaGraphRunner, num_slots=4, max_len=128, max_step_tokens=16, num_draft_tokens=3,
                   use_graphs=False)
    load = partial(load_model, tiny_folder, torch.float32, max_len=128)
    chunk, rows = Row(1, list(range(30, 46)), 0), [Row(1, [46, 47], 16), Row(3, [5], 0)]
    one = make(load(device="cpu"))
    one.forward([chunk], logits="none")
    expected, _ = one.forward(rows)
    workers = Workers.start(2, "cpu", load)
    try:
        runner = ParallelRunner(make, load(device="cpu", shard=workers.shard), workers)
        runner.forward([chunk], logits="none")
        logits, _ = runner.forward(rows)
    finally:
        workers.close()
    assert logits.shape == expected.shape == (2, 2, 49155)        # rows padded to the tier of 2 tokens
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert_no_workers_left()


def test_a_killed_worker_ends_the_run_with_a_clear_error(tiny_folder):
    llm = LLM(str(tiny_folder), spec="none", tensor_parallel_size=2, **options())
    worker = multiprocessing.active_children()[0]
    killed_at = []

    def kill_once(seq):
        if not killed_at:
            os.kill(worker.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(WorkerFailedError, match="worker 1 was killed by SIGKILL"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), on_tokens=kill_once)
    assert time.monotonic() - killed_at[0] < 5
    assert_no_workers_left()
    with pytest.raises(WorkerFailedError, match="cannot go on"):       # and it stays failed
        llm.generate(PROMPTS[:1], PARAMS)
    llm.close()


DRIVER = textwrap.dedent("""
    import faulthandler, multiprocessing, signal, sys
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # the test's stack dump if it hangs
    # Ctrl-C as in a terminal: a shell's background job (a CI run started with &) passes SIGINT on
    # ignored, and Python then leaves it ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from outpace.config import SamplingParams
    from outpace.llm import LLM
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], spec="none", tensor_parallel_size=2, device="cpu", dtype="float32", calibrate=False,
                  max_model_len=4096)
        print(multiprocessing.active_children()[0].pid, flush=True)
        llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
""")


def driver_env() -> dict:
    """The environment of a subprocess that imports this checkout's outpace."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")]))


def start_driver(folder, tmp_path) -> tuple[subprocess.Popen, int]:
    """DRIVER in a session of its own (a terminal's process group), once its worker runs: the
    process and the worker's pid."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=driver_env(), text=True, start_new_session=True)
    return driver, int(driver.stdout.readline())


def fail_hung(driver: subprocess.Popen, worker: int, what: str) -> None:
    """Kill a driver that did not end, failing with where it and its worker waited: every thread's
    Python stack on its stderr (faulthandler), and the driver's native stacks."""
    os.kill(driver.pid, signal.SIGUSR1)
    if _alive(worker):
        os.kill(worker, signal.SIGUSR1)                 # the worker's stacks, on the same stderr
    time.sleep(1.0)
    native = native_stacks(driver.pid)
    driver.kill()
    pytest.fail(f"{what}; its stderr:\n{driver.stderr.read()[-8000:]}\n{native}")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_no_worker_outlives_its_driver(how, tiny_folder, tmp_path):
    """SIGKILL: the driver dies mid-run, and the worker exits by itself. SIGINT (Ctrl-C, sent to
    the terminal's whole process group): the workers ignore it, the driver stops them."""
    driver, worker = start_driver(tiny_folder, tmp_path)
    try:
        time.sleep(1.0)                                     # mid-generation
        os.killpg(driver.pid, getattr(signal, how))
        try:
            driver.wait(timeout=20)
        except subprocess.TimeoutExpired:
            fail_hung(driver, worker, f"the driver did not exit in 20 s after {how}")
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)
        if how == "SIGINT":
            assert "KeyboardInterrupt" in driver.stderr.read()
    finally:
        driver.kill()


def test_a_worker_killed_while_its_driver_is_stopped_fails_the_driver(tiny_folder, tmp_path):
    """The worker dies while the driver is stopped (SIGSTOP), mid-forward or between two. gloo
    could then leave the driver's next collective waiting for the dead peer until its 30-minute
    timeout, and freeing a group whose collective was cut short joins a gloo thread still waiting
    in it (each in 4-5 of 10 such drivers before the fix); the driver must end with
    WorkerFailedError at once. Three drivers, the stop at a different point of each."""
    for delay in (1.0, 1.1, 1.25):
        driver, worker = start_driver(tiny_folder, tmp_path)
        try:
            time.sleep(delay)                                   # mid-generation
            os.kill(driver.pid, signal.SIGSTOP)
            time.sleep(0.1)
            os.kill(worker, signal.SIGKILL)
            time.sleep(0.3)
            os.kill(driver.pid, signal.SIGCONT)
            try:
                driver.wait(timeout=15)
            except subprocess.TimeoutExpired:
                fail_hung(driver, worker, "the driver did not end in 15 s")
            assert "WorkerFailedError: tensor-parallel worker 1 was killed by SIGKILL" in driver.stderr.read()
        finally:
            driver.kill()


class SlicedWork:
    """A collective's work for Shard._wait, complete in its `done_after`-th slice: that slice
    returns, or (late) runs out just before the work completes; every wait then raises `error`
    where given (a failed collective)."""

    def __init__(self, done_after: int, error: str | None = None, late: bool = False):
        self.slices, self.done_after, self.error, self.late = 0, done_after, error, late

    def is_completed(self) -> bool:
        return self.slices >= self.done_after

    def wait(self, timeout=None) -> bool:
        if timeout is not None and not self.is_completed():
            self.slices += 1
            if self.late or not self.is_completed():
                raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_the_drivers_collective_waits_in_slices():
    """A slice that runs out is not a failure, even where the collective completes right after;
    a failed collective raises its own error; a worker's end fails a wait that would never end."""
    ended = []
    shard = Shard(0, 2, failed=lambda: bool(ended))
    x = torch.zeros(2)
    shard._wait(x, SlicedWork(done_after=3))
    shard._wait(x, SlicedWork(done_after=2, late=True))
    with pytest.raises(RuntimeError, match="connection closed"):
        shard._wait(x, SlicedWork(done_after=1, error="connection closed"))
    ended.append(True)
    with pytest.raises(RuntimeError, match="worker ended during a collective"):
        shard._wait(x, SlicedWork(done_after=1000))


def test_torchrun_starts_the_ranks_and_rank_0_runs_the_command(tiny_folder):
    """One host, two CPU processes: rank 0 runs `outpace generate`, rank 1 serves it."""
    prompt = "hello there, hello there"
    command = ["generate", "--model", str(tiny_folder), "--device", "cpu", "--dtype", "float32", "--prompt", prompt,
               "--max-tokens", "16", "--json", "--spec", "ngram"]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "outpace.cli",
                           *command, "--tensor-parallel-size", "2"], capture_output=True, text=True, env=driver_env(),
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    with LLM(str(tiny_folder), spec="none", device="cpu", dtype="float32", max_num_seqs=1, calibrate=False) as llm:
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].token_ids
    assert json.loads(done.stdout.strip().splitlines()[-1])["token_ids"] == plain


def native_stacks(pid: int) -> str:
    """gdb's backtrace of every thread of pid, where gdb is installed: a Python stack can show a
    collective's frames where the thread waits in a destructor that a freed traceback ran."""
    if shutil.which("gdb") is None:
        return "(no gdb: no native stacks)"
    try:
        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
                             capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return "(gdb did not answer in 60 s)"
    return "native stacks:\n" + "\n".join(line[:200] for line in out.splitlines() if line.startswith(("Thread", "#")))


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
