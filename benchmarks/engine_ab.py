"""One level of the serving benchmark in the engine, without HTTP: plain against speculative in
one process.

    python benchmarks/engine_ab.py --dataset ../shared/data/spec_bench_question.jsonl \
        --concurrency 32 --rounds 4
    python benchmarks/engine_ab.py --dataset ../shared/data/spec_bench_question.jsonl \
        --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct --ngram-first \
        --concurrency 16 --rounds 2 --max-tokens 96
    python benchmarks/engine_ab.py --dataset spec_bench_question.jsonl --device cuda --spec eagle3 --ngram-first \
        --concurrency 32 --rounds 2

One LLMEngine (n-gram speculation, a draft model with --draft-model, or an EAGLE-3 head with --spec
eagle3; as many slots as clients) runs the prompts serve_bench.py runs
at that concurrency (its level's place in `--concurrency 1 4 16 32`; chat template, greedy, 256
tokens at most, EOS honoured) as a closed loop: every request is queued at once and the next
joins as soon as one ends, as the benchmark's clients keep one request each in flight. Each round
runs both modes once, the order alternating between rounds, so the machine's drift weighs on both
alike; the controller keeps what it learned across rounds, as a server's does. To compare two
revisions of outpace, run this script in each through benchmarks/ab_revisions.py.

Per round and mode: output tokens/s and steps, and the steps split three ways: those that also
cached a prompt chunk, full steps (every slot decoding) and the level's tail (fewer rows), each
with its time and its drafted and accepted tokens. The speedups are each mode's tokens/s over the
plain run's of the same round, and over all rounds.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import first_turns  # noqa: E402

from outpace.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from outpace.engine.llm_engine import LLMEngine  # noqa: E402

STANDARD_LEVELS = [1, 4, 16, 32]        # serve_bench's default --concurrency: where its prompts start


class StepLog:
    """Wraps the engine's verify to record each step: rows, drafted, accepted, prompt tokens, seconds."""

    def __init__(self, engine: LLMEngine):
        self.steps: list[tuple[int, int, int, int, float]] = []
        verify = engine.steps.verify

        def timed(plan, proposal, chunks):
            t0 = time.perf_counter()
            result = verify(plan, proposal, chunks)
            rows = len(plan.decode)
            self.steps.append((rows, sum(result.num_draft), sum(result.counts) - rows,
                               sum(c.end - c.start for c in chunks), time.perf_counter() - t0))
            return result
        engine.steps.verify = timed

    def phases(self, slots: int) -> str:
        groups = {"prefill": [s for s in self.steps if s[3]], "full": [s for s in self.steps if not s[3] and s[0] == slots],
                  "tail": [s for s in self.steps if not s[3] and s[0] < slots]}
        return "; ".join(f"{name} {len(g)} steps {sum(s[4] for s in g):.2f} s, drafted {sum(s[1] for s in g)} "
                         f"accepted {sum(s[2] for s in g)}" for name, g in groups.items() if g)


def run_level(engine: LLMEngine, prompts: list[list[int]], speculate: bool, max_tokens: int):
    """Every prompt through the engine, its slots full while requests wait (the scheduler's queue
    admits the next as one ends); returns (output tokens/s, steps, outputs)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    seqs = [engine.add_request(ids, params, speculate=speculate) for ids in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    outputs = {i: seq.output_ids for i, seq in enumerate(seqs)}
    return sum(map(len, outputs.values())) / wall, steps, outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="split the model over N GPUs (or CPU processes)")
    p.add_argument("--spec", choices=["ngram", "eagle3"], default="ngram",
                   help="n-gram lookup (default) or an EAGLE-3 head; --draft-model makes it a draft model")
    p.add_argument("--draft-model", help="speculate with this draft model instead of n-gram lookup")
    p.add_argument("--draft-head", help="with --spec eagle3: the head's folder (default: the one that ships for the model)")
    p.add_argument("--ngram-first", action="store_true",
                   help="with --draft-model or --spec eagle3: n-gram lookup first, the model or head elsewhere")
    args = p.parse_args()
    if args.concurrency < 1 or args.rounds < 1:
        p.error("--concurrency and --rounds must be at least 1")
    if args.draft_model and args.spec == "eagle3":
        p.error("--draft-model and --spec eagle3 are two drafters: give one")
    if args.ngram_first and not (args.draft_model or args.spec == "eagle3"):
        p.error("--ngram-first goes with --draft-model or --spec eagle3")
    if args.draft_head and args.spec != "eagle3":
        p.error("--draft-head goes with --spec eagle3")
    if args.draft_model:
        spec = SpecConfig(method="draft", draft_model=args.draft_model, ngram_first=args.ngram_first)
    elif args.spec == "eagle3":
        spec = SpecConfig(method="eagle3", draft_head=args.draft_head, ngram_first=args.ngram_first)
    else:
        spec = SpecConfig(method="ngram")
    c = args.concurrency
    texts = first_turns(args.dataset)
    start = 7 * (STANDARD_LEVELS.index(c) if c in STANDARD_LEVELS else 0)
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=c, spec=spec, device=args.device,
                                    tensor_parallel_size=args.tensor_parallel_size,
                                    prefix_caching=False))       # both modes prefill each prompt whole: the one run second would find it cached
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": texts[(start + i) % len(texts)]}]),
                          add_special_tokens=False) for i in range(max(8, 2 * c))]
    modes = ["plain", "spec"]
    log = StepLog(engine)
    run_level(engine, prompts, True, args.max_tokens)        # untimed: first calls, and the controller warms
    rates: dict[str, list[float]] = {m: [] for m in modes}
    plain_outputs = None
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            log.steps.clear()
            rate, steps, outputs = run_level(engine, prompts, mode != "plain", args.max_tokens)
            rates[mode].append(rate)
            if mode == "plain":
                plain_outputs = plain_outputs or outputs
            elif plain_outputs is not None and outputs != plain_outputs:
                print(f"  {mode}: {sum(outputs[i] != plain_outputs[i] for i in outputs)} outputs differ from plain")
            print(f"round {r} {mode}: {rate:.1f} tok/s, {steps} steps ({log.phases(c)})", flush=True)
    each = ", ".join(f"{s / p:.3f}x" for p, s in zip(rates["plain"], rates["spec"]))
    print(f"spec / plain: {sum(rates['spec']) / sum(rates['plain']):.3f}x over {args.rounds} rounds ({each})")


if __name__ == "__main__":
    main()
