"""What logprobs and penalties cost plain decoding: one chat prompt, greedy, EOS ignored,
speculation off, each mode in turn over several rounds (this machine's spread shows in the min
and max); prints the median milliseconds a token of each mode.

    PYTHONPATH=src python3 benchmarks/sampling_costs.py [--model smollm2-135m] [--tokens 200] [--rounds 7]
        [--threads 2]

A row that asks for logprobs or has penalties needs its logits beyond their argmax (docs/DESIGN.md,
"Logprobs", "Penalties"); this times that on its own, where no other row shares its steps.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from outpace import LLM, SamplingParams

MODES = {"none": {}, "logprobs=5": dict(logprobs=5), "frequency_penalty=0.5": dict(frequency_penalty=0.5),
         "repetition_penalty=1.2": dict(repetition_penalty=1.2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, spec="none")
    messages = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
    times = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name, extra in MODES.items():
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, **extra)
            start = time.perf_counter()
            llm.chat(messages, params)
            times[name].append((time.perf_counter() - start) / args.tokens * 1e3)
    base = statistics.median(times["none"])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:24s} median {median:.2f} ms a token ({median / base:.3f}x none; min {min(ts):.2f}, "
              f"max {max(ts):.2f})")


if __name__ == "__main__":
    main()
