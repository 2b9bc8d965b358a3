"""Speculative decoding in three engines, on the same Spec-Bench prompts in one run.

    outpace       its drafter (--spec: n-gram lookup by default) and plain decoding
                  (speculate=False), one engine
    transformers  generate(..., prompt_lookup_num_tokens=N), or with --spec draft its assisted
                  generation (generate(..., assistant_model=the draft model)), and plain generate,
                  on the models dequantized from the same GGUFs, in outpace's dtype
    llama.cpp     llama-cpp-python on the GGUF file itself (its own quantized kernels), with its
                  LlamaPromptLookupDecoding draft model, or with --spec draft a draft model of the
                  draft GGUF through the same hook (the binding ships prompt lookup only:
                  peers.LlamaCppModelDraft runs a second Llama, --llamacpp-draft-tokens a call),
                  and without; skipped with a message when llama-cpp-python is not installed
                  (pip install 'outpace[llamacpp]')

Every engine decodes greedily from the same prompt token ids (outpace's tokenizer and chat
template); a multi-turn question is a conversation with each engine's own earlier answers. Within
each engine, the speculative and plain runs alternate which goes first from question to question.
Reported per engine: tokens/s (generated tokens / (prefill + decode time)), decode tokens/s,
speedup over its own plain decoding, and the share of questions whose speculative output equals
its own plain output token for token; across engines, how far each peer's first answer (plain where
it ran) agrees with outpace's plain one. Before the questions, prompt processing: each engine's plain
instance reads one prompt of --prompt-tokens tokens (the dataset's questions, run together) and makes
one token, best of 3; tokens/s = prompt tokens / time to the first new token.

    python benchmarks/spec_peers.py --limit-per-category 10 --max-tokens 256

--peer-modes plain runs the peers' plain decoding only (outpace still runs both), for a bar set
against their plain decoding: llama.cpp's prompt lookup is its slowest mode on the CPU, and a whole
Spec-Bench pass of it takes longer than the rest of the run together.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from outpace.bench.dataset import load_spec_bench
from outpace.bench.models import gguf_file
from outpace.bench.peers import (LlamaCppEngine, OutpaceEngine, TransformersEngine, load_llamacpp,
                                 load_transformers)
from outpace.cli import add_spec_args, spec_config
from outpace.kernels import cpu_isa
from outpace.llm import LLM

DATASET = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl"
MODES = ("spec", "plain")


def converse(engine, tokenizer, turns, max_tokens: int, ignore_eos: bool) -> list[dict]:
    """One question as a conversation with the engine's own answers; one run record per turn."""
    messages, runs = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        gen = engine.generate(ids, max_tokens, ignore_eos)
        messages.append({"role": "assistant", "content": tokenizer.decode(gen.token_ids)})
        runs.append({"num_prompt_tokens": len(ids), **gen.as_dict()})
    return runs


def build_engines(args, llm: LLM) -> dict[str, dict]:
    """{engine: {"spec": engine, "plain": engine}} for every engine that is available."""
    eos = sorted(set(llm.engine.model.cfg.eos_token_ids) | set(llm.tokenizer.eos_token_ids))
    engines = {"outpace": {"spec": OutpaceEngine(llm, True), "plain": OutpaceEngine(llm, False)}}
    gguf = gguf_file(args.model)
    drafts_by_model = llm.engine.config.spec.method == "draft"
    if "transformers" in args.engines:
        hf = load_transformers(gguf or args.model, llm.engine.dtype, llm.engine.device)
        if drafts_by_model:
            draft = llm.engine.config.spec.draft_model
            assistant = load_transformers(gguf_file(draft) or draft, llm.engine.dtype, llm.engine.device)
            spec = TransformersEngine(hf, eos, assistant=assistant)
        else:
            spec = TransformersEngine(hf, eos, args.hf_lookup_tokens)
        pair = {"spec": spec, "plain": TransformersEngine(hf, eos)}
        engines["transformers"] = {m: pair[m] for m in args.peer_modes}
    if "llamacpp" in args.engines:
        if gguf is None:
            print("llama.cpp skipped: it needs a .gguf model", file=sys.stderr)
        else:
            threads = args.threads or os.cpu_count() or 1
            draft_tokens = {"spec": args.llamacpp_draft_tokens, "plain": 0}
            draft_gguf = None
            if drafts_by_model:
                draft_gguf = gguf_file(llm.engine.config.spec.draft_model)
                if draft_gguf is None:
                    print("llama.cpp drafts no model: the draft model is not a .gguf", file=sys.stderr)
            modes = [m for m in args.peer_modes if m == "plain" or not drafts_by_model or draft_gguf is not None]
            loaded = {m: load_llamacpp(gguf, args.max_model_len, threads, draft_tokens[m], draft_gguf)
                      for m in modes}
            if None not in loaded.values():
                engines["llama.cpp"] = {m: LlamaCppEngine(llama, eos) for m, llama in loaded.items()}
    return engines


