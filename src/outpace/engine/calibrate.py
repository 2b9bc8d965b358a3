"""Measure the verify cost curve T(batch, tokens per row) that the draft controller trades off.

The curve depends only on the model's shapes, the dtype, the device and the thread count, so it
is measured once and kept in `<outpace home>/calibration/`; delete that folder to measure again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import torch
from tqdm import tqdm

from outpace.engine.model_runner import ModelRunner, Row
from outpace.model.gguf import outpace_home

CONTEXT = 128   # positions the timing rows sit at: a typical short context


def batch_buckets(max_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_seqs]
    return buckets + [max_seqs]


def measure_verify_cost(runner: ModelRunner, max_seqs: int, max_tokens: int, reps: int = 3) -> dict[int, list[float]]:
    """cost[b][s-1] = best-of-reps seconds of one forward over b rows of s tokens. Runs before any
    request is admitted: it writes scratch keys into the slots it uses, which later prefills overwrite."""
    shape = dataclasses.asdict(runner.model.cfg)
    key = json.dumps([shape, str(runner.dtype), str(runner.device), torch.get_num_threads(), torch.__version__,
                      type(runner).__name__, max_seqs, max_tokens], sort_keys=True, default=str)
    path = outpace_home() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return {int(b): curve for b, curve in json.loads(path.read_text()).items()}
    cost: dict[int, list[float]] = {}
    shapes = [(b, s) for b in batch_buckets(max_seqs) for s in range(1, max_tokens + 1)]
    runner.forward([Row(0, [0] * max_tokens, CONTEXT)])          # warm-up: first calls allocate
    for b, s in tqdm(shapes, desc="outpace: measuring verify cost (once per model and machine)", leave=False):
        rows = [Row(slot, [0] * s, CONTEXT) for slot in range(b)]
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.forward(rows)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            best = min(best, time.perf_counter() - t0)
        cost.setdefault(b, []).append(best)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cost))
    return cost
