"""What prefix sharing saves: requests sent together that begin alike, with sharing on and off in one
process.

    python benchmarks/prefix_sharing.py --dataset ../shared/data/spec_bench_question.jsonl --threads 2
    python benchmarks/prefix_sharing.py --dataset ../shared/data/spec_bench_question.jsonl \
        --model qwen2.5-coder-1.5b-instruct --clients 4 --max-tokens 64 --threads 2

Two workloads, each a batch of requests queued at once in one LLM (as many slots as requests,
n-gram speculation unless --spec none):
  document: --clients requests whose system message is one long Spec-Bench prompt (the first
    question of --category, summarization's by default) and whose user messages are other
    questions' first turns (qa's): a shared document or system prompt;
  choices: one such request's prompt with --clients choices sampled apart (temperature 0.8, seeds
    0..n-1): the server's `n`.
Each round runs every workload with sharing on and off (the scheduler's share_bound removed: a
request then starts only from freed slots' kept prefixes, as before sharing), the order alternating
between rounds; every run starts from a fresh cache (prefix_caching's kept slots cleared), so no
run finds the last one's prompts. Per workload and mode: wall seconds to the last token, mean time
to first token, prompt tokens the target computed and prompt tokens found cached; the ratio is off's
wall time over on's. Greedy outputs (the document workload) are checked equal across the modes.
"""
from __future__ import annotations

import argparse
import time

import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.bench.dataset import load_spec_bench
from outpace.kernels import cpu_isa


def workloads(args) -> dict[str, tuple[list, list[SamplingParams]]]:
    questions = load_spec_bench(args.dataset)
    document = next(q for q in questions if q.category == args.category).turns[0]
    asks = [q.turns[0] for q in questions if q.category == args.questions][:args.clients]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    shared = [[{"role": "system", "content": document}, {"role": "user", "content": ask}] for ask in asks]
    choices = [shared[0]] * args.clients
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens) for i in range(args.clients)]
    return {"document": (shared, [greedy] * len(shared)), "choices": (choices, sampled)}


def run(llm: LLM, conversations: list, params: list[SamplingParams], share: bool) -> dict:
    engine = llm.engine
    engine.scheduler.share_bound = engine._share_bound if share else None
    engine.scheduler.kept.clear()
    for drafter_keys in (getattr(d, "kept_keys", None) for d in getattr(engine.drafter, "members", [engine.drafter])):
        if drafter_keys is not None:
            drafter_keys.kept.clear()
    computed, prefilled = [], engine._prefilled

    def counting(plan, *rest):
        computed.extend(c.end - c.start for c in plan.prefill)
        return prefilled(plan, *rest)
    engine._prefilled = counting
    t0 = time.perf_counter()
    outs = llm.chat(conversations, params)
    wall = time.perf_counter() - t0
    del engine._prefilled
    return {"wall": wall, "ttft": sum(o.timing["prefill_s"] for o in outs) / len(outs),
            "computed": sum(computed), "cached": sum(o.num_cached_tokens for o in outs),
            "tokens": [o.token_ids for o in outs], "out": sum(len(o.token_ids) for o in outs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--category", default="summarization", help="whose first question is the shared document")
    p.add_argument("--questions", default="qa", help="whose first turns the clients ask")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spec", default="ngram", choices=["ngram", "none"])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, spec=SpecConfig(method="ngram") if args.spec == "ngram" else "none",
              max_num_seqs=args.clients)
    loads = workloads(args)
    llm.chat(loads["document"][0][:1], SamplingParams(temperature=0, max_tokens=4))     # warm-up
    print(f"{args.model}, {args.clients} requests at once, {args.max_tokens} tokens, spec {args.spec}; "
          f"{torch.get_num_threads()} threads; {cpu_isa.cpu_description()}")
    results = {name: {True: [], False: []} for name in loads}
    for r in range(args.rounds):
        for name, (conversations, params) in loads.items():
            for share in ((True, False) if r % 2 == 0 else (False, True)):
                results[name][share].append(run(llm, conversations, params, share))
    print("\n| workload | sharing | wall s (rounds) | mean TTFT s | prompt tokens computed | found cached | off / on |")
    print("|---|---|---|---|---|---|---|")
    for name, by_mode in results.items():
        on, off = (sum(x["wall"] for x in by_mode[m]) for m in (True, False))
        for share in (True, False):
            runs = by_mode[share]
            walls = " / ".join(f"{x['wall']:.2f}" for x in runs)
            print(f"| {name} | {'on' if share else 'off'} | {walls} | "
                  f"{sum(x['ttft'] for x in runs) / len(runs):.2f} | {runs[0]['computed']} | {runs[0]['cached']} | "
                  + (f"**{off / on:.2f}x** |" if share else "|"))
    same = all(x["tokens"] == results["document"][True][0]["tokens"] for m in (True, False) for x in results["document"][m])
    print(f"\ndocument workload (greedy): outputs equal across modes and rounds: {same}")


if __name__ == "__main__":
    main()
