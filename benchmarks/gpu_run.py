"""The whole GPU run in one go: exactness checks, then the speed figures of issues 2 and 5.

    PYTHONPATH=src python benchmarks/gpu_run.py --dataset spec_bench_subset.jsonl --out $OUT

1. exactness (default model): speculative greedy equals plain greedy in float64 (batched, CUDA
   graphs, device drafting); exact mode in bfloat16 bit-identical; graphs equal eager (reported).
2. plain decode, batch 1, bfloat16, random weights of Llama-3-8B's shape: outpace with and without
   CUDA graphs (and graphs without overlap: each step launched after the host read the last) against the memory-bandwidth limit (weight bytes / device-to-device copy bandwidth
   measured here, read plus write) and against transformers' generate on the same shape.
3. verification cost T(1+k) / T(1), k = 1..16, batch 1, 8, 32, for the 8B shape and the default model.
4. default model: plain decode against transformers (from the same GGUF); n-gram speculation
   against outpace's plain decoding on Spec-Bench first turns (greedy), per category and overall
   (the target with overlap, the default; then both modes again without it).
5. serving throughput at concurrency 1, 8, 32, with and without speculation (engine level: the
   requests of a wave are submitted at once; output tokens over wall time; after an untimed wave
   per mode, each wave's prompts run in both modes, the order alternating).
Prints tables, writes gpu_run.json under --out, exits 1 if a check of 1 fails. Timings of one
table come from one run on one card; every baseline is measured in the same run.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import outpace.engine.llm_engine as llm_engine
from outpace.config import SamplingParams, SpecConfig
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import Row
from outpace.llm import LLM
from outpace.model.config import ModelConfig
from outpace.weights.hub import resolve_model
from outpace.model.registry import FAMILIES
from outpace.model.rope import rope_tables

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2)
SMOKE_SHAPE = dict(LLAMA3_8B, vocab_size=50000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2)
EXACT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Summarize: Paris is the capital of France. It is known for the Eiffel Tower. Summary:",
    "List the planets of the solar system in order: Mercury, Venus,",
]
VERIFY_K = list(range(0, 17))          # drafts per row; T(1 + k)
VERIFY_BATCHES = [1, 8, 32]
VERIFY_AT = 256                        # the rows' first position in the verification-cost table
results: dict = {"checks": {}, "targets": {}}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def per_call_s(fn, device, reps: int, rounds: int = 3) -> float:
    """Median over rounds of the mean time of `reps` back-to-back calls (warmed up first)."""
    fn()
    times = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def free():
    """Return memory of objects the caller has just dropped (graph pools included)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(title, header, rows):
    lines = [f"\n### {title}", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    print("\n".join(lines), flush=True)


def greedy(max_tokens, ignore_eos=True):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def set_overlap(llm, on: bool):
    """Whether a greedy graph step's successor launches before its tokens are read (the engine's
    GraphStep reads this on every step)."""
    llm.engine.steps.overlap = on


def set_graphs(llm_or_runner, on: bool):
    runner = getattr(getattr(llm_or_runner, "engine", None), "runner", llm_or_runner)
    if isinstance(runner, CudaGraphRunner):
        runner.use_graphs = on and bool(runner.graphs)


# plain decode modes timed against each other: (label, CUDA graphs, overlap); graphs with overlap,
# the default, twice so that the spread shows noise
DECODE_MODES = [("graphs", True, True), ("graphs, no overlap", True, False), ("eager", False, True),
                ("graphs", True, True), ("graphs, no overlap", True, False)]


def decode_modes(llm, ids, n) -> dict[str, list[float]]:
    rates = {}
    for label, graphs, overlap in DECODE_MODES:
        set_graphs(llm, graphs)
        set_overlap(llm, overlap)
        rates.setdefault(label, []).append(decode_rate(llm, ids, n)[0])
    set_graphs(llm, True)
    set_overlap(llm, True)
    return rates


def decode_rate(llm, ids, max_tokens, speculate=False):
    """Decode tokens/s over prompts run one after another (batch 1): sum(n - 1) / sum(decode_s)."""
    outs = [llm.generate(i, greedy(max_tokens), speculate=speculate)[0] for i in ids]
    return sum(o.num_generated_tokens - 1 for o in outs) / sum(o.timing["decode_s"] for o in outs), outs


# ---- 0. the card ------------------------------------------------------------------------------
def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read plus written per second (1 GiB each way)."""
    src = torch.randint(0, 255, (2**30,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    s = per_call_s(lambda: dst.copy_(src), device, reps=10)
    del src, dst
    free()
    return 2 * 2**30 / s


# ---- 1. exactness -----------------------------------------------------------------------------
def exactness(model, device, quick):
    n = 48 if quick else 96
    llm = LLM(model, spec=SpecConfig(num_draft_tokens=8), dtype="float64", device=device, max_num_seqs=4,
              max_model_len=1024, calibrate=False)
    ids = [llm.tokenizer.encode(p) for p in EXACT_PROMPTS]
    spec = [o.token_ids for o in llm.generate(ids, greedy(n))]          # 4 at once: buckets > 1
    plain = [o.token_ids for o in llm.generate(ids, greedy(n), speculate=False)]
    accepted = llm.engine.stats.num_accepted_tokens
    results["checks"]["float64 speculative greedy == plain greedy"] = ok64 = spec == plain and accepted > 0
    log(f"[exact] float64 spec == plain: {spec == plain} ({accepted} drafts accepted)")
    del llm
    free()
    llm = LLM(model, spec=SpecConfig(num_draft_tokens=8, exact=True), dtype="bfloat16", device=device,
              max_num_seqs=1, max_model_len=1024, calibrate=False)
    spec = [o.token_ids for o in llm.generate(ids, greedy(n))]
    plain = [o.token_ids for o in llm.generate(ids, greedy(n), speculate=False)]
    accepted = llm.engine.stats.num_accepted_tokens
    results["checks"]["bfloat16 exact mode: speculative == plain, bit for bit"] = okx = spec == plain and accepted > 0
    set_graphs(llm, False)
    eager = [o.token_ids for o in llm.generate(ids, greedy(n), speculate=False)]
    results["graphs_equal_eager_bf16_exact"] = eager == plain
    log(f"[exact] bf16 exact spec == plain: {spec == plain} ({accepted} accepted); graphs == eager: {eager == plain}")
    del llm
    free()
    table("Exactness (default model, greedy, CUDA graphs, device n-gram drafting)", ["check", "result"],
          [["float64: speculative == plain (4 prompts batched)", "PASS" if ok64 else "FAIL"],
           ["bfloat16 exact mode: speculative == plain, bit for bit", "PASS" if okx else "FAIL"],
           ["bfloat16 exact mode: graph replay == eager (reported)", results["graphs_equal_eager_bf16_exact"]]])


# ---- 2 and 3: the 8B shape ----------------------------------------------------------------------
def random_model(folder, max_len, device):
    """Random bfloat16 weights built on the device (never written to disk)."""
    cfg = ModelConfig.from_folder(folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = FAMILIES[cfg.family](cfg, max_len)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_len, cfg.rope_scaling)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval().requires_grad_(False)


def shape_folder(root: Path, shape: dict, tokenizer_from: Path) -> Path:
    """config.json of the shape and the default model's tokenizer (its ids fit any larger vocabulary)."""
    from safetensors.torch import save_file
    folder = root / "random-shape"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape))
    save_file({"unused": torch.zeros(1)}, str(folder / "model.safetensors"))   # resolve_model looks for one
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_from / name).is_file():
            (folder / name).write_bytes((tokenizer_from / name).read_bytes())
    return folder