def prompt_processing(engines: dict[str, dict], tokenizer, records, num_tokens: int, rounds: int) -> dict[str, float]:
    """Prompt tokens per second of each engine's plain instance on one prompt of num_tokens tokens:
    the best of `rounds` rounds, each engine once a round (a shared machine's speed drifts over
    minutes; interleaved, every engine meets the same spells)."""
    text = "\n\n".join(turn for r in records for turn in r.turns)
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    if len(ids) < num_tokens:
        raise SystemExit(f"the dataset holds {len(ids)} tokens, fewer than --prompt-tokens {num_tokens}")
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(rounds):
        for name, pair in engines.items():
            engine = pair.get("plain") or pair["spec"]
            best[name] = min(best[name], engine.generate(ids, 1, ignore_eos=True).prefill_s)
    return {name: num_tokens / seconds for name, seconds in best.items()}


def llamacpp_build() -> str:
    import llama_cpp
    return f"{llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}"


def figures(runs: list[dict]) -> dict:
    tokens = sum(r["num_tokens"] for r in runs)
    total_s = sum(r["prefill_s"] + r["decode_s"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    return {"num_tokens": tokens, "total_s": total_s,
            "tokens_per_s": tokens / total_s if total_s else 0.0,
            "decode_tokens_per_s": sum(max(r["num_tokens"] - 1, 0) for r in runs) / decode_s if decode_s else 0.0}


def summarize(questions: list[dict], engines: list[str]) -> dict:
    """Per engine: figures of each mode it ran, and with both modes the speedup over its own plain
    runs and the share of questions whose outputs are identical."""
    out = {}
    for name in engines:
        ran = [m for m in MODES if m in questions[0]["runs"][name]]
        modes = {m: figures([t for q in questions for t in q["runs"][name][m]]) for m in ran}
        both = len(ran) == len(MODES)
        same = [q["identical"][name] for q in questions]
        out[name] = {**modes, "speedup": modes["spec"]["tokens_per_s"] / modes["plain"]["tokens_per_s"]
                     if both and modes["plain"]["tokens_per_s"] else None,
                     "identical_share": sum(same) / len(same) if both else None}
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(questions: list[dict], peer: str) -> dict:
    """How a peer's first answers compare with outpace's plain ones (the later turns continue each
    engine's own conversation, so only the first turn has the same prompt in both): the share equal
    token for token, and the mean length of their common prefix in tokens."""
    pairs = []
    for q in questions:
        mode = "plain" if "plain" in q["runs"][peer] else "spec"
        pairs.append((q["runs"]["outpace"]["plain"][0]["token_ids"], q["runs"][peer][mode][0]["token_ids"]))
    return {"equal_share": sum(a == b for a, b in pairs) / len(pairs),
            "mean_common_prefix": sum(common_prefix(a, b) for a, b in pairs) / len(pairs)}


def _cell(figures: dict | None, key: str) -> str:
    return f"{figures[key]:.1f}" if figures else "-"


def table(summary: dict) -> str:
    lines = ["| engine | spec tok/s | plain tok/s | speedup | spec decode tok/s | plain decode tok/s | identical |",
             "|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        spec, plain = s.get("spec"), s.get("plain")
        speedup = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        identical = f"{s['identical_share']:.0%}" if s["identical_share"] is not None else "-"
        lines.append(f"| {name} | {_cell(spec, 'tokens_per_s')} | {_cell(plain, 'tokens_per_s')} | {speedup} "
                     f"| {_cell(spec, 'decode_tokens_per_s')} | {_cell(plain, 'decode_tokens_per_s')} | {identical} |")
    return "\n".join(lines)


def category_table(by_category: dict[str, dict]) -> str:
    engines = list(next(iter(by_category.values())))
    lines = ["| category | " + " | ".join(f"{e} spec / plain tok/s" for e in engines) + " |",
             "|---|" + "---|" * len(engines)]
    for category, summary in by_category.items():
        cells = [f"{_cell(summary[e].get('spec'), 'tokens_per_s')} / {_cell(summary[e].get('plain'), 'tokens_per_s')}"
                 for e in engines]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", type=Path, default=DATASET, help="Spec-Bench JSONL")
    p.add_argument("--category", nargs="+", default=None, help="only these categories (default: all)")
    p.add_argument("--limit-per-category", type=int, default=10, help="questions per category (default 10)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--model", default="smollm2-135m", help="known name or .gguf file (llama.cpp needs a GGUF)")
    p.add_argument("--dtype", default="auto", help="outpace's and transformers' dtype (auto: outpace's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="CPU threads of every engine (default: all cores)")
    p.add_argument("--engines", nargs="+", default=["outpace", "transformers", "llamacpp"],
                   choices=["outpace", "transformers", "llamacpp"], help="outpace always runs")
    p.add_argument("--hf-lookup-tokens", type=int, default=10,
                   help="transformers' prompt_lookup_num_tokens (default 10, its documented example)")
    p.add_argument("--llamacpp-draft-tokens", type=int, default=None,
                   help="LlamaPromptLookupDecoding num_pred_tokens (default 10, its default), or with --spec "
                        "draft the draft model's tokens a call (default 5: it has no confidence stop)")
    p.add_argument("--peer-modes", nargs="+", choices=MODES, default=list(MODES),
                   help="the peers' modes: spec (their prompt lookup, or their draft model with --spec draft) "
                        "and plain (default both; outpace runs both)")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="the prompt-processing prompt's length (0: skip that measurement)")
    p.add_argument("--prompt-rounds", type=int, default=3, help="prompt-processing rounds, the best kept (default 3)")
    p.add_argument("--out", type=Path, default=Path("bench-out/spec_peers.json"))
    add_spec_args(p)
    args = p.parse_args()

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    records = load_spec_bench(args.dataset, args.category, args.limit_per_category)
    spec = spec_config(args)
    if args.llamacpp_draft_tokens is None:
        args.llamacpp_draft_tokens = 5 if spec.method == "draft" else 10
    llm = LLM(args.model, spec=spec, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=1, prefix_caching=False)        # both modes prefill each prompt whole: the one run second would find it cached
    engines = build_engines(args, llm)
    tokenizer = llm.tokenizer
    for pair in engines.values():                       # untimed: first calls allocate
        for engine in pair.values():
            engine.generate(tokenizer.encode("Hello, how are you?"), 8, ignore_eos=True)

    started = time.perf_counter()
    prompt_tps = (prompt_processing(engines, tokenizer, load_spec_bench(args.dataset), args.prompt_tokens,
                                    args.prompt_rounds)
                  if args.prompt_tokens else {})
    questions = []
    for i, record in enumerate(tqdm(records, desc="spec_peers", unit="question")):
        order = MODES if i % 2 == 0 else MODES[::-1]
        runs = {name: {m: converse(pair[m], tokenizer, record.turns, args.max_tokens, args.ignore_eos)
                       for m in order if m in pair} for name, pair in engines.items()}
        identical = {name: all(a["token_ids"] == b["token_ids"] for a, b in zip(r["spec"], r["plain"]))
                     if len(r) == len(MODES) else None for name, r in runs.items()}
        questions.append({"question_id": record.question_id, "category": record.category,
                          "first": order[0], "identical": identical, "runs": runs})

    names = list(engines)
    overall = summarize(questions, names)
    categories = {}
    for q in questions:
        categories.setdefault(q["category"], []).append(q)
    by_category = {c: summarize(qs, names) for c, qs in categories.items()}
    agrees = {n: agreement(questions, n) for n in names[1:]}
    ours = overall["outpace"]["spec"]["tokens_per_s"]
    ratios = {}
    for n in names[1:]:                                 # the bars: outpace against each peer
        if "spec" in overall[n]:
            ratios[f"outpace_spec_over_{n}_spec"] = ours / overall[n]["spec"]["tokens_per_s"]
        if "plain" in overall[n]:
            ratios[f"outpace_spec_over_{n}_plain"] = ours / overall[n]["plain"]["tokens_per_s"]
            ratios[f"outpace_plain_decode_over_{n}_plain_decode"] = (
                overall["outpace"]["plain"]["decode_tokens_per_s"] / overall[n]["plain"]["decode_tokens_per_s"])
        if prompt_tps:
            ratios[f"outpace_prompt_over_{n}_prompt"] = prompt_tps["outpace"] / prompt_tps[n]
    report = {
        "settings": {"model": args.model, "gguf": str(gguf_file(args.model)),
                     "dtype": str(llm.engine.dtype).removeprefix("torch."), "device": llm.engine.device,
                     "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
                     "outpace_spec": vars(spec), "hf_prompt_lookup_num_tokens": args.hf_lookup_tokens,
                     "hf_assistant_model": spec.draft_model if spec.method == "draft" else None,
                     "llamacpp_num_pred_tokens": args.llamacpp_draft_tokens, "peer_modes": args.peer_modes,
                     "dataset": str(args.dataset),
                     "categories": args.category, "limit_per_category": args.limit_per_category,
                     "num_questions": len(records)},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "platform": platform.platform(), "cpu": cpu_isa.cpu_description(),
                        "cpu_level": cpu_isa.chosen().name, "wall_s": time.perf_counter() - started,
                        **({"llama_cpp": llamacpp_build()} if "llama.cpp" in engines else {})},
        "prompt_tokens_per_s": prompt_tps, "overall": overall, "ratios": ratios,
        "first_answers_against_outpace_plain": agrees, "categories": by_category,
        "questions": questions,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if prompt_tps:
        print(f"prompt processing, {args.prompt_tokens} tokens, tok/s: "
              + ", ".join(f"{name} {tps:.0f}" for name, tps in prompt_tps.items()))
    print(table(overall))
    print()
    print(category_table(by_category))
    print()
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    for n, a in agrees.items():
        print(f"{n}'s first answers: {a['equal_share']:.0%} equal to outpace's plain ones, "
              f"common prefix {a['mean_common_prefix']:.1f} tokens on average")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
