"""Hybrid models on the CPU or a CUDA GPU: plain decode against transformers, what verifying
drafts and rolling back recurrent state cost, and speculation's speedup on a hybrid against a
dense model of similar cost. One run on one machine; every ratio is taken against a baseline
measured in the same run, interleaved with it, so drift of a shared machine touches both alike.

    python benchmarks/hybrid_speed.py                  # Qwen3.5-0.8B's shape, random weights: minutes on 2 cores
    python benchmarks/hybrid_speed.py --quick          # tiny shapes: a smoke test, seconds
    python benchmarks/hybrid_speed.py --device cuda    # on the GPU: outpace's steps replay CUDA graphs

On CUDA, (b) times the graph runner's replays, (c) the Triton kernels (kernels/triton_recurrent),
and every timed span ends with the device's work (torch.cuda.synchronize).

(a) Plain greedy decode at batch 1: outpace against transformers' generate, the same random
    weights, dtype and threads, a random prompt; decode tokens/s = (new tokens - 1) / time from
    the first new token to the last.
(b) Verification at batch 1: one forward of the last token and k drafts (snapshot writes
    included) against a one-token decode forward, T(1 + k) / T(1).
(c) Rollback per speculative step, batch 1 and 32: the Gated DeltaNet layers' own work in a verify
    forward of 1 + k tokens a row (recurrent_kernels.gated_deltanet over random inputs, every
    layer of the model; the projections, the same in every mode, left out), in snapshot mode and
    in replay mode, then what commit costs, against the same forward writing each row's state in
    place (a prompt chunk's way: nothing to roll back to). Rollback cost = forward - in place +
    commit. The accepted drafts per row are drawn at a 70% acceptance rate. Where a batch's
    snapshots of every layer would not fit MEMORY_BUDGET, fewer layers run and the step is scaled
    to the model's.
(d) Speculation end to end at batch 1: an oracle drafter held to fixed acceptance rates drafts
    the plain run's continuation with each token replaced, independently, with probability
    1 - rate (the i.i.d. acceptance model), k drafts a step; its speedup over plain decoding of
    the same engine, for the hybrid and for its dense twin (bench.models.QWEN35_08B_DENSE: the same
    widths, every layer attention). The weights are random: the rates are imposed, not measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.bench.models import random_qwen35_08b, random_qwen35_08b_dense
from outpace.bench.peers import OutpaceEngine, TransformersEngine, load_transformers
from outpace.weights.loader import load_model
from outpace.kernels import recurrent_kernels
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.model.gated_deltanet import GatedDeltaNet
from outpace.model.recurrent_rows import RowGroup
from outpace.runner.model_runner import ModelRunner, Row
from outpace.runner.state_cache import StateCache
from outpace.paths import outpace_home
from outpace.speculative.drafter import Drafter, Drafts

MEMORY_BUDGET = {"cpu": 256 << 20, "cuda": 24 << 30}    # bytes of recurrent state (c) allocates for one batch
                                                        # size and mode (beyond the CPU's L3)
ROLLBACK_ACCEPTANCE = 0.7       # (c): each draft accepted with this probability while all before it were
# (quick) tiny shapes of both models: every kind of layer, seconds in all
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
TINY_DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"])


def cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids below vocab (and below 32000: inside the tokenizer's own vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(min(vocab, 32000)) for _ in range(n)]


def decode_rate(generation) -> float:
    return (len(generation.token_ids) - 1) / generation.decode_s


def clock(device: str) -> float:
    """perf_counter once the device's queued work is done."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


