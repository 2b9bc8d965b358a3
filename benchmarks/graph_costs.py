"""What each drafter's CUDA graphs cost on this GPU at batch 1: replays timed on the device.

    python benchmarks/graph_costs.py [--model smollm2-135m] [--spec ngram eagle3 chain trees] [--keys 512]
        [--num-draft-tokens 32] [--tree-width 3]

For each drafter (`chain`: the EAGLE-3 head with n-gram lookup first; `trees`: the head alone
drafting token trees of --tree-width, in the step graphs) one engine of one slot is
built without calibration and its captured graphs are replayed with every row inactive (the
inputs the capture left: the target's dummy rows, the head's rows writing the spare region), so
the figures are the graphs' device time at fixed shapes, not a speedup:
  - the target's step graph of t tokens a row (t = 1 plain, t > 1 verifying t - 1 drafts; for the
    n-gram twin, the head and the chain this includes their drafting inside the step: a tree of
    t - 1 nodes for `trees`), at --keys keys;
  - a head's catch-up graph of S verified pairs (replayed at the read of every step);
  - a head's chain graph of K drafts (the head alone outside the target's step: its first draft
    is a product and an argmax, each later one a forward of the head).
Each figure is the mean of --reps replays after one untimed replay, in microseconds; --rounds
repeats the step graphs' line to show the spread. --num-draft-tokens sets the most drafts a step
holds (SpecConfig's; the step graphs reach t = 1 + that, the head's chain graphs that many drafts),
for what a large token tree's verify would cost if it ran in a graph. --kernels N lists, for the
step graphs of 1, 2 and 4 tokens and the head's catch-up of 3 pairs and chains of 1 and 2 drafts,
how many kernels a replay runs, their summed device time (the replay's time less the gaps between
kernels) and the N that take longest (PyTorch's profiler, 20 replays).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from outpace.config import SpecConfig
from outpace.llm import LLM

SPECS = {"ngram": dict(method="ngram"), "eagle3": dict(method="eagle3"),
         "chain": dict(method="eagle3", ngram_first=True), "trees": dict(method="eagle3")}


def replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def kernels(name: str, graph: torch.cuda.CUDAGraph, top: int, reps: int = 20) -> None:
    """The kernels of one replay of graph: count, summed device time, the `top` longest."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = sorted(((e.device_time_total / reps, e.count / reps, e.key) for e in prof.key_averages()
                   if e.device_time_total > 0), reverse=True)
    print(f"{name}: {sum(r[1] for r in rows):.0f} kernels, {sum(r[0] for r in rows):.0f} us", flush=True)
    for us, count, key in rows[:top]:
        print(f"  {us:7.1f} us {count:4.0f}x  {key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spec", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--draft-head", default=None, help="EAGLE-3 head folder (default: the one that ships for the model)")
    p.add_argument("--keys", type=int, default=512, help="the step graphs' key length (a captured bucket)")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-draft-tokens", type=int, default=SpecConfig.num_draft_tokens,
                   help="the most drafts a step holds (default: SpecConfig's)")
    p.add_argument("--tree-width", type=int, default=3, help="the `trees` drafter's candidates per node (default 3)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="list each graph's kernels, the N longest (default 0: replay times only)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_costs.py times CUDA graphs: it needs a CUDA GPU")
    for name in args.spec:
        extra = dict(draft_head=args.draft_head) if name != "ngram" else {}
        extra["num_draft_tokens"] = args.num_draft_tokens
        if name == "trees":
            extra["tree_width"] = args.tree_width
        llm = LLM(args.model, spec=SpecConfig(**SPECS[name], **extra), device="cuda", max_num_seqs=1, calibrate=False)
        runner = llm.engine.runner
        tiers = [t for t in runner.tiers if (1, t, args.keys) in runner.graphs]
        if not tiers:
            raise SystemExit(f"no step graph has {args.keys} keys; captured key lengths: {runner.kv_lens}")
        for round_ in range(args.rounds):
            steps = " ".join(f"t{t} {replay_us(runner.graphs[(1, t, args.keys)], args.reps):.0f}" for t in tiers)
            print(f"{name}: step graphs, round {round_}: {steps}", flush=True)
        if args.kernels:
            for t in (1, 2, 4):
                if t in tiers:
                    kernels(f"{name}: step graph t{t}", runner.graphs[(1, t, args.keys)], args.kernels)
        drafter = llm.engine.drafter
        heads = [d for d in getattr(drafter, "drafters", [drafter]) if getattr(d, "graphs", None) is not None]
        for head in heads:
            graphs = head.graphs.graphs
            for kind in ("catch_up", "draft"):
                sizes = sorted(n for k, b, n in graphs if k == kind and b == 1)
                times = " ".join(f"{n} {replay_us(graphs[(kind, 1, n)], args.reps):.0f}" for n in sizes)
                print(f"{name}: head {kind.replace('_', '-')} graphs by {'pairs' if kind == 'catch_up' else 'drafts'}: {times}",
                      flush=True)
            if args.kernels:
                for kind, n in (("catch_up", 3), ("draft", 1), ("draft", 2)):
                    if (kind, 1, n) in graphs:
                        kernels(f"{name}: head {kind.replace('_', '-')} {n}", graphs[(kind, 1, n)], args.kernels)
        llm.close()
        del llm, runner, drafter, heads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