def verify_table(model, device, label, quick):
    """ratio[b][k] = T(b rows of 1 + k tokens) / T(b rows of 1 token), CUDA graphs replayed; rows
    at position VERIFY_AT, so attention reads the 512-key bucket."""
    runner = CudaGraphRunner(model, max(VERIFY_BATCHES), 1024, 1 + VERIFY_K[-1], num_draft_tokens=VERIFY_K[-1],
                             batch_sizes=VERIFY_BATCHES, kv_lens=[512])
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    seconds = {}
    for b in VERIFY_BATCHES:
        for k in VERIFY_K:
            rows = [Row(slot, torch.randint(vocab, (1 + k,), generator=gen).tolist(), VERIFY_AT) for slot in range(b)]
            reps = 3 if quick else max(5, min(50, int(0.05 / max(runner_step_guess(model, b, k), 1e-4))))
            seconds[(b, k)] = per_call_s(lambda: runner.forward(rows), device, reps)
    ratios = {b: [seconds[(b, k)] / seconds[(b, 0)] for k in VERIFY_K] for b in VERIFY_BATCHES}
    table(f"Verification cost T(1+k)/T(1), {label} (CUDA graphs, rows at position {VERIFY_AT}, 512 keys; "
          "T(1) in ms in the first column)",
          ["batch", "T(1) ms"] + [f"k={k}" for k in VERIFY_K[1:]],
          [[b, f"{seconds[(b, 0)] * 1e3:.3f}"] + [f"{r:.3f}" for r in ratios[b][1:]] for b in VERIFY_BATCHES])
    del runner
    free()
    return {"seconds": {f"{b}x{1 + k}": s for (b, k), s in seconds.items()},
            "ratio": {str(b): r for b, r in ratios.items()}, "ratio_b1_k8": ratios[1][8]}


