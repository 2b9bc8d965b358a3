"""One-token decode steps of the default model, float32 against bfloat16, at each CPU kernel level:
the measurement behind `auto` dtype's choice on the CPU (kernels/cpu_linear.py, BF16_LEVELS).

Greedy steps (the runner's argmax) at 64 to 64 + steps tokens of context, the same positions
every round; levels and dtypes interleaved round by round; each figure is the median step.

    PYTHONPATH=src python3 benchmarks/cpu_decode_levels.py [--levels portable,avx2] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from outpace.kernels import cpu_isa, cpu_kernels
from outpace.runner.model_runner import ModelRunner, Row
from outpace.weights.hub import DEFAULT_MODEL, resolve_model
from outpace.weights.loader import load_model

CONTEXT = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(cpu_isa.testable()))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    levels = args.levels.split(",")
    print(f"threads {torch.get_num_threads()}; {cpu_isa.cpu_description()}")
    folder = resolve_model(DEFAULT_MODEL)
    runners = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner(load_model(folder, dtype, "cpu", max_len=256), num_slots=1, max_len=256, max_step_tokens=8)
        runner.forward([Row(0, list(range(1000, 1000 + CONTEXT)), 0)], logits="none")
        runners[dtype] = runner
    times = {(level, dtype): [] for level in levels for dtype in runners}
    for _ in range(args.rounds):
        for level in levels:
            os.environ[cpu_isa.ENV] = level
            cpu_kernels.reload()
            assert cpu_kernels.level() == level
            for dtype, runner in runners.items():
                runner.forward([Row(0, [7], CONTEXT)], logits="tokens")
                for step in range(args.steps):
                    start = time.perf_counter()
                    runner.forward([Row(0, [7 + step], CONTEXT + step)], logits="tokens")
                    times[level, dtype].append(time.perf_counter() - start)
    for level in levels:
        f32, bf16 = (statistics.median(times[level, d]) * 1e3 for d in runners)
        print(f"{level:12s} float32 {f32:6.2f} ms/step  bfloat16 {bf16:6.2f} ms/step  bf16/fp32 speed {f32 / bf16:4.2f}x")


if __name__ == "__main__":
    main()
