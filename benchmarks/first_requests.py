"""A fresh engine's first requests against the ones after them: what a new server's first clients
wait for beyond steady state (memory the engine takes from the OS on first use, a slot's first
writes among it).

    python benchmarks/ab_revisions.py --base 3ae8307 --rounds 3 \
        --metric 'first 8 requests: ([0-9.]+) s' -- python "$PWD/benchmarks/first_requests.py"

(the path from this checkout: ab_revisions runs the command in each revision's folder, and a
revision older than this script has none)

One process: an LLM built with prefix caching off, then --requests requests of --max-tokens greedy
tokens one after another (short prompts, each a new question), timed together; then as many again.
The scheduler gives each new request the slot used longest ago, so with as many requests as the
engine has slots (8 by default) the first round reaches every slot once.
"""
from __future__ import annotations

import argparse
import time

import torch

from outpace import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, prefix_caching=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for name, first in (("first", 0), ("next", args.requests)):
        t0 = time.perf_counter()
        for i in range(first, first + args.requests):
            llm.generate(f"Tell me one fact about the number {i}.", params)
        print(f"{name} {args.requests} requests: {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