def runner_step_guess(model, b, k):
    """A rough forward time (s) to pick repetitions: weight bytes at 3 TB/s or FLOPs at 600 TFLOP/s."""
    params = sum(p.numel() for p in model.parameters())
    return max(2 * params / 3e12, 2 * params * b * (1 + k) / 6e14)


def llama3_shape(args, tokenizer_from, prompt_ids):
    device = args.device
    shape = SMOKE_SHAPE if args.smoke else LLAMA3_8B
    folder = shape_folder(Path(args.scratch), shape, tokenizer_from)
    built = {}
    original = llm_engine.load_model

    def load_random(folder_, dtype, device_, max_len, *_, **__):
        built["model"] = random_model(folder_, max_len, device_)
        return built["model"]

    llm_engine.load_model = load_random
    try:
        llm = LLM(str(folder), spec="none", dtype="bfloat16", device=device, max_num_seqs=1, max_model_len=1024,
                  max_prefill_tokens=128, calibrate=False)       # attention reads 1024 + 128 positions
    finally:
        llm_engine.load_model = original
    model = built["model"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_bytes = model.embed.weight.numel() * model.embed.weight.element_size()
    n = 32 if args.quick else 128
    rates = decode_modes(llm, [prompt_ids], n)
    bw = results["copy_bandwidth_Bps"]
    limit = bw / weight_bytes
    out = {"weight_bytes": weight_bytes, "limit_tokens_per_s": limit,
           "limit_without_embedding_tokens_per_s": bw / (weight_bytes - embed_bytes),
           "outpace_graphs_tokens_per_s": max(rates["graphs"]), "outpace_graphs_runs": rates["graphs"],
           "outpace_graphs_no_overlap_runs": rates["graphs, no overlap"],
           "outpace_eager_tokens_per_s": rates["eager"][0]}
    log(f"[8B] decode: {out}")
    out["verify"] = verify_table(model, device, "Llama-3-8B shape, random bf16", args.quick)
    del llm, model
    built.clear()
    free()
    out["transformers_tokens_per_s"] = transformers_random(shape, device, prompt_ids, 8 if args.quick else 32)
    results["llama3_8b_shape"] = out
    util = out["outpace_graphs_tokens_per_s"] / limit
    vs_hf = out["outpace_eager_tokens_per_s"] / out["transformers_tokens_per_s"]
    results["targets"]["8B decode >= 85% of bandwidth limit (graphs)"] = [round(util, 3), util >= 0.85]
    results["targets"]["8B eager >= 3x transformers"] = [round(vs_hf, 2), vs_hf >= 3]
    results["targets"]["8B verify ratio b1 k8 <= 1.15"] = [round(out["verify"]["ratio_b1_k8"], 3),
                                                           out["verify"]["ratio_b1_k8"] <= 1.15]
    table("Plain decode, batch 1, bf16, random Llama-3-8B shape", ["engine", "tokens/s", "of limit"],
          [["bandwidth limit (all weight bytes / copy bandwidth)", f"{limit:.1f}", "1.000"],
           ["outpace, CUDA graphs (runs: " + ", ".join(f"{r:.1f}" for r in rates["graphs"]) + ")",
            f"{out['outpace_graphs_tokens_per_s']:.1f}", f"{util:.3f}"],
           ["outpace, CUDA graphs, no overlap", f"{max(rates['graphs, no overlap']):.1f}",
            f"{max(rates['graphs, no overlap']) / limit:.3f}"],
           ["outpace, eager (--no-cuda-graphs)", f"{out['outpace_eager_tokens_per_s']:.1f}",
            f"{out['outpace_eager_tokens_per_s'] / limit:.3f}"],
           ["transformers generate", f"{out['transformers_tokens_per_s']:.1f}",
            f"{out['transformers_tokens_per_s'] / limit:.3f}"]])


def hf_decode_rate(hf, ids, n, device) -> float:
    """transformers greedy generate: (n - 1) / (time for n new tokens - time for 1)."""
    x = torch.tensor([ids], device=device)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)

    def run(m):
        sync(device)
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=m, min_new_tokens=m, **kw)
        sync(device)
        return time.perf_counter() - t0

    run(2)
    return (n - 1) / (run(n) - run(1))


