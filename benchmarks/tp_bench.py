"""Tensor parallelism: batch-1 decode speed at N = 1, 2, 4 (8) ranks, against the memory-bandwidth
limit, and the verification cost T(1+k)/T(1), on random weights of Llama-3's shapes.

    PYTHONPATH=src python benchmarks/tp_bench.py --out $OUT                  # GPUs: 8B and 70B shapes
    PYTHONPATH=src python benchmarks/tp_bench.py --smoke --out /tmp/tp      # the CPU, a tiny shape

For each shape and N (the 8B shape at N = 1, 2, 4; the 70B shape at every N whose share of its
weights fits a card, i.e. 4 and 8), in a process of its own (at most --timeout-each seconds; a
size that runs out is reported, the others' rows kept), rank 0 and its workers build random
bfloat16 weights on their devices (never written to disk) and the runners the engine builds on a GPU (CUDA graphs, the
all-reduces captured in them; N = 1 is a plain CudaGraphRunner, the baseline of the same run).
Decoding is the runner's: one row on slot 0, each step's token the argmax of the last one's
logits, read on the host every step (as the engine's one synchronisation), at positions from 64
on. tokens/s = steps / time. The bandwidth limit at N is N x (one card's copy bandwidth, read
plus write, measured here on cuda:0) / all weight bytes (each rank reads its share once a
token); "without embedding" leaves out the embedding's bytes, of which a step reads one row.
T(1+k): one forward of a row of 1 + k tokens at position 64, median of repeated calls.
With --check, first: greedy output split over ranks equals one rank's, in float32, through the
engine (CUDA graphs, batched, n-gram speculation on the split engine): a random Llama-3-8B-shape
folder (bf16 weights saved once under --scratch, loaded as float32) at N = 2, and the default model
at N = 3 (its 9 query and 3 key/value heads do not split over 2); a divergence is reported with the
one-rank model's top-2 logit margin there (bench/margin.py), to tell a near-tie from a bug.
Prints tables and writes tp_bench.json under --out.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch

from outpace.bench.margin import divergence
from outpace.bench.models import LLAMA3_70B, LLAMA3_8B, random_llama, random_model
from outpace.config import SamplingParams
from outpace.llm import LLM
from outpace.paths import outpace_home
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import Row
from outpace.runner.parallel import ParallelRunner
from outpace.runner.workers import Workers

SMOKE_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
SHAPES = {"tiny shape": (SMOKE_SHAPE, True), "Llama-3-8B shape": (LLAMA3_8B, True),     # label: (shape, T(1+k)?)
          "Llama-3-70B shape": (LLAMA3_70B, False)}
RESULT = "tp_bench result: "    # a --one process's stdout line that carries its row as JSON
MAX_LEN = 1024
START = 64                      # decode and verify rows sit here (attention reads the 512-key bucket)
VERIFY_K = list(range(9))
EXIT_GRACE_S = 30.0             # a --one process's time to close its workers and exit after its row


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def weight_bytes(shape: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(all weight bytes, the embedding's) of a Llama shape."""
    H, I, L, V = (shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    D = H // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * D, shape["num_key_value_heads"] * D
    layer = H * (q + 2 * kv) + q * H + 3 * I * H + 2 * H
    head = 0 if shape.get("tie_word_embeddings") else V * H
    size = torch.empty(0, dtype=dtype).element_size()
    return (V * H + head + L * layer + H) * size, V * H * size


def copy_bandwidth(device: str) -> float:
    """Bytes read plus written per second by a copy of 1 GiB (256 MiB on the CPU)."""
    n = 2**30 if device == "cuda" else 2**28
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / min(times)


def build(shape: dict, n: int, device: str, dtype: torch.dtype):
    """(runner, workers or None): rank 0's runner for the shape over n ranks."""
    make = partial(CudaGraphRunner, num_slots=1, max_len=MAX_LEN, max_step_tokens=1 + VERIFY_K[-1],
                   num_draft_tokens=VERIFY_K[-1], batch_sizes=[1], kv_lens=[512], progress=False)
    load = partial(random_model, shape, dtype, MAX_LEN)
    if n == 1:
        return make(load(device=device)), None
    workers = Workers.start(n, device, load)
    return ParallelRunner(make, load(device=device, shard=workers.shard), workers), workers


def decode_rate(runner, device: str, steps: int) -> float:
    """Greedy decoding of one row: tokens/s over `steps` steps, after as many untimed."""
    runner.forward([Row(0, list(range(1, START + 1)), 0)], logits="none")

    def run():
        token = 1
        for i in range(steps):
            logits, _ = runner.forward([Row(0, [token], START + i)])
            token = int(logits[0, -1].argmax())        # the step's host synchronisation

    run()                                               # first calls allocate, clocks ramp up
    t0 = time.perf_counter()
    run()
    return steps / (time.perf_counter() - t0)


def verify_seconds(runner, device: str, reps: int) -> list[float]:
    """T(1 + k) for k in VERIFY_K: the median of 3 rounds of `reps` back-to-back forwards."""
    seconds = []
    for k in VERIFY_K:
        rows = [Row(0, [7] * (1 + k), START)]
        runner.forward(rows)
        rounds = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                runner.forward(rows)
            sync(device)
            rounds.append((time.perf_counter() - t0) / reps)
        seconds.append(statistics.median(rounds))
    return seconds


def fits(shape: dict, n: int, device: str, dtype: torch.dtype) -> bool:
    """Whether a rank's share of the weights fits 85% of a card (the CPU: always)."""
    if device != "cuda":
        return True
    return weight_bytes(shape, dtype)[0] / n < 0.85 * torch.cuda.get_device_properties(0).total_memory


def measure_one(shape: dict, n: int, args, bandwidth: float, verify: bool) -> None:
    """Prints the decode rate (and T(1+k)) of the shape over n ranks, measured in this process."""
    total, embedding = weight_bytes(shape, args.dtype)
    t0 = time.perf_counter()
    runner, workers = build(shape, n, args.device, args.dtype)
    log(f"N = {n}: built in {time.perf_counter() - t0:.1f} s")
    try:
        rate = decode_rate(runner, args.device, args.steps)
        log(f"N = {n}: decode {rate:.1f} tokens/s")
        limit = n * bandwidth / total
        row = {"decode_tokens_per_s": rate, "limit_tokens_per_s": limit,
               "limit_without_embedding_tokens_per_s": n * bandwidth / (total - embedding),
               "of_limit": rate / limit}
        if verify:
            seconds = verify_seconds(runner, args.device, args.reps)
            row["verify_seconds"] = seconds
            row["verify_ratio"] = [s / seconds[0] for s in seconds]
            log(f"N = {n}: T(1+k) measured")
        print(RESULT + json.dumps(row), flush=True)     # before closing: a hang there keeps the row
    finally:
        if workers is not None:
            log(f"N = {n}: closing the workers")
            faulthandler.dump_traceback_later(EXIT_GRACE_S / 2)    # where a hanging close waits
            workers.close()
            faulthandler.cancel_dump_traceback_later()


def measure(label: str, shape: dict, sizes: list[int], args, bandwidth: float) -> dict:
    """Each N in a process of its own (this script with --one), so that one size's state (CUDA
    graphs, a process group, memory) never reaches the next, and a size that hangs or fails
    costs only its --timeout-each: the others' rows are kept. The process prints its row before
    it closes its workers; one that has not exited EXIT_GRACE_S after it dumps its threads' stacks
    (SIGUSR1) and is killed with its workers, and the row says so."""
    total, embedding = weight_bytes(shape, args.dtype)
    out = {"weight_bytes": total, "embedding_bytes": embedding, "by_size": {}, "failed": {}}
    for n in sizes:
        if not fits(shape, n, args.device, args.dtype):
            log(f"[{label}] N = {n}: a rank's {total / n / 2**30:.1f} GiB of weights do not fit a card; skipped")
            continue
        command = [sys.executable, __file__, "--out", args.out, "--one", f"{label}:{n}", "--bandwidth", str(bandwidth),
                   "--steps", str(args.steps), "--reps", str(args.reps)] + (["--smoke"] if args.smoke else [])
        t0 = time.perf_counter()
        row, failure = run_one(command, args.timeout_each)
        if row is not None:
            out["by_size"][n] = row
        if failure:
            out["failed"][n] = failure
        log(f"[{label}] N = {n} ({time.perf_counter() - t0:.0f} s): {row or ''} {failure or ''}")
    return out


def run_one(command: list[str], timeout: float) -> tuple[dict | None, str | None]:
    """(the --one process's row or None, what went wrong or None)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    row, deadline = None, time.monotonic() + timeout
    while row is None and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                reader.join(2.0)        # its last lines
                if lines.empty():
                    break
            continue
        if line.startswith(RESULT):
            row = json.loads(line.removeprefix(RESULT))
    try:
        code = proc.wait(EXIT_GRACE_S if row is not None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGUSR1)                 # its and its workers' stacks, to stderr
        time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if row is None:
            return None, f"no result within --timeout-each {timeout} s (stacks above)"
        return row, f"the result came, then the process did not exit within {EXIT_GRACE_S} s (stacks above)"
    if row is None:
        return None, f"exited {code} without a result"
    return row, None if code == 0 else f"exited {code} after its result"


CHECK_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                 "List the planets of the solar system: Mercury, Venus,", "Once upon a time"]


def greedy_check(label: str, model: str, n: int, args) -> dict:
    """Greedy outputs of `model` in float32 over n ranks (n-gram speculation) and over one (plain)."""
    params = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
    options = dict(dtype="float32", device=args.device, max_num_seqs=2, max_model_len=512, max_prefill_tokens=32,
                   calibrate=False)
    with LLM(model, spec="ngram", tensor_parallel_size=n, **options) as llm:
        split = [o.token_ids for o in llm.generate(CHECK_PROMPTS, params)]
    with LLM(model, spec="none", **options) as llm:
        outs = llm.generate(CHECK_PROMPTS, params)
        divergences = [divergence(llm.engine, o.prompt_token_ids, s, o.token_ids) for o, s in zip(outs, split)]
    found = [d for d in divergences if d is not None]
    log(f"[check {label}] N = {n}: {len(CHECK_PROMPTS) - len(found)} of {len(CHECK_PROMPTS)} outputs equal N = 1's"
        + (f"; divergences: {found}" if found else ""))
    return {"size": n, "equal": len(CHECK_PROMPTS) - len(found), "of": len(CHECK_PROMPTS), "divergences": found}


def checks(args, gpus: int) -> dict:
    out = {}
    # the smoke shape with the default model's vocabulary: the prompts are its tokenizer's ids
    shape = dict(SMOKE_SHAPE, vocab_size=49152) if args.smoke else LLAMA3_8B
    folder = random_llama(shape, Path(args.scratch) / ("random-tiny" if args.smoke else "random-llama3-8b"))
    if gpus >= 2:
        out["random Llama shape"] = greedy_check("random Llama shape", str(folder), 2, args)
    if not args.smoke and gpus >= 3:
        out["default model"] = greedy_check("default model", "smollm2-135m", 3, args)
    return out


def report(label: str, result: dict, dtype: torch.dtype) -> None:
    for n, why in result["failed"].items():
        print(f"\n{label}, N = {n}: {why}")
    rows = result["by_size"]
    if not rows:
        return
    base = rows.get(1, {}).get("decode_tokens_per_s")
    print(f"\n### Batch-1 decode, {label}, random {str(dtype).removeprefix('torch.')} weights "
          f"({result['weight_bytes'] / 1e9:.2f} GB)")
    print("| N | tokens/s | x N = 1 | limit tokens/s | of limit | limit without embedding |")
    print("|---|---|---|---|---|---|")
    for n, r in rows.items():
        speedup = f"{r['decode_tokens_per_s'] / base:.2f}" if base else "-"
        print(f"| {n} | {r['decode_tokens_per_s']:.1f} | {speedup} | {r['limit_tokens_per_s']:.1f} | "
              f"{r['of_limit']:.3f} | {r['limit_without_embedding_tokens_per_s']:.1f} |")
    if any("verify_ratio" in r for r in rows.values()):
        print(f"\n### Verification cost T(1+k)/T(1), {label}, one row at position {START} (T(1) in ms)")
        print("| N | T(1) ms | " + " | ".join(f"k={k}" for k in VERIFY_K[1:]) + " |")
        print("|---|---|" + "---|" * len(VERIFY_K[1:]))
        for n, r in rows.items():
            print(f"| {n} | {r['verify_seconds'][0] * 1e3:.3f} | "
                  + " | ".join(f"{x:.3f}" for x in r["verify_ratio"][1:]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for tp_bench.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, N = 1 and 2 (checks the script)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="N to run (default 1 2 4, and 8 on 8 GPUs)")
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed (default 128)")
    parser.add_argument("--reps", type=int, default=20, help="forwards per round of T(1+k) (default 20)")
    parser.add_argument("--shapes", nargs="+", choices=["8b", "70b"], default=["8b", "70b"],
                        help="the Llama-3 shapes to run (default both)")
    parser.add_argument("--check", action="store_true", help="first, greedy output over N ranks equals one rank's")
    parser.add_argument("--check-tokens", type=int, default=64, help="tokens a prompt of --check (default 64)")
    parser.add_argument("--scratch", default=str(outpace_home() / "models"),
                        help="where --check saves its random model once (default: the outpace cache's models)")
    parser.add_argument("--timeout-each", type=float, default=300.0,
                        help="seconds a shape at one N may take, building included (default 300)")
    parser.add_argument("--one", help=argparse.SUPPRESS)               # "LABEL:N": one size, in this process
    parser.add_argument("--bandwidth", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.steps, args.reps = min(args.steps, 16), min(args.reps, 3)
    if not 1 <= args.steps <= 512 - START - len(VERIFY_K):
        parser.error(f"--steps must be in [1, {512 - START - len(VERIFY_K)}]: rows stay in the 512-key graphs")
    if args.one:
        label, n = args.one.rsplit(":", 1)
        shape, verify = SHAPES[label]
        faulthandler.register(signal.SIGUSR1, all_threads=True)    # the driver's way to see a hang
        measure_one(shape, int(n), args, args.bandwidth, verify)
        log(f"N = {n}: workers closed")
        return
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    sizes = [n for n in (args.sizes or [1, 2, 4, 8]) if n <= gpus]
    bandwidth = copy_bandwidth(args.device)
    results = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "gpus": gpus,
               "torch": torch.__version__, "copy_bandwidth_Bps": bandwidth, "shapes": {}}
    log(f"copy bandwidth (read + write) on {results['device']}: {bandwidth / 1e9:.1f} GB/s")
    if args.check:
        results["checks"] = checks(args, gpus)
    if args.smoke:
        shapes = [("tiny shape", sizes)]
    else:
        shapes = [("Llama-3-8B shape", [n for n in sizes if n <= 4])] if "8b" in args.shapes else []
        if "70b" in args.shapes:
            shapes.append(("Llama-3-70B shape", [n for n in sizes if n >= 2]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for label, shape_sizes in shapes:
        results["shapes"][label] = measure(label, SHAPES[label][0], shape_sizes, args, bandwidth)
        report(label, results["shapes"][label], args.dtype)
        (out / "tp_bench.json").write_text(json.dumps(results, indent=1))     # kept if a later shape hangs
    print(f"\nwritten: {out / 'tp_bench.json'}")


if __name__ == "__main__":
    main()
