"""Would a draft model's confidence choose its draft lengths better than the controller's rates,
and what would a cheaper draft model give? One row, greedy, an offline replay of real drafts.

    python benchmarks/draft_confidence.py --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --dataset ../shared/data/spec_bench_question.jsonl \
        --limit-per-category 2 --max-tokens 128 --threads 2 [--out bench-out/confidence.json]

Every step drafts the whole --num-draft-tokens (the controller's lengths replaced), and records
the draft model's top probability at each position and how many drafts the target accepted. Since
a draft's first j tokens are accepted or not whatever follows them, any rule that stops drafting
early can then be replayed on these steps: rule R keeps k drafts of a step and ran f draft
forwards (k where it kept them all, k + 1 where the forward after its last draft told it to
stop), so the step yields 1 + min(accepted, k) tokens for verify(k) + f * d seconds, verify(k)
and d (seconds a drafted token) as the engine calibrated them at start (draft_costs.py prints
them). Rules: a fixed length k; the best fixed k of each category (an oracle of what a perfect
per-category choice gives); stopping where the product of the draft's probabilities falls below
tau (the chance that every draft so far is right, if the draft's probabilities were calibrated);
stopping at the first probability below p (SpecConfig.p_min). Each rule's tokens over seconds,
against plain decoding's one token a plain forward, is its decode speedup, host work apart. The
last table repeats the best rules with the drafted token's cost scaled down, as a faster or
smaller draft model would make it. The draft's calibration (acceptance by its probability) closes.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch

from outpace.bench.dataset import load_spec_bench
from outpace.config import SamplingParams, SpecConfig
from outpace.kernels import cpu_isa
from outpace.llm import LLM
import outpace.speculative.draft_model as draft_model

TAUS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
P_MINS = (0.3, 0.5, 0.7, 0.9)
COST_SCALES = (1.0, 0.8, 0.66, 0.44)


def record(args) -> dict:
    """Steps of the pair drafting every position: [{category, p: [...], accepted}], and the
    calibrated costs: plain forward, verify(k) forward for k = 0..K, seconds a drafted token."""
    if args.threads:
        torch.set_num_threads(args.threads)
    K = args.num_draft_tokens
    spec = SpecConfig(method="draft", draft_model=args.draft_model, num_draft_tokens=K)
    llm = LLM(args.model, spec=spec, max_num_seqs=1, prefix_caching=False)
    engine, controller = llm.engine, llm.engine.controller
    drafter = engine.drafter
    per_token = drafter.cost_per_token(1)
    costs = {"draft_token": per_token,
             "verify": [controller.step_cost(1, 1 + k) - per_token * k for k in range(K + 1)]}
    # every step drafts K tokens: the controller's lengths are replaced
    engine.steps.lengths = lambda seqs, paid=True, load=0: [K if s.speculate else 0 for s in seqs]
    steps, drafted, category = [], {}, [""]
    pick = draft_model.DraftModelDrafter._pick

    def recording_pick(logits, sampling, column):
        best, token = pick(logits, sampling, column)
        drafted.setdefault("p", []).append(float(best[0]))
        return best, token
    draft_model.DraftModelDrafter._pick = staticmethod(recording_pick)
    propose, accept = drafter.propose, drafter.accept

    def recording_propose(batch):
        drafted.clear()
        drafts = propose(batch)
        drafted["tokens"] = drafts.tokens[0, :int(drafts.num_draft[0])].tolist() if len(batch) else []
        drafted["seq_id"] = batch.seq_ids[0] if len(batch) else None
        return drafts

    def recording_accept(seq_id, token_ids):
        if drafted.get("seq_id") == seq_id and len(drafted.get("tokens", ())) == K:
            n = 0
            while n < K and n < len(token_ids) and drafted["tokens"][n] == token_ids[n]:
                n += 1
            steps.append({"category": category[0], "p": drafted["p"][:K], "accepted": n})
        drafted.clear()
        return accept(seq_id, token_ids)
    drafter.propose, drafter.accept = recording_propose, recording_accept
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for question in load_spec_bench(args.dataset, limit_per_category=args.limit_per_category):
        category[0] = question.category
        llm.chat([{"role": "user", "content": question.turns[0]}], params)
    return {"machine": f"{torch.get_num_threads()} threads; {cpu_isa.cpu_description()}", "costs": costs,
            "steps": steps}


def totals(steps: list[dict], costs: dict, rule, scale: float = 1.0) -> tuple[float, float]:
    """The tokens the steps yield under a rule, and the seconds they take (see the top)."""
    tokens = seconds = 0.0
    for step in steps:
        kept, forwards = rule(step["p"])
        tokens += 1 + min(step["accepted"], kept)
        seconds += costs["verify"][kept] + forwards * costs["draft_token"] * scale
    return tokens, seconds


def replay(steps: list[dict], costs: dict, rule, scale: float = 1.0) -> float:
    """A rule's tokens a second over plain decoding's."""
    tokens, seconds = totals(steps, costs, rule, scale)
    return tokens / seconds * costs["verify"][0]


def fixed(k: int):
    return lambda p: (k, k)


def cumulative(tau: float, most: int):
    def rule(p):
        chance = 1.0
        for j in range(most):
            chance *= p[j]
            if chance < tau:
                return j, j + 1
        return most, most
    return rule


def each_below(p_min: float, most: int):
    def rule(p):
        for j in range(most):
            if p[j] < p_min:
                return j, j + 1
        return most, most
    return rule


def per_category(steps: list[dict], costs: dict, rule_of, scale: float = 1.0) -> float:
    """Each category replayed with its own best fixed length (rule_of(k): the rule given that
    length as its cap), summed: tokens over seconds against plain."""
    by_category = defaultdict(list)
    for step in steps:
        by_category[step["category"]].append(step)
    K = len(costs["verify"]) - 1
    tokens = seconds = 0.0
    for group in by_category.values():
        best = max(range(K + 1), key=lambda k: replay(group, costs, fixed(k), scale))
        group_tokens, group_seconds = totals(group, costs, fixed(0) if best == 0 else rule_of(best), scale)
        tokens, seconds = tokens + group_tokens, seconds + group_seconds
    return tokens / seconds * costs["verify"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dataset", help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--limit-per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="write the recorded steps and costs here (JSON)")
    p.add_argument("--replay", help="a file --out wrote: replay its steps, recording nothing")
    args = p.parse_args()
    if args.replay:
        with open(args.replay) as f:
            data = json.load(f)
    else:
        if not args.dataset:
            p.error("--dataset is needed unless --replay is given")
        data = record(args)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(data, f)
    steps, costs = data["steps"], data["costs"]
    K = len(costs["verify"]) - 1
    plain = costs["verify"][0]
    print(f"{data['machine']}\n{len(steps)} steps of {K} drafts; plain forward {plain * 1e3:.2f} ms, a drafted "
          f"token {costs['draft_token'] * 1e3:.2f} ms, verify(k) / plain for k = 1..{K}: "
          + ", ".join(f"{v / plain:.3f}" for v in costs["verify"][1:]))
    print("\n| rule | decode speedup |\n|---|---|")
    for k in range(1, K + 1):
        print(f"| fixed {k} | {replay(steps, costs, fixed(k)):.3f}x |")
    print(f"| each category's best fixed length | {per_category(steps, costs, fixed):.3f}x |")
    for tau in TAUS:
        print(f"| product of probabilities below {tau} stops, at most {K} | "
              f"{replay(steps, costs, cumulative(tau, K)):.3f}x |")
    for p_min in P_MINS:
        print(f"| a probability below {p_min} stops, at most {K} | "
              f"{replay(steps, costs, each_below(p_min, K)):.3f}x |")
    print(f"| each category's best fixed length as a cap, product below 0.3 stops | "
          f"{per_category(steps, costs, lambda k: cumulative(0.3, k)):.3f}x |")
    print("\n| drafted token's cost | best fixed length | each category's best | product below 0.4 stops |")
    print("|---|---|---|---|")
    for scale in COST_SCALES:
        best = max(replay(steps, costs, fixed(k), scale) for k in range(1, K + 1))
        print(f"| {scale:.2f}x ({costs['draft_token'] * scale / plain:.3f} of a plain forward) | {best:.3f}x | "
              f"{per_category(steps, costs, fixed, scale):.3f}x | "
              f"{replay(steps, costs, cumulative(0.4, K), scale):.3f}x |")
    reached, right = defaultdict(int), defaultdict(int)
    for step in steps:
        for j, prob in enumerate(step["p"][:step["accepted"] + 1]):
            bucket = min(int(prob * 10), 9)
            reached[bucket] += 1
            right[bucket] += j < step["accepted"]
    print("\ndraft probability: accepted / reached: " + ", ".join(
        f"{b / 10:.1f}-{(b + 1) / 10:.1f} {right[b] / reached[b]:.0%} of {reached[b]}" for b in sorted(reached)))


if __name__ == "__main__":
    main()