# ---- (a) ------------------------------------------------------------------------------------
def plain_decode(folder: Path, args, prompt: list[int]) -> dict:
    """outpace and transformers alternately, args.rounds times each."""
    llm = LLM(str(folder), spec="none", dtype=args.dtype, device=args.device, max_num_seqs=1,
              max_model_len=len(prompt) + args.new_tokens + 16, calibrate=False)
    hf = load_transformers(folder, llm.engine.dtype, args.device)
    eos = sorted(set(llm.engine.model.cfg.eos_token_ids))         # ignored by both (min_new_tokens, ignore_eos)
    engines = {"outpace": OutpaceEngine(llm, speculate=False), "transformers": TransformersEngine(hf, eos)}
    for engine in engines.values():         # untimed: first calls allocate
        engine.generate(prompt, 4, ignore_eos=True)
    runs = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            runs[name].append(engines[name].generate(prompt, args.new_tokens, ignore_eos=True))
    rates = {name: statistics.median(decode_rate(g) for g in gens) for name, gens in runs.items()}
    same = [a.token_ids == b.token_ids for a, b in zip(runs["outpace"], runs["transformers"])]
    del llm, hf, engines
    return {"decode_tokens_per_s": rates, "ratio": rates["outpace"] / rates["transformers"],
            "identical_share": sum(same) / len(same), "rounds": args.rounds}


# ---- (b) ------------------------------------------------------------------------------------
def verify_cost(model, args, prompt: list[int]) -> dict:
    """Median forward seconds of 1 + k tokens, k = 0..args.max_verify, interleaved over rounds."""
    ks = list(range(args.max_verify + 1))
    max_len = len(prompt) + 4 * len(ks) * args.reps + 16
    if args.device == "cuda":
        runner = CudaGraphRunner(model, num_slots=1, max_len=max_len, max_step_tokens=len(prompt),
                                 num_draft_tokens=ks[-1], progress=False, snapshots=True)
    else:
        runner = ModelRunner(model, num_slots=1, max_len=max_len, max_step_tokens=len(prompt),
                             max_verify_tokens=ks[-1] + 1, snapshots=True)
    runner.forward([Row(0, prompt[:-1], 0)], logits="none")
    position, token = len(prompt) - 1, prompt[-1]
    times = {k: [] for k in ks}
    rng = random.Random(1)
    for rep in range(args.reps + 1):
        for k in rng.sample(ks, len(ks)):
            row = Row(0, [token] + random_prompt(k, model.cfg.vocab_size, seed=rep * 100 + k), position)
            started = clock(args.device)
            out, _ = runner.forward([row], logits=runner.greedy_logits)
            if rep:                         # the first round warms up
                times[k].append(clock(args.device) - started)
            runner.cache.commit([0], [0])
            first = out[0, 0] if out.dim() == 2 else out[0, 0].argmax()
            position, token = position + 1, int(first)
    one = statistics.median(times[0])
    return {"one_token_s": one, "ratio": {k: statistics.median(times[k]) / one for k in ks[1:]}}


