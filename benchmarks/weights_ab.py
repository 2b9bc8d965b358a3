"""A GGUF's weights kept quantized against the same file's bf16 copy, plain and n-gram, on the CPU.

    python benchmarks/weights_ab.py --dataset ../shared/data/spec_bench_question.jsonl \
        --per-category 2 --max-tokens 128

Both engines (`weights="quantized"` and `weights="bf16"`, n-gram speculation) live in one
process; each Spec-Bench first turn (chat template, greedy, EOS honoured) runs in all four modes
(each engine plain and speculative), the order rotating from prompt to prompt so the machine's
drift weighs on every mode alike. tokens/s = generated tokens / request time (prefill and
decode), summed over the prompts. Reported: each mode's tokens/s, the ratios quantized / bf16
for plain and for n-gram, each engine's speedup over its own plain decoding, and how many
speculative outputs equal their engine's plain output.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import first_turns  # noqa: E402

import torch  # noqa: E402

from outpace import LLM, SamplingParams  # noqa: E402
from outpace.kernels import cpu_kernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--per-category", type=int, default=2, help="first turns a category (13 categories)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = first_turns(args.dataset)[:13 * args.per_category]
    engines = {w: LLM(args.model, spec="ngram", weights=w, device="cpu") for w in ("quantized", "bf16")}
    modes = [(w, s) for w in engines for s in (False, True)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tokens = {m: 0 for m in modes}
    seconds = {m: 0.0 for m in modes}
    outputs: dict = {m: [] for m in modes}
    for w, llm in engines.items():              # untimed: first calls, the controller's first steps
        llm.chat([{"role": "user", "content": texts[0]}], params)
    print(f"CPU kernel level {cpu_kernels.level()}, {torch.get_num_threads()} threads, {len(texts)} prompts",
          flush=True)
    for i, text in enumerate(texts):
        for w, speculate in modes[i % 4:] + modes[:i % 4]:
            t0 = time.perf_counter()
            out = engines[w].chat([{"role": "user", "content": text}], params, speculate=speculate)[0]
            seconds[(w, speculate)] += time.perf_counter() - t0
            tokens[(w, speculate)] += out.num_generated_tokens
            outputs[(w, speculate)].append(out.token_ids)
        print(f"prompt {i + 1}/{len(texts)}", file=sys.stderr, flush=True)
    rate = {m: tokens[m] / seconds[m] for m in modes}
    for w, s in modes:
        print(f"{w} {'n-gram' if s else 'plain'}: {rate[(w, s)]:.1f} tok/s")
    for w in engines:
        same = sum(a == b for a, b in zip(outputs[(w, False)], outputs[(w, True)]))
        print(f"{w}: n-gram / plain {rate[(w, True)] / rate[(w, False)]:.3f}x, {same} of {len(texts)} "
              f"speculative outputs equal plain")
    print(f"quantized / bf16: plain {rate[('quantized', False)] / rate[('bf16', False)]:.3f}x, "
          f"n-gram {rate[('quantized', True)] / rate[('bf16', True)]:.3f}x")


if __name__ == "__main__":
    main()
