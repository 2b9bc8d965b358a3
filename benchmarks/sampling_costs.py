"""What logprobs and penalties cost: one chat prompt, greedy, EOS ignored, each mode in turn over
several rounds (this machine's spread shows in the min and max); prints the median milliseconds a
token of each mode.

    PYTHONPATH=src python3 benchmarks/sampling_costs.py [--model smollm2-135m] [--tokens 200] [--rounds 7]
        [--threads 2] [--device cpu|cuda] [--spec none|ngram|eagle3|...]
        [--dataset ../shared/data/spec_bench_question.jsonl --category summarization]

A row that asks for logprobs or has penalties needs its logits beyond their argmax (docs/DESIGN.md,
"Logprobs", "Penalties"); this times that on its own, where no other row shares its steps. With
--spec, every mode is timed plainly and speculating; on a GPU a row whose logits are shaped
verifies outside the CUDA graph step (one asking for logprobs stays in it), which this prices.
Ratios are to plain decoding asking for none, in the same run.
With --dataset and --category the prompt is that category's first question (summarization's, 739
tokens for the default model: a repetition penalty's columns include the prompt's tokens).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from outpace import LLM, SamplingParams
from outpace.bench.dataset import load_spec_bench

MODES = {"none": {}, "logprobs=5": dict(logprobs=5), "frequency_penalty=0.5": dict(frequency_penalty=0.5),
         "repetition_penalty=1.2": dict(repetition_penalty=1.2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the engine's choice)")
    p.add_argument("--spec", default="none", help="speculation method every mode runs with")
    p.add_argument("--dataset", help="Spec-Bench JSONL: the prompt is --category's first question")
    p.add_argument("--category", default="summarization")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, spec=args.spec, **({"device": args.device} if args.device else {}))
    prompt = (load_spec_bench(args.dataset, [args.category], 1)[0].turns[0] if args.dataset
              else "Write a long story about a dragon who learns to cook.")
    messages = [{"role": "user", "content": prompt}]
    # with --spec each mode runs plainly and speculating: (mode, speculate)
    runs = [(name, speculate) for name in MODES for speculate in ((False, True) if args.spec != "none" else (False,))]
    times = {run: [] for run in runs}
    for round_ in range(args.rounds + 1):     # the first round warms up and is not counted
        for name, speculate in runs:
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, **MODES[name])
            start = time.perf_counter()
            llm.chat(messages, params, speculate=speculate)
            if round_:
                times[name, speculate].append((time.perf_counter() - start) / args.tokens * 1e3)
    base = statistics.median(times["none", False])
    for (name, speculate), ts in times.items():
        median = statistics.median(ts)
        label = f"{name}{f', {args.spec}' if speculate else ''}"
        print(f"{label:32s} median {median:.2f} ms a token ({median / base:.3f}x plain none; min {min(ts):.2f}, "
              f"max {max(ts):.2f})")


if __name__ == "__main__":
    main()