# ---- (c) ------------------------------------------------------------------------------------
def rollback_cost(model, args, dtype: torch.dtype) -> dict:
    """Per batch size and k: the DeltaNet layers' forward seconds in place, with snapshots and
    with replay's logs, and commit seconds in both modes, for one step of the whole model."""
    mixers = [layer.mixer for layer in model.layers if isinstance(layer.mixer, GatedDeltaNet)]
    mixer = mixers[0]
    R = args.max_rollback + 1
    shape = mixer.state_shape()
    heads = (mixer.num_k_heads, mixer.key_dim, mixer.num_v_heads, mixer.value_dim)
    weights = mixer._kernel_weights()
    device = args.device
    if device == "cuda":
        from outpace.kernels import triton_recurrent

        def layer_forward(proj, cache, layer, table, width):
            log = None if cache.snapshots else cache.log[layer]
            triton_recurrent.gated_deltanet(proj, *weights[:3], cache.conv[layer], cache.state[layer], log, table,
                                            width, heads)
    else:
        def layer_forward(proj, cache, layer, table, width):
            recurrent_kernels.gated_deltanet(proj, *weights, mixer.norm.eps, cache.conv[layer], cache.state[layer],
                                             cache.log[layer], table, heads)
    state_bytes = shape.delta[2] * shape.delta[1] * shape.delta[3] * 4
    rng = random.Random(2)
    results = {}
    for batch in args.batches:
        caches = {}
        for mode in ("snapshots", "replay"):
            entries = R if mode == "snapshots" else 2
            num_layers = max(1, min(len(mixers), MEMORY_BUDGET[device] // (batch * entries * state_bytes)))
            caches[mode] = StateCache([shape] * num_layers, batch, R, mode == "snapshots", dtype, device)
        slots = torch.arange(batch, device=device)
        timings = {k: {name: [] for name in ("in_place", "snapshots", "replay", "commit_snapshots",
                                             "commit_replay")} for k in range(1, R)}
        for rep in range(args.reps + 1):
            for k in rng.sample(range(1, R), R - 1):
                width = k + 1
                proj = torch.randn(batch * width, mixer.in_proj.out_features).to(device, dtype)
                accepted = [next((j for j in range(k) if rng.random() >= ROLLBACK_ACCEPTANCE), k) for _ in slots]
                for mode in ("in_place", "snapshots", "replay"):
                    cache = caches["replay" if mode == "replay" else "snapshots"]
                    verify = mode != "in_place"
                    rows = cache.rows(slots, torch.full((batch,), width, device=device),
                                      torch.zeros(batch, dtype=torch.bool, device=device), width, verify)
                    table = RowGroup(0, batch * width, batch, width, None, rows).table()
                    started = clock(device)
                    for layer in range(len(cache.conv)):
                        layer_forward(proj, cache, layer, table, width)
                    forward = clock(device) - started
                    if verify:
                        started = clock(device)
                        cache.commit(slots, accepted)
                        commit = clock(device) - started
                    if rep:
                        scale = len(mixers) / len(cache.conv)       # to the model's DeltaNet layers
                        timings[k][mode].append(forward * scale)
                        if verify:
                            timings[k][f"commit_{mode}"].append(commit * scale)
        results[batch] = {k: _rollback_row(t) for k, t in timings.items()}
        results[batch]["layers_run"] = {mode: len(c.conv) for mode, c in caches.items()}
        del caches
    return {"num_deltanet_layers": len(mixers), "by_batch": results}


def _rollback_row(t: dict[str, list[float]]) -> dict:
    m = {name: statistics.median(v) for name, v in t.items()}
    snap = m["snapshots"] - m["in_place"] + m["commit_snapshots"]
    replay = m["replay"] - m["in_place"] + m["commit_replay"]
    return m | {"rollback_snapshots": snap, "rollback_replay": replay,
                "replay_over_snapshots": replay / snap if snap > 0 else float("inf")}


# ---- (d) ------------------------------------------------------------------------------------
class FixedRateOracle(Drafter):
    """Drafts the plain run's continuation (`truth`, by prompt), each token replaced by another
    with probability 1 - rate, independently: a draft's first j tokens are all accepted with
    probability rate^j."""

    def __init__(self, vocab: int, rate: float = 1.0, seed: int = 0):
        self.vocab, self.rate, self.rng = vocab, rate, random.Random(seed)
        self.truth: dict[tuple, list[int]] = {}
        self.prompts: dict[int, tuple] = {}
        self.done: dict[int, int] = {}

    def begin(self, seq_id, token_ids):
        self.prompts[seq_id], self.done[seq_id] = tuple(token_ids), 0

    def accept(self, seq_id, token_ids):
        self.done[seq_id] += len(token_ids)

    def propose(self, batch):
        drafts = []
        for seq_id, k in zip(batch.seq_ids, batch.budget):
            done = self.done[seq_id]
            truth = self.truth.get(self.prompts[seq_id], [])[done:done + k]
            drafts.append([t if self.rng.random() < self.rate else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                           for t in truth])
        return Drafts.from_lists(drafts)


def speculation(folder: Path, args, prompt: list[int]) -> dict:
    """Plain decoding and each fixed-rate oracle in one engine, alternately, args.rounds times each."""
    drafter = FixedRateOracle(vocab=2)
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=args.num_draft), drafter=drafter, dtype=args.dtype,
              device=args.device, max_num_seqs=1, max_model_len=len(prompt) + args.new_tokens + 16, calibrate=False,
              recurrent_snapshots=True)
    drafter.vocab = llm.engine.model.cfg.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    truth = llm.generate(prompt, params, speculate=False)[0].token_ids
    drafter.truth[tuple(prompt)] = truth
    modes = {"plain": None} | {f"{rate:.0%}": rate for rate in args.rates}
    runs = {mode: [] for mode in modes}
    for r in range(args.rounds):
        order = list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]
        for mode in order:
            drafter.rate = modes[mode] or 0.0
            out = llm.generate(prompt, params, speculate=modes[mode] is not None)[0]
            runs[mode].append(out)
    speed = {mode: statistics.median((len(o.token_ids) - 1) / o.timing["decode_s"] for o in outs)
             for mode, outs in runs.items()}
    drafted = {mode: sum(o.spec["num_draft_tokens"] for o in outs) for mode, outs in runs.items() if modes[mode]}
    accepted = {mode: sum(o.spec["num_accepted_tokens"] for o in outs) for mode, outs in runs.items() if modes[mode]}
    return {"decode_tokens_per_s": speed, "speedup": {m: speed[m] / speed["plain"] for m in drafted},
            "imposed_acceptance": {m: accepted[m] / max(drafted[m], 1) for m in drafted},
            "identical_to_plain": all(o.token_ids == truth for outs in runs.values() for o in outs),
            "num_draft_tokens": args.num_draft, "rounds": args.rounds}


