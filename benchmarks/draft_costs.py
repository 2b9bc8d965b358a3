"""What a draft model's speculation costs a step, by batch size: the target's verify forward and the
draft's cost per drafted token, as the engine measures them at start for its draft controller.

    python benchmarks/draft_costs.py --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct
    PYTHONPATH=src python benchmarks/draft_costs.py --model T --draft-model D --device cuda --random-weights

For each batch size b the engine calibrated (b rows, k drafted tokens a row):
- plain: the target's forward of b rows of one token;
- verify(k): its forward of b rows of 1 + k tokens, over plain;
- draft/token: the draft model's seconds a drafted token (one forward of b rows, over b);
- a drafted token's cost as a share of a plain step's cost a token: (verify(k) - plain) / (b k) plus
  draft/token, over plain / b;
- the best case: tokens a second if every drafted token were accepted, over plain decoding's,
  (1 + k) plain / (verify(k) + b k draft/token).
--random-weights builds random bf16 weights of the two folders' shapes on the device (config.json
and tokenizer files are all they need), for step costs where the real weights cannot travel.

A second table times the drafter's propose itself, b rows of a 128-token context drafting k tokens
each (greedy, every row to k): its milliseconds over k, a draft position's cost with the host work
between forwards, against the calibrated forward (draft/token times b).

--acceptance FILE (an `outpace bench` results.json of the same pair) adds what one row's decoding
can gain at each draft length k with the acceptance that run measured at each position (overall
acceptance_by_position, P_j: accepted where drafted): a step yields 1 + P_1 + ... + P_k tokens
for verify(k) + k draft/token, over a plain step's one token for its plain forward. Positions the
run never drafted are not extrapolated.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import outpace.engine.llm_engine as llm_engine
import outpace.speculative.draft_model as draft_model
from outpace.config import DRAFT_WEIGHTS, SpecConfig
from outpace.speculative.drafter import DraftBatch, Prefilled
from outpace.kernels import cpu_isa
from outpace.llm import LLM


def patch_random_weights() -> None:
    """Both models' loads build random bf16 weights of their folder's shape on the device."""
    from gpu_run import random_model          # benchmarks/: the same builder the 8B-shape figures use

    def load(folder, dtype, device, max_len, *_, **__):
        return random_model(folder, max_len, device)

    llm_engine.load_model = load
    draft_model.load_model = load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target: a known name, a folder or a .gguf file")
    p.add_argument("--draft-model", required=True)
    p.add_argument("--draft-vocab", type=int, default=SpecConfig.draft_vocab)
    p.add_argument("--draft-weights", default=SpecConfig.draft_weights, choices=DRAFT_WEIGHTS)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8, help="the largest batch size calibrated")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--random-weights", action="store_true", help="random bf16 weights of the folders' shapes")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="draft lengths to report")
    p.add_argument("--acceptance", help="an `outpace bench` results.json: one row's decode speedup by draft length")
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.random_weights:
        patch_random_weights()
    spec = SpecConfig(method="draft", draft_model=args.draft_model, draft_vocab=args.draft_vocab,
                      draft_weights=args.draft_weights, num_draft_tokens=args.num_draft_tokens)
    llm = LLM(args.model, spec=spec, dtype="bfloat16" if args.random_weights else args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs, max_model_len=2048)
    engine = llm.engine
    controller, drafter = engine.controller, engine.drafter
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"{torch.get_num_threads()} threads; {cpu_isa.cpu_description()}")
    print(f"target {args.model}, draft {args.draft_model} (draft vocabulary {drafter.vocab}), "
          f"{'random ' if args.random_weights else ''}{str(engine.dtype).removeprefix('torch.')} on {where}")
    ks = [k for k in args.ks if k <= args.num_draft_tokens]
    print("| rows | plain ms | draft ms a token | " + " | ".join(f"verify({k}) / plain" for k in ks) + " | "
          + " | ".join(f"drafted token / plain token, k = {k}" for k in ks) + " | "
          + " | ".join(f"best case, k = {k}" for k in ks) + " |")
    print("|---" * (3 + 3 * len(ks)) + "|")
    for b in controller.buckets:
        # step_cost before any step ran: the calibrated forward plus the draft's cost per drafted token
        plain = controller.step_cost(b, b)
        per_token = drafter.cost_per_token(b)
        verify = {k: controller.step_cost(b, b * (1 + k)) - per_token * b * k for k in ks}
        share = {k: ((verify[k] - plain) / (b * k) + per_token) / (plain / b) for k in ks}
        best = {k: (1 + k) * plain / (verify[k] + per_token * b * k) for k in ks}
        print(f"| {b} | {plain * 1e3:.2f} | {per_token * 1e3:.2f} | "
              + " | ".join(f"{verify[k] / plain:.3f}" for k in ks) + " | "
              + " | ".join(f"{share[k]:.2f}" for k in ks) + " | "
              + " | ".join(f"{best[k]:.2f}x" for k in ks) + " |")

    print()
    propose_table(drafter, controller.buckets, ks, args.device)
    if args.acceptance:
        print()
        acceptance_table(controller, args.acceptance)


def acceptance_table(controller, results: str) -> None:
    """One row's decode speedup at each draft length the results' acceptance reaches (the top)."""
    with open(results) as f:
        accepted = json.load(f)["overall"]["acceptance_by_position"]
    plain = controller.step_cost(1, 1)
    print(f"one row, acceptance by position from {results}: " + ", ".join(f"{a:.0%}" for a in accepted))
    print("| k | tokens a step | step / plain | decode speedup |")
    print("|---|---|---|---|")
    for k in range(1, min(len(accepted), controller.num_draft_tokens) + 1):
        tokens = 1 + sum(accepted[:k])
        step = controller.step_cost(1, 1 + k) / plain      # the verify forward and k drafted tokens
        print(f"| {k} | {tokens:.2f} | {step:.3f} | {tokens / step:.2f}x |")


def propose_table(drafter, buckets: list[int], ks: list[int], device: str, context: int = 128, repeats: int = 20) -> None:
    """Milliseconds a draft position of drafter.propose, by rows and draft length (the median of
    `repeats` calls; accept with no tokens between them leaves every row's state as it was)."""
    print("| rows | draft forward ms | " + " | ".join(f"propose({k}) ms a position" for k in ks) + " |")
    print("|---" * (2 + len(ks)) + "|")
    prompt = list(range(100, 100 + context))
    drafter.kept_keys.prefix_key = lambda seq_id: None     # its sequences are not the engine's: none reuses a prefix
    for b in buckets:
        seq_ids = list(range(10_000, 10_000 + b))
        for seq_id in seq_ids:
            drafter.begin(seq_id, prompt)
        drafter.prefilled(Prefilled(seq_ids, list(range(b)), [0] * b, [prompt] * b))
        cells = []
        for k in ks:
            batch = DraftBatch(seq_ids, [k] * b, list(range(b)), [context - 1] * b)
            times = []
            for _ in range(repeats + 3):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                drafter.propose(batch)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                for seq_id in seq_ids:
                    drafter.accept(seq_id, [])
            cells.append(statistics.median(times[3:]) / k)
        for seq_id in seq_ids:
            drafter.end(seq_id)
        print(f"| {b} | {drafter.cost_per_token(b) * b * 1e3:.2f} | " + " | ".join(f"{c * 1e3:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
