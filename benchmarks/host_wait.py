"""Whether the host or the GPU bounds a graph step: the host's loop against its one wait a step.

    python benchmarks/host_wait.py --dataset spec_bench_question.jsonl [--limit-per-category 2]
        [--max-tokens 256] [--spec plain head chain ngram] [--draft-head DIR] [--rounds 2]

For each drafter (`plain`: the head's engine with speculation off; `head`: the EAGLE-3 head that
ships for the model, or --draft-head; `chain`: the head with n-gram lookup first; `ngram`) one
engine of one slot decodes each category's first questions (first turns, greedy, the chat
template) after an untimed warm-up, --rounds times. A CUDA graph step is read back with one host
synchronisation (CudaGraphRunner.read_back); this script times that call (the wait, and a copy
of a few integers to a list) and nothing else, with no profiler. Per round: tokens/s, the reads, and the wall time a read split in two: the wait
(the device still running the step, and the step launched ahead of it) and the rest (the host's
own loop: scheduling, drafting's host part, accepting tokens; the prompts' prefill is left in, so
it is an upper bound). A wait near zero means the host bounds the step; a host share well below
the wait means the device does.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from outpace.bench.dataset import load_spec_bench
from outpace.config import SamplingParams, SpecConfig
from outpace.llm import LLM
from outpace.runner.cuda_graphs import CudaGraphRunner

sys.path.insert(0, str(Path(__file__).parent))
from head_costs import Timer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft-head", default=None, help="EAGLE-3 head folder (default: the one that ships for the model)")
    p.add_argument("--spec", nargs="+", default=["plain", "head", "chain", "ngram"],
                   choices=["plain", "head", "chain", "ngram"])
    p.add_argument("--limit-per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_wait.py times CUDA graph steps: it needs a CUDA GPU")
    records = load_spec_bench(args.dataset, limit_per_category=args.limit_per_category)
    chats = [[{"role": "user", "content": r.turns[0]}] for r in records]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    wait = Timer(CudaGraphRunner, "read_back")          # every runner's reads, in every engine below
    for name in args.spec:
        spec = (SpecConfig(method="ngram") if name == "ngram" else
                SpecConfig(method="eagle3", draft_head=args.draft_head, ngram_first=name == "chain"))
        speculate = name != "plain"
        llm = LLM(args.model, spec=spec, device="cuda", max_num_seqs=1, prefix_caching=False)
        for chat in chats[:2]:
            llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=32), speculate=speculate)
        for round_ in range(args.rounds):
            wait.seconds.clear()
            torch.cuda.synchronize()
            start, tokens = time.perf_counter(), 0
            for chat in chats:
                tokens += len(llm.chat(chat, params, speculate=speculate)[0].token_ids)
            wall, waited = time.perf_counter() - start, sum(wait.seconds)
            reads = max(1, len(wait.seconds))
            print(f"{name} round {round_}: {tokens / wall:.1f} tok/s, {len(wait.seconds)} reads, "
                  f"{tokens / reads:.2f} tokens a read; a read's wall {1e3 * wall / reads:.3f} ms = "
                  f"wait {1e3 * waited / reads:.3f} + host {1e3 * (wall - waited) / reads:.3f}",
                  flush=True)
        llm.close()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