# ---- the run --------------------------------------------------------------------------------
def models(args) -> tuple[Path, Path]:
    """The hybrid's folder and its dense twin's (built once into the outpace cache)."""
    made = dict(device=args.device, tokenizer_from=args.tokenizer_from)
    if not args.quick:
        return random_qwen35_08b(**made), random_qwen35_08b_dense(**made)
    home = outpace_home() / "models"
    return (random_qwen35_08b(home / "random-qwen3.5-tiny", **made, **TINY | TINY_DELTANET),
            random_qwen35_08b_dense(home / "random-qwen3.5-tiny-dense", **made, **TINY))


def report(results: dict) -> str:
    env, settings = results["environment"], results["settings"]
    lines = [f"CPU flags: {env['cpu_flags']}", f"device {env['device']}, threads {env['threads']}, torch {env['torch']}, "
             f"transformers {env['transformers']}, dtype {settings['dtype']}"]
    if "plain_decode" in results:
        a = results["plain_decode"]
        lines += ["", "(a) plain decode, batch 1, tokens/s: outpace {:.2f}, transformers {:.2f}: {:.2f}x "
                  "(same tokens: {:.0%})".format(a["decode_tokens_per_s"]["outpace"],
                                                 a["decode_tokens_per_s"]["transformers"], a["ratio"],
                                                 a["identical_share"])]
    if "verify_cost" in results:
        b = results["verify_cost"]
        lines += ["", f"(b) verification at batch 1, T(1+k)/T(1) (T(1) = {b['one_token_s'] * 1e3:.1f} ms):",
                  "| k | " + " | ".join(map(str, b["ratio"])) + " |", "|---" * (len(b["ratio"]) + 1) + "|",
                  "| T(1+k)/T(1) | " + " | ".join(f"{r:.3f}" for r in b["ratio"].values()) + " |"]
    if "rollback_cost" in results:
        c = results["rollback_cost"]
        lines += ["", f"(c) rollback per step, ms over the model's {c['num_deltanet_layers']} DeltaNet layers: "
                  "their forward in place / with snapshots / with replay's logs, commit, rollback cost (forward - "
                  "in place + commit), and replay's over snapshots'"]
        for batch, rows in c["by_batch"].items():
            lines += ["", f"batch {batch} (layers run: {rows['layers_run']})",
                      "| k | in place | snapshots | replay | commit snap | commit replay | rollback snap "
                      "| rollback replay | replay / snap |", "|---" * 9 + "|"]
            for k, r in rows.items():
                if k == "layers_run":
                    continue
                ms = [r[n] * 1e3 for n in ("in_place", "snapshots", "replay", "commit_snapshots", "commit_replay",
                                           "rollback_snapshots", "rollback_replay")]
                lines.append(f"| {k} | " + " | ".join(f"{x:.2f}" for x in ms)
                             + f" | {r['replay_over_snapshots']:.2f} |")
    if "speculation" in results:
        labels = settings["rates_label"]
        lines += ["", f"(d) speculation at batch 1, {settings['num_draft']} drafts a step, oracle at imposed rates "
                  "(random weights: not real acceptance); decode tokens/s and speedup over plain:",
                  "| model | plain | " + " | ".join(f"{m} (x)" for m in labels) + " | same tokens |",
                  "|---" * (3 + len(labels)) + "|"]
        for name, d in results["speculation"].items():
            cells = [f"{d['decode_tokens_per_s'][m]:.2f} ({d['speedup'][m]:.2f}x)" for m in d["speedup"]]
            lines.append(f"| {name} | {d['decode_tokens_per_s']['plain']:.2f} | " + " | ".join(cells)
                         + f" | {d['identical_to_plain']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and few tokens: a smoke test in seconds")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="a folder whose tokenizer files the random models take (default: the default model's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: every core)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="random prompt (default 128, quick 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens a run (default 64, quick 8)")
    p.add_argument("--rounds", type=int, default=None, help="runs of each engine or mode (default 2)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions in (b) and (c) (default 5, quick 1)")
    p.add_argument("--num-draft", type=int, default=4, help="(d): drafted tokens a step")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.7, 0.9], help="(d): imposed acceptance rates")
    p.add_argument("--parts", default="abcd", help="which of (a) to (d) to run, e.g. 'a' (default abcd)")
    p.add_argument("--out", type=Path, default=Path("bench-out/hybrid_speed.json"))
    args = p.parse_args(argv)
    quick = args.quick
    args.prompt_tokens = args.prompt_tokens or (16 if quick else 128)
    args.new_tokens = args.new_tokens or (8 if quick else 64)
    args.rounds = args.rounds or 2
    args.reps = args.reps or (1 if quick else 5)
    args.max_verify, args.max_rollback = (4, 4) if quick else (8, 16)
    args.batches = [1, 4] if quick else [1, 32]
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    dtype = getattr(torch, args.dtype)

    hybrid, dense = models(args)
    vocab = json.loads((hybrid / "config.json").read_text())["vocab_size"]
    prompt = random_prompt(args.prompt_tokens, vocab)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"environment": {"cpu_flags": cpu_flags(), "device": card, "threads": torch.get_num_threads(),
                               "torch": torch.__version__,
                               "transformers": __import__("transformers").__version__, "machine": platform.machine()},
               "settings": {"quick": quick, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
                            "new_tokens": args.new_tokens, "num_draft": args.num_draft,
                            "rates_label": [f"{r:.0%}" for r in args.rates], "reps": args.reps}}
    if "a" in args.parts:
        results["plain_decode"] = plain_decode(hybrid, args, prompt)
    if "b" in args.parts or "c" in args.parts:
        model = load_model(hybrid, dtype, args.device, max_len=args.prompt_tokens + 512)
        if "b" in args.parts:
            results["verify_cost"] = verify_cost(model, args, prompt)
        if "c" in args.parts:
            results["rollback_cost"] = rollback_cost(model, args, dtype)
        del model
    if "d" in args.parts:
        results["speculation"] = {"hybrid": speculation(hybrid, args, prompt),
                                  "dense twin": speculation(dense, args, prompt)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results))
    print(f"\nwritten: {args.out}")
    return results


if __name__ == "__main__":
    main()
