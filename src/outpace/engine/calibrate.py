"""Measure the verify cost curve T(batch, tokens per row) that the draft controller trades off."""
from __future__ import annotations

import time

from tqdm import tqdm

from outpace.engine.model_runner import ModelRunner, Row

CONTEXT = 128   # positions the timing rows sit at: a typical short context


def batch_buckets(max_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_seqs]
    return buckets + [max_seqs]


def measure_verify_cost(runner: ModelRunner, max_seqs: int, max_tokens: int, reps: int = 3) -> dict[int, list[float]]:
    """cost[b][s-1] = best-of-reps seconds of one forward over b rows of s tokens. Runs before any
    request is admitted: it writes scratch keys into the slots it uses, which later prefills overwrite."""
    cost = {}
    shapes = [(b, s) for b in batch_buckets(max_seqs) for s in range(1, max_tokens + 1)]
    runner.forward([Row(0, [0] * max_tokens, CONTEXT)])          # warm-up: first calls allocate
    for b, s in tqdm(shapes, desc="outpace: measuring verify cost", leave=False, disable=len(shapes) < 20):
        rows = [Row(slot, [0] * s, CONTEXT) for slot in range(b)]
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.forward(rows)
            best = min(best, time.perf_counter() - t0)
        cost.setdefault(b, []).append(best)
    return cost