def transformers_random(shape, device, ids, n) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in shape.items()
                                                 if k not in ("architectures", "model_type")}))
    finally:
        torch.set_default_dtype(previous)
    with torch.inference_mode():
        rate = hf_decode_rate(hf.eval(), ids, n, device)
    del hf
    free()
    return rate


# ---- 4. the default model -----------------------------------------------------------------------
def load_dataset(path, per_category):
    firsts: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            firsts.setdefault(r["category"], [])
            if len(firsts[r["category"]]) < per_category:
                firsts[r["category"]].append(r["turns"][0])
    return firsts


def chat_ids(llm, text):
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                      add_special_tokens=False)


def default_model(args, model, gguf, prompts):
    device = args.device
    llm = LLM(model, spec=SpecConfig(num_draft_tokens=args.num_draft_tokens), dtype="bfloat16", device=device,
              max_num_seqs=1, max_model_len=4096, prefix_caching=False)     # both modes prefill each prompt whole: the one run second would find it cached
    first = [chat_ids(llm, p[0]) for p in prompts.values()][:3]
    n = 64 if args.quick else 256
    rates = decode_modes(llm, first, n)
    hf_rate = default_transformers(gguf, device, first[0], 16 if args.quick else 64)
    out = {"outpace_graphs_tokens_per_s": max(rates["graphs"]), "outpace_graphs_runs": rates["graphs"],
           "outpace_graphs_no_overlap_runs": rates["graphs, no overlap"],
           "outpace_eager_tokens_per_s": rates["eager"][0], "transformers_tokens_per_s": hf_rate}
    table("Plain decode, batch 1, bf16, default model (SmolLM2-135M-Instruct Q4_1)", ["engine", "tokens/s", "x transformers"],
          [["outpace, CUDA graphs", f"{out['outpace_graphs_tokens_per_s']:.1f}",
            f"{out['outpace_graphs_tokens_per_s'] / hf_rate:.2f}"],
           ["outpace, CUDA graphs, no overlap", f"{max(rates['graphs, no overlap']):.1f}",
            f"{max(rates['graphs, no overlap']) / hf_rate:.2f}"],
           ["outpace, eager (--no-cuda-graphs)", f"{out['outpace_eager_tokens_per_s']:.1f}",
            f"{out['outpace_eager_tokens_per_s'] / hf_rate:.2f}"],
           ["transformers generate (same GGUF)", f"{hf_rate:.1f}", "1.00"]])
    curve = llm.engine.controller.curves.get(1)      # (tokens per row, seconds) at batch 1
    out["controller_cost_ratio_b1"] = [t / curve[0][1] for _, t in curve] if curve else None
    log(f"[default] calibrated verify cost ratio, batch 1: {out['controller_cost_ratio_b1']}")
    out["spec_bench"] = spec_bench(llm, prompts, 64 if args.quick else 256)
    set_overlap(llm, False)
    out["spec_bench_no_overlap"] = spec_bench(llm, prompts, 64 if args.quick else 256, target=False)
    set_overlap(llm, True)
    out["verify"] = verify_table(llm.engine.model, device, "default model, bf16", args.quick)
    del llm
    free()
    results["default_model"] = out


def default_transformers(gguf, device, ids, n) -> float:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name,
                                              dtype=torch.bfloat16).to(device).eval()
    with torch.inference_mode():
        rate = hf_decode_rate(hf, ids, n, device)
    del hf
    free()
    return rate


