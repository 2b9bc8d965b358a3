"""What a head's drafting costs on this machine, against the target's forwards, at batch 1.

    python benchmarks/head_costs.py --dataset ../shared/data/spec_bench_question.jsonl \
        --limit-per-category 1 --max-tokens 96 --num-draft-tokens 2 [--draft-head DIR] [--threads 2] \
        [--tree-width K --weights fp32]

Each category's first questions (first turns, greedy, the chat template) are decoded one at a
time, twice: plainly, then with the head drafting --num-draft-tokens tokens at every step (an
uncalibrated controller, which prices nothing, so it never stops drafting: the figures are
costs, not a speedup). Timed: each call of the head's propose (its catch-up of the last step's
pairs included) and each forward of the target, prompt chunks apart. Prints the mean and median
propose, a drafted token's share of it, the target's decode forward plain and when verifying
drafts, and what a step that drafts costs against a plain one, propose included; and how many
of the drafts the target accepted, and the mean acceptance length (tokens a verify step emits).
With --tree-width K every step drafts a tree of --num-draft-tokens nodes, K candidates a node
(the CPU runs trees on float32 weights: --weights fp32), and its verify forwards are timed too:
at a fixed node budget, what trees accept against chains, whatever a controller would pay for.
Output is verified as always, so it equals plain decoding's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from outpace.bench.dataset import load_spec_bench
from outpace.config import SamplingParams, SpecConfig
from outpace.llm import LLM


class Timer:
    """Wraps obj.name to record each call's seconds (calls where keep(*args) is false are not kept)."""

    def __init__(self, obj, name: str, keep=lambda *args: True):
        self.seconds: list[float] = []
        call = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = call(*args, **kwargs)
            if keep(*args, **kwargs):
                self.seconds.append(time.perf_counter() - t0)
            return out
        setattr(obj, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft-head", default=None, help="EAGLE-3 head folder (default: the one that ships for the model)")
    p.add_argument("--limit-per-category", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's)")
    p.add_argument("--tree-width", type=int, default=1, help="candidates a tree node (default 1: chains)")
    p.add_argument("--weights", default="auto", help="auto, quantized, bf16 or fp32 (trees on the CPU: fp32)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = [r.turns[0] for r in load_spec_bench(args.dataset, limit_per_category=args.limit_per_category)]
    # both modes prefill each prompt whole: the one run second would find it cached
    llm = LLM(args.model, max_num_seqs=1, calibrate=False, weights=args.weights, prefix_caching=False,
              spec=SpecConfig(method="eagle3", draft_head=args.draft_head, num_draft_tokens=args.num_draft_tokens,
                              tree_width=args.tree_width))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine = llm.engine
    llm.chat([{"role": "user", "content": questions[0]}], SamplingParams(temperature=0.0, max_tokens=8))  # first calls
    propose = Timer(engine.drafter, "propose")
    # the target's forwards of decoding rows alone (a prompt chunk's reads no logits)
    forward = Timer(engine.runner, "forward",
                    lambda rows, logits="all", hidden_layers=(), chunks=(), **kw: logits != "none" and not chunks)
    tree_forward = Timer(engine.runner, "forward_tree")
    figures = {}
    for speculate in (False, True):
        for timer in (propose, forward, tree_forward):
            timer.seconds.clear()
        outputs = [llm.chat([{"role": "user", "content": q}], params, speculate=speculate)[0] for q in questions]
        figures[speculate] = (forward.seconds + tree_forward.seconds, list(propose.seconds), outputs)
    plain_forward, _, plain_out = figures[False]
    spec_forward, proposes, spec_out = figures[True]
    drafted = sum(o.spec["num_draft_tokens"] for o in spec_out)
    accepted = sum(o.spec["num_accepted_tokens"] for o in spec_out)
    steps = sum(o.spec["num_verify_steps"] for o in spec_out)
    plain_ms, verify_ms = 1e3 * statistics.mean(plain_forward), 1e3 * statistics.mean(spec_forward)
    propose_ms = 1e3 * statistics.mean(proposes)
    equal = sum(o.token_ids == b.token_ids for o, b in zip(spec_out, plain_out))
    shape = f"trees of width {args.tree_width}" if args.tree_width > 1 else "chains"
    print(f"{len(questions)} prompts, {args.max_tokens} tokens, {args.num_draft_tokens} drafted a step ({shape}); "
          f"{equal} of {len(questions)} outputs equal plain")
    print(f"propose: {propose_ms:.2f} ms mean, {1e3 * statistics.median(proposes):.2f} median over {len(proposes)} "
          f"calls; {1e3 * sum(proposes) / max(drafted, 1):.2f} ms a drafted token")
    print(f"target forward: plain {plain_ms:.2f} ms ({len(plain_forward)} steps), verifying "
          f"{args.num_draft_tokens} drafts {verify_ms:.2f} ms ({verify_ms / plain_ms:.2f}x plain)")
    print(f"a drafting step, propose included: {(verify_ms + propose_ms) / plain_ms:.2f}x a plain forward; "
          f"accepted {accepted} of {drafted} drafted tokens ({accepted / max(drafted, 1):.0%}); mean acceptance "
          f"length {(accepted + steps) / max(steps, 1):.2f} over {steps} verify steps")


if __name__ == "__main__":
    main()
