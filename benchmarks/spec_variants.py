"""Speculative settings against each other and plain decoding, in one process, at batch 1.

    python benchmarks/spec_variants.py --dataset ../shared/data/spec_bench_question.jsonl --spec eagle3 \
        --variant p_min=0 --variant p_min=0.15 --limit-per-category 3 --max-tokens 128 --rounds 2

One engine per variant (the base --spec and --ngram-first, with the variant's SpecConfig fields
set: `field=value`, values read as Python literals), each calibrating its own steps. Every
category's first --limit-per-category questions, first turns, chat template, greedy, prefix
caching off, run one at a time through plain decoding (the first variant's engine, speculation
off) and every variant, the order reversed every other prompt and round, so that the machine's
drift weighs on all alike. Prints each round's tokens/s, then per variant its speedup over
plain's (output tokens over wall time, prefill included), its drafted and accepted tokens and
whether every output equals plain's.
"""
from __future__ import annotations

import argparse
import ast
import time

import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.bench.dataset import load_spec_bench


def variant(text: str) -> dict:
    """`field=value,field=value` -> SpecConfig keywords."""
    fields = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} is not field=value")
        try:
            fields[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            fields[name.strip()] = value.strip()
    return fields


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spec", default="eagle3", help="the variants' method (default eagle3)")
    p.add_argument("--ngram-first", action="store_true", help="n-gram lookup ahead of the head or draft model")
    p.add_argument("--variant", type=variant, action="append", required=True,
                   help="SpecConfig fields of one variant, e.g. p_min=0.15 (repeat for each variant)")
    p.add_argument("--limit-per-category", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = load_spec_bench(args.dataset, None, args.limit_per_category)
    names = [",".join(f"{k}={v}" for k, v in fields.items()) or "base" for fields in args.variant]
    engines = [LLM(args.model, spec=SpecConfig(method=args.spec, ngram_first=args.ngram_first, **fields),
                   prefix_caching=False) for fields in args.variant]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    seconds, tokens = [0.0] * (len(names) + 1), [0] * (len(names) + 1)       # plain last
    drafted, accepted, equal = [0] * len(names), [0] * len(names), [0] * len(names)
    runs = [(len(names), engines[0], False)] + [(i, engine, True) for i, engine in enumerate(engines)]
    for round_ in range(args.rounds):
        for q, question in enumerate(questions):
            messages = [{"role": "user", "content": question.turns[0]}]
            outputs = {}
            for i, llm, speculate in runs[::-1] if (q + round_) % 2 else runs:
                t0 = time.perf_counter()
                out = llm.chat(messages, params, speculate=speculate)[0]
                seconds[i] += time.perf_counter() - t0
                tokens[i] += len(out.token_ids)
                outputs[i] = out.token_ids
                if speculate:
                    drafted[i] += out.spec["num_draft_tokens"]
                    accepted[i] += out.spec["num_accepted_tokens"]
            for i in range(len(names)):
                equal[i] += outputs[i] == outputs[len(names)]
        rates = [t / s for t, s in zip(tokens, seconds)]
        print(f"round {round_}: plain {rates[-1]:.1f} tok/s; "
              + "; ".join(f"{n} {r:.1f}" for n, r in zip(names, rates)), flush=True)
    plain = tokens[-1] / seconds[-1]
    print("| variant | speedup | drafted | accepted | outputs equal to plain |")
    print("|---|---|---|---|---|")
    for i, name in enumerate(names):
        print(f"| {name} | {tokens[i] / seconds[i] / plain:.3f}x | {drafted[i]} | {accepted[i]} | "
              f"{equal[i]} of {args.rounds * len(questions)} |")


if __name__ == "__main__":
    main()