def spec_bench(llm, prompts, max_tokens, target=True):
    """First turns, batch 1, greedy with EOS; speculative and plain alternate which goes first.
    target: this run's overall speedup is the target's figure (else reported only)."""
    overlap = "" if llm.engine.steps.overlap else ", no overlap"
    params = greedy(max_tokens, ignore_eos=False)
    per_cat, count = {}, 0
    for category, texts in prompts.items():
        c = per_cat.setdefault(category, {"spec_tokens": 0, "spec_s": 0.0, "plain_tokens": 0, "plain_s": 0.0,
                                          "identical": 0, "prompts": 0, "accepted": 0, "steps": 0})
        for text in texts:
            ids = chat_ids(llm, text)
            if len(ids) + max_tokens > llm.engine.config.max_model_len:
                log(f"[spec-bench] skipped a {category} prompt of {len(ids)} tokens")
                continue
            order = (True, False) if count % 2 == 0 else (False, True)
            count += 1
            outs = {}
            for speculate in order:
                outs[speculate] = llm.generate(ids, params, speculate=speculate)[0]
            for key, o in (("spec", outs[True]), ("plain", outs[False])):
                c[f"{key}_tokens"] += o.num_generated_tokens
                c[f"{key}_s"] += o.timing["prefill_s"] + o.timing["decode_s"]
            c["identical"] += outs[True].token_ids == outs[False].token_ids
            c["prompts"] += 1
            c["accepted"] += outs[True].spec["num_accepted_tokens"]
            c["steps"] += outs[True].spec["num_verify_steps"]
        log(f"[spec-bench] {category}: {c}")
    rows, total = [], {k: 0 for k in ("spec_tokens", "spec_s", "plain_tokens", "plain_s", "identical", "prompts",
                                      "accepted", "steps")}
    for category, c in list(per_cat.items()) + [("overall", total)]:
        if category != "overall":
            for k in total:
                total[k] += c[k]
        spec_rate, plain_rate = c["spec_tokens"] / c["spec_s"], c["plain_tokens"] / c["plain_s"]
        c["speedup"] = spec_rate / plain_rate
        rows.append([category, c["prompts"], f"{plain_rate:.1f}", f"{spec_rate:.1f}", f"{c['speedup']:.2f}",
                     f"{(c['accepted'] + c['steps']) / max(c['steps'], 1):.2f}", f"{c['identical']}/{c['prompts']}"])
    table(f"Spec-Bench first turns, default model, bf16, batch 1, greedy, max_tokens {max_tokens}{overlap} "
          "(tokens/s = output tokens / request time)",
          ["category", "prompts", "plain tok/s", "n-gram tok/s", "speedup", "tokens/step", "identical"], rows)
    if target:
        results["targets"]["Spec-Bench overall speedup >= 1.5"] = [round(total["speedup"], 3), total["speedup"] >= 1.5]
    return {"per_category": per_cat, "overall": total}


