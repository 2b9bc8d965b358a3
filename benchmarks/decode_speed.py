"""Plain greedy decode speed: outpace against Hugging Face transformers on the same model.

Batch 1, the same prompts (Spec-Bench first turns through the chat template, the same token ids
for both engines), 256 new tokens with EOS ignored on both sides (transformers: min_new_tokens,
outpace: ignore_eos), the same dtype, torch using every core. transformers loads the very GGUF
file that outpace converts. The engines alternate prompt by prompt, so drift of the machine
touches both alike.

    python benchmarks/decode_speed.py                                   # CPU: float32 and bfloat16
    python benchmarks/decode_speed.py --device cuda --dtypes bfloat16 --random-8b   # GPU, adds 8B shape

decode tokens/s = (new tokens - 1) / time from the first new token to the last;
end-to-end tokens/s = new tokens / (prefill + decode time).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from outpace.bench.dataset import load_spec_bench
from outpace.bench.models import gguf_file, random_llama3_8b
from outpace.bench.peers import OutpaceEngine, TransformersEngine, load_transformers
from outpace.llm import LLM

DATASET = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl"


def pick_prompts(dataset: Path, num_prompts: int) -> list[str]:
    """The first turn of the first question of each category, categories in file order."""
    firsts: dict[str, str] = {}
    for record in load_spec_bench(dataset):
        firsts.setdefault(record.category, record.turns[0])
    return list(firsts.values())[:num_prompts]


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["num_tokens"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    total_s = sum(r["prefill_s"] + r["decode_s"] for r in runs)
    return {"num_tokens": tokens, "decode_s": decode_s, "total_s": total_s,
            "decode_tokens_per_s": sum(r["num_tokens"] - 1 for r in runs) / decode_s,
            "tokens_per_s": tokens / total_s}


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def measure(label: str, model: str, dtype: str, args, prompts: list[str]) -> dict:
    """One model in one dtype: both engines, alternating, on every prompt."""
    hf_source = gguf_file(model) or Path(model)
    extra = {"cuda_graphs": False} if args.no_cuda_graphs else {}
    llm = LLM(model, spec="none", dtype=dtype, device=args.device, max_num_seqs=1, max_model_len=args.max_model_len,
              weights=args.weights, prefix_caching=False, **extra)    # every round's prompt prefilled whole
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in prompts]
    eos = sorted(set(llm.engine.model.cfg.eos_token_ids) | set(tok.eos_token_ids))
    t0 = time.perf_counter()
    hf = load_transformers(hf_source, llm.engine.dtype, llm.engine.device)
    engines = {"outpace": OutpaceEngine(llm, speculate=False), "transformers": TransformersEngine(hf, eos)}
    print(f"[{label} {dtype}] transformers loaded from {hf_source} in {time.perf_counter() - t0:.1f}s; "
          f"outpace in {llm.engine.load_s:.1f}s", file=sys.stderr)
    for engine in engines.values():     # untimed, full length: first calls allocate, clocks ramp up
        engine.generate(ids[0], args.max_tokens, ignore_eos=True)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for i, prompt in enumerate(ids):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            runs[name].append(engines[name].generate(prompt, args.max_tokens, ignore_eos=True).as_dict())
        print(f"[{label} {dtype}] prompt {i + 1}/{len(ids)}: " + ", ".join(
            f"{n} {(r[-1]['num_tokens'] - 1) / r[-1]['decode_s']:.1f} tok/s" for n, r in runs.items()), file=sys.stderr)
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(runs["outpace"], runs["transformers"])]
    summary = {name: summarize(r) for name, r in runs.items()}
    result = {
        "model": label, "dtype": str(llm.engine.dtype).removeprefix("torch."), "device": llm.engine.device,
        "outpace_options": extra, "outpace_weights": args.weights,
        "engines": summary,
        "decode_ratio": summary["outpace"]["decode_tokens_per_s"] / summary["transformers"]["decode_tokens_per_s"],
        "end_to_end_ratio": summary["outpace"]["tokens_per_s"] / summary["transformers"]["tokens_per_s"],
        "identical_share": sum(same) / len(same),
        "prompts": [{"num_prompt_tokens": len(p), **{n: runs[n][i] for n in runs}} for i, p in enumerate(ids)],
    }
    del llm, hf, engines
    _release(args.device)
    return result


def table(results: list[dict]) -> str:
    lines = ["| model | dtype | device | outpace decode tok/s | transformers decode tok/s | ratio "
             "| outpace e2e tok/s | transformers e2e tok/s | ratio | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        o, t = r["engines"]["outpace"], r["engines"]["transformers"]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['device']} | {o['decode_tokens_per_s']:.1f} "
                     f"| {t['decode_tokens_per_s']:.1f} | {r['decode_ratio']:.2f}x | {o['tokens_per_s']:.1f} "
                     f"| {t['tokens_per_s']:.1f} | {r['end_to_end_ratio']:.2f}x | {r['identical_share']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or Hugging Face folder")
    p.add_argument("--random-8b", action="store_true",
                   help="also a random-weight model of Llama-3-8B's shape (bfloat16, about 16 GB; built once "
                        "into the outpace cache, on --device)")
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="with --random-8b: folder with tokenizer.json and tokenizer_config.json (default: the "
                        "default model's)")
    p.add_argument("--no-default", action="store_true", help="with --random-8b: skip --model")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--weights", default="auto",
                   help="outpace's weights: auto (a GGUF stays quantized on the CPU), quantized, bf16 or fp32 "
                        "(fp32 with --dtypes float32: the same weights as transformers')")
    p.add_argument("--dataset", type=Path, default=DATASET, help="Spec-Bench JSONL for the prompts")
    p.add_argument("--num-prompts", type=int, default=3, help="prompts (one per category, default 3)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt, EOS ignored (default 256)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-cuda-graphs", action="store_true", help="outpace on CUDA: eager steps, no graph replay")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--out", type=Path, default=Path("bench-out/decode_speed.json"))
    args = p.parse_args()

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    prompts = pick_prompts(args.dataset, args.num_prompts)
    models = [] if args.no_default else [(args.model, args.model)]
    if args.random_8b:
        t0 = time.perf_counter()
        folder = random_llama3_8b(device=args.device, tokenizer_from=args.tokenizer_from)
        print(f"random Llama-3-8B shape at {folder} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
        models.append(("random-llama3-8b", str(folder)))
    results = [measure(label, model, dtype, args, prompts) for label, model in models for dtype in args.dtypes]

    report = {"environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "cpu_count": os.cpu_count(), "platform": platform.platform(),
                              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                              "transformers": __import__("transformers").__version__},
              "settings": {"max_tokens": args.max_tokens, "num_prompts": len(prompts), "batch_size": 1,
                           "ignore_eos": True, "greedy": True},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(results))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
