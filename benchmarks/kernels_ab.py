"""One recorded call of a model's decoder layers (cpu_kernels.DecoderStack: a decode step's or a
verify's) timed with this checkout's CPU kernels and another checkout's, or another level's, call by
call in one process.

    python benchmarks/kernels_ab.py --base ../base/src [--model smollm2-135m] [--tokens 1,5]
        [--min-position 150] [--calls 400] [--threads 2]
    OUTPACE_CPU_ISA=avx2_vnni python benchmarks/kernels_ab.py --base-level avx2 ...

A shared two-core machine drifts by 10-35% between runs, so two processes do not resolve a kernel
change of a few percent. Here the two builds alternate call by call over the same inputs, caches
and packed weights (cpu_kernels.using), so drift weighs on both alike. For each token count the
model answers a repetitive prompt (sized to reach --min-position), drafting (tokens - 1) n-gram
tokens a step (none for 1 token), and its first layers call of that many tokens whose positions
are all past --min-position is recorded. Both checkouts must share the packed formats and the
layer structure's layout: this compares kernels, not formats. --base-level builds the base (this
checkout, or --base's) at another instruction-set level than the one the kernels run at. Reported
per token count: each build's median and 10th-percentile milliseconds, base over this checkout, and
whether their outputs are the same bits.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from outpace.config import SamplingParams, SpecConfig
from outpace.kernels import cpu_build, cpu_isa, cpu_kernels
from outpace.llm import LLM

SENTENCE = "Write a long story about a dragon and a knight, repeat the knight's name often. "


def record(model: str, count: int, min_position: int) -> tuple | None:
    """(stack, args, kwargs) of the first layers call of `count` tokens whose positions are all past
    min_position, or None."""
    drafts = count - 1
    llm = LLM(model, max_num_seqs=1, calibrate=False,
              spec=SpecConfig(method="ngram", num_draft_tokens=drafts) if drafts else "none")
    recorded = []
    call = cpu_kernels.DecoderStack.__call__

    def recording(stack, *args, **kwargs):
        if not recorded and args[0].shape[0] == count and int(args[6].min()) > min_position:
            recorded.append((stack, [a.clone() if torch.is_tensor(a) and a.numel() < 1 << 20 else a for a in args],
                             kwargs))
        return call(stack, *args, **kwargs)

    cpu_kernels.DecoderStack.__call__ = recording
    try:
        prompt = SENTENCE * max(1, min_position // 20)
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True))
    finally:
        cpu_kernels.DecoderStack.__call__ = call
    return recorded[0] if recorded else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, help="the other checkout's src folder (default: this one)")
    parser.add_argument("--base-level", help="the base's instruction-set level (default: the one the kernels run at)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", default="1,5", help="token counts of the calls, comma-separated")
    parser.add_argument("--min-position", type=int, default=150)
    parser.add_argument("--calls", type=int, default=400, help="calls of each build a token count")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.base is None and args.base_level is None:
        parser.error("give --base, --base-level or both")
    source = args.base / "outpace" / "kernels" / "cpu_kernels.c" if args.base else cpu_build.SOURCE
    levels = {level.name: level for level in cpu_isa.runnable()}
    if args.base_level is not None and args.base_level not in levels:
        parser.error(f"--base-level {args.base_level}: this CPU runs {', '.join(levels)}")
    libraries = {"this": cpu_kernels.library_of(),
                 "base": cpu_kernels.library_of(source, levels.get(args.base_level))}
    base_level = args.base_level or cpu_kernels.level()
    print(f"threads {args.threads}; kernels at {cpu_kernels.level()}, base at {base_level}; {cpu_isa.cpu_description()}")
    for count in (int(t) for t in args.tokens.split(",")):
        recorded = record(args.model, count, args.min_position)
        if recorded is None:
            print(f"{count} tokens: no call past position {args.min_position} was recorded")
            continue
        stack, call_args, kwargs = recorded
        runs, outs = {"this": [], "base": []}, {}
        for i in range(args.calls):
            for name in ("this", "base") if i % 2 else ("base", "this"):
                with cpu_kernels.using(libraries[name]):
                    start = time.perf_counter()
                    out = stack(*call_args, **kwargs)
                    runs[name].append(time.perf_counter() - start)
                outs.setdefault(name, out[0] + out[1])
        ms = {name: (1e3 * statistics.median(times), 1e3 * statistics.quantiles(times, n=10)[0])
              for name, times in runs.items()}
        positions = call_args[6]
        print(f"{count} tokens at positions {int(positions.min())}-{int(positions.max())}: this {ms['this'][0]:.3f} ms "
              f"(p10 {ms['this'][1]:.3f}), base {ms['base'][0]:.3f} ms (p10 {ms['base'][1]:.3f}); base / this "
              f"{ms['base'][0] / ms['this'][0]:.3f} (p10 {ms['base'][1] / ms['this'][1]:.3f}); same bits: "
              f"{torch.equal(outs['this'], outs['base'])}", flush=True)


if __name__ == "__main__":
    main()