# ---- 5. serving ---------------------------------------------------------------------------------
def serving(args, model, prompts):
    texts = [t for ts in prompts.values() for t in ts]
    llm = LLM(model, spec=SpecConfig(num_draft_tokens=args.num_draft_tokens), dtype="bfloat16", device=args.device,
              max_num_seqs=32, max_model_len=2048, prefix_caching=False)    # both modes prefill each prompt whole: the one run second would find it cached
    engine = llm.engine
    params = greedy(128 if args.quick else 256, ignore_eos=False)
    ids = [i for i in (chat_ids(llm, t) for t in texts) if len(i) + params.max_tokens <= 2048]
    rows, out = [], {}

    def wave(batch, speculate):
        seqs = [engine.add_request(i, params, speculate) for i in batch]
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        seconds = time.perf_counter() - started
        tokens = sum(s.num_output_tokens for s in seqs)
        drafted = sum(s.stats.num_draft_tokens for s in seqs)
        accepted = sum(s.stats.num_accepted_tokens for s in seqs)
        log(f"[serving] {len(batch)} requests, {'n-gram' if speculate else 'plain'}: {tokens} tokens in {steps} "
            f"steps, {seconds:.2f} s; drafted {drafted}, accepted {accepted}")
        return tokens, seconds

    for concurrency in (1, 8, 32):
        waves = {1: 4, 8: 2, 32: 2}[concurrency] if not args.quick else 2
        for speculate in (False, True):     # untimed: a shape's first steps pay one-time costs
            wave(ids[:concurrency], speculate)
        totals = {False: [0, 0.0], True: [0, 0.0]}
        for w in range(waves):              # each wave's prompts once per mode, the order alternating
            batch = [ids[(w * concurrency + i) % len(ids)] for i in range(concurrency)]
            for speculate in ((False, True) if w % 2 == 0 else (True, False)):
                tokens, seconds = wave(batch, speculate)
                totals[speculate][0] += tokens
                totals[speculate][1] += seconds
        for speculate, (tokens, seconds) in totals.items():
            out[f"c{concurrency}_{'spec' if speculate else 'plain'}"] = tokens / seconds
        speedup = out[f"c{concurrency}_spec"] / out[f"c{concurrency}_plain"]
        rows.append([concurrency, f"{out[f'c{concurrency}_plain']:.0f}", f"{out[f'c{concurrency}_spec']:.0f}",
                     f"{speedup:.2f}"])
    table("Serving throughput, default model, bf16, CUDA graphs (output tokens/s, all requests of a wave at once)",
          ["concurrency", "plain", "n-gram", "speedup"], rows)
    del llm, engine
    free()
    results["serving"] = out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the default model, or its .gguf path")
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--per-category", type=int, default=10)
    p.add_argument("--out", default="gpu-run-out")
    p.add_argument("--scratch", default="/tmp/outpace-gpu-run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (a debugging run)")
    p.add_argument("--smoke", action="store_true", help="a small random shape instead of Llama-3-8B's")
    p.add_argument("--only", nargs="*", default=["exact", "8b", "default", "serving"])
    p.add_argument("--num-draft-tokens", type=int, default=8, help="most tokens drafted per step (sections 4, 5)")
    args = p.parse_args()
    started = time.perf_counter()
    folder = resolve_model(args.model)
    from outpace.paths import outpace_home
    from outpace.weights.hub import REGISTRY
    gguf = args.model if args.model.endswith(".gguf") else outpace_home() / "downloads" / REGISTRY[args.model].filename
    import transformers
    results["environment"] = {
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "command": " ".join(sys.argv)}
    print(f"card: {results['environment']['card']}; torch {torch.__version__}; transformers "
          f"{transformers.__version__}; command: {' '.join(sys.argv)}", flush=True)
    results["copy_bandwidth_Bps"] = copy_bandwidth(args.device)
    print(f"device-to-device copy bandwidth (read + write): {results['copy_bandwidth_Bps'] / 1e12:.3f} TB/s", flush=True)
    prompts = load_dataset(args.dataset, 2 if args.quick else args.per_category)
    if args.smoke:
        prompts = dict(list(prompts.items())[:2])
    steps = {"exact": lambda: exactness(args.model, args.device, args.quick),
             "8b": lambda: llama3_shape(args, folder, chat_ids_plain(folder, prompts)),
             "default": lambda: default_model(args, args.model, gguf, prompts),
             "serving": lambda: serving(args, args.model, prompts)}
    for name in args.only:
        t0 = time.perf_counter()
        try:
            steps[name]()
        except Exception as e:                     # keep the other sections' figures
            import traceback
            traceback.print_exc()
            results.setdefault("errors", {})[name] = repr(e)
        log(f"[{name}] {time.perf_counter() - t0:.1f} s")
    results["wall_s"] = time.perf_counter() - started
    table("Targets", ["target", "value", "met"], [[k, v[0], v[1]] for k, v in results["targets"].items()])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_run.json").write_text(json.dumps(results, indent=1, default=str))
    failed = [k for k, v in results["checks"].items() if not v] + list(results.get("errors", {}))
    print(f"\nchecks: {'FAILED: ' + ', '.join(failed) if failed else 'all passed'}; wall {results['wall_s']:.0f} s")
    sys.exit(1 if failed else 0)


def chat_ids_plain(folder, prompts):
    from outpace.weights.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    text = next(iter(prompts.values()))[0]
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                      add_special_tokens=False)


if __name__ == "__main__":
    main()
