"""A head's acceptance offline, by the trainer's own measure, on Spec-Bench's answers by category.

    python benchmarks/head_acceptance.py --dataset ../shared/data/spec_bench_question.jsonl --limit-per-category 2 --max-tokens 96 [--draft-head DIR ...] [--turns all]

The target answers each category's first questions (first turns, or with --turns all every turn
of a multi-turn question with its own earlier answers in context, as Spec-Bench runs them;
greedy, its chat template);
each head (default: the one that ships for the model) is then unrolled over those answers as
`outpace train-head` measures its held-back prompts (the target's hidden states computed as the
trainer's batches compute them): chains of --steps drafts, teacher forced, a draft counting while every one before it
was right. Prints per category and overall the mean drafts accepted in a row at an answer
position (a verify step's mean acceptance length less one, had it drafted --steps tokens at
every position) and how often the first draft was right (with --turns all, also by turn). Then, at the same positions, n-gram
lookup (prompt plus answer so far, 1- to 4-token suffixes, the most recent match, chains of --steps)
by the length of the suffix its draft matched (0: no draft): which drafter is the better one where,
the rule a chain of the two (`--ngram-first`) drafts by. With --tree-nodes N ..., also what
token trees of N nodes could accept: at each position, the rank of the target's token among the
head's best drafts at each depth of the chain along the true path, and the best static tree of
N nodes (the N most frequent prefixes of those ranks, a prefix never rarer than its extensions,
so they form a tree) against a chain of N (of --steps at most): drafts accepted a position, an
upper bound for a tree drafted per position. No timing: the figures depend on the heads
and the target's answers, not on the machine's speed. Measure only: never train on these.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch

from outpace.bench.dataset import load_spec_bench
from outpace.llm import LLM
from outpace.model.eagle3 import load_eagle3_head
from outpace.speculative import ngram_gpu
from outpace.train.answers import Answers, run_counts
from outpace.train.head_data import generate_shards, load_shards
from outpace.weights.hub import shipped_head


TREE_RANKS = 8          # candidates a node of an estimated tree may take (config.MAX_TREE_WIDTH's)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft-head", nargs="+", default=None, help="EAGLE-3 head folders (default: the shipped one)")
    p.add_argument("--limit-per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=7, help="drafts a chain holds (default 7, the trainer's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="first turns only, or every turn of multi-turn questions (default: first)")
    p.add_argument("--tree-nodes", type=int, nargs="*", default=[],
                   help="node budgets of static token trees to estimate (e.g. 8 16 32)")
    p.add_argument("--out", default=None, help="a JSON file for the figures")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = load_spec_bench(args.dataset, None, args.limit_per_category)
    max_prompt = 4096
    llm = LLM(args.model, spec="none", device="cpu", max_num_seqs=8, calibrate=False,
              max_model_len=max_prompt + args.max_tokens + 1)
    target = llm.engine.model
    with tempfile.TemporaryDirectory() as folder:
        prompts = [r.turns[:1] if args.turns == "first" else r.turns for r in chosen]
        generate_shards(llm, prompts, Path(folder), "answers", args.max_tokens, max_prompt, len(chosen))
        seqs = load_shards(Path(folder), "answers")
    if len(seqs) != sum(map(len, prompts)):
        sys.exit(f"{sum(map(len, prompts)) - len(seqs)} turns were over {max_prompt} tokens and not answered")
    heads = args.draft_head or [str(shipped_head(args.model))]
    longest = max(len(s.tokens) for s in seqs)
    results = {}
    for folder in heads:
        head = load_eagle3_head(Path(folder), target.cfg, torch.float32, "cpu", longest + args.steps + 1)
        ids = torch.arange(len(head.d2t)) + head.d2t.cpu()
        answers = Answers(target, head.cfg.target_layers, ids, args.steps, "cpu", longest, 8)
        runs = answers.runs(head.eval(), seqs, 8)
        by_category = defaultdict(lambda: [0, 0, 0])
        by_match = defaultdict(lambda: [0, 0, 0, 0, 0])     # [positions, n-gram run, head run, first right each]
        for seq, run in zip(seqs, runs):
            r = chosen[seq.source]
            keys = (r.category, "overall") + ((f"turn {seq.turn + 1}",) if args.turns == "all" else ())
            for total in (by_category[k] for k in keys):
                for j, c in enumerate(run_counts(run)):
                    total[j] += c
            positions = sorted(run)
            for m, lookup, n in zip(*lookup_runs(seq.tokens, positions, args.steps), (run[p] for p in positions)):
                for row in (by_match[m], by_match["all"]):
                    row[0] += 1
                    row[1] += lookup
                    row[2] += n
                    row[3] += lookup > 0
                    row[4] += n > 0
        results[folder] = {"by_category": {c: {"mean_accepted": a / max(n, 1), "first_right": f / max(n, 1),
                                               "positions": n} for c, (a, f, n) in by_category.items()}}
        results[folder]["by_match"] = {str(m): {"positions": n, "ngram_accepted": a / n, "head_accepted": h / n,
                                                "ngram_first_right": af / n, "head_first_right": hf / n}
                                       for m, (n, a, h, af, hf) in by_match.items()}
        if args.tree_nodes:
            ranks = [r for seq in answers.ranks(head, seqs, 8, TREE_RANKS) for r in seq.values()]
            results[folder]["trees"] = static_trees(ranks, args.tree_nodes, args.steps)
    print("| category | positions | " + " | ".join(f"{Path(h).name}: accepted in a row, 1st right" for h in heads) + " |")
    print("|---|---|" + "---|" * len(heads))
    turns = [f"turn {t + 1}" for t in range(max(s.turn for s in seqs) + 1)] if args.turns == "all" else []
    for c in list(dict.fromkeys(r.category for r in chosen)) + ["overall"] + turns:
        rows = [results[h]["by_category"][c] for h in heads]
        cells = " | ".join(f"{r['mean_accepted']:.2f}, {r['first_right']:.0%}" for r in rows)
        print(f"| {c} | {rows[0]['positions']} | {cells} |")
    for h in heads:
        print(f"\n{Path(h).name} against n-gram lookup, by the lookup's match length (0: no draft):")
        print("| match length | positions | n-gram: accepted in a row, 1st right | head: accepted in a row, 1st right |")
        print("|---|---|---|---|")
        table = results[h]["by_match"]
        for m in sorted((k for k in table if k != "all"), key=int) + ["all"]:
            row = table[m]
            print(f"| {m} | {row['positions']} | {row['ngram_accepted']:.2f}, {row['ngram_first_right']:.0%} | "
                  f"{row['head_accepted']:.2f}, {row['head_first_right']:.0%} |")
        if args.tree_nodes:
            print(f"\n{Path(h).name}, static token trees (drafts accepted a position):")
            print("| nodes | chain of that many | best static tree | its depth |")
            print("|---|---|---|---|")
            for row in results[h]["trees"]:
                chain = f"{row['chain']:.3f}" if row["chain"] is not None else "-"
                print(f"| {row['nodes']} | {chain} | {row['tree']:.3f} | {row['depth']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


def static_trees(ranks: list[tuple[int, ...]], budgets: list[int], steps: int) -> list[dict]:
    """For each node budget: drafts accepted a position by a chain of that many (None past
    `steps`) and by the best static tree of that many nodes, from each position's ranks of the
    target's tokens along the true path (TREE_RANKS: not among the head's best)."""
    counts: Counter = Counter()
    for path in ranks:
        for d, rank in enumerate(path):
            if rank >= TREE_RANKS:
                break
            counts[path[:d + 1]] += 1
    best = sorted(counts.items(), key=lambda item: -item[1])
    n = max(len(ranks), 1)
    return [{"nodes": k, "chain": sum(counts[(0,) * d] for d in range(1, k + 1)) / n if k <= steps else None,
             "tree": sum(c for _, c in best[:k]) / n, "depth": max((len(p) for p, _ in best[:k]), default=0)}
            for k in budgets]


def lookup_runs(tokens: torch.Tensor, positions: list[int], steps: int) -> tuple[list[int], list[int]]:
    """At each position p of a sequence's tokens: the match length of n-gram lookup's draft over
    tokens[:p] (0: none) and how many of its first `steps` tokens equal tokens[p:] in a row."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    at, ahead = torch.tensor(positions), torch.arange(steps)
    buffer = tokens[None].expand(len(positions), -1)
    draft, num, match = ngram_gpu.propose_matched(buffer, at, torch.arange(len(positions)), steps, 1, 4)
    index = at[:, None] + ahead
    right = (draft == tokens[index.clamp(max=len(tokens) - 1)]) & (ahead < num[:, None]) & (index < len(tokens))
    return match.tolist(), right.long().cumprod(1).sum(1).tolist()


if __name__ == "__main__":
    main()
