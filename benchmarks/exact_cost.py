"""What exact mode costs: decode tokens/s with and without --exact, plain and speculative, on the
first two Spec-Bench summarization questions (greedy, 128 tokens, EOS ignored), in one process."""
import argparse
import json

from outpace import LLM, SamplingParams, SpecConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="../shared/data/spec_bench_question.jsonl")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    records = [r for r in map(json.loads, open(args.dataset)) if r["category"] == "summarization"]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for name, spec in [("plain", SpecConfig(method="none")), ("plain --exact", SpecConfig(method="none", exact=True)),
                       ("ngram", SpecConfig()), ("ngram --exact", SpecConfig(exact=True))]:
        llm = LLM(spec=spec, max_num_seqs=1)
        outs = [llm.chat([{"role": "user", "content": r["turns"][0]}], params)[0]
                for r in records[:args.num_prompts]]
        tokens_per_s = sum(o.num_generated_tokens - 1 for o in outs) / sum(o.timing["decode_s"] for o in outs)
        print(f"{name}: {tokens_per_s:.1f} decode tokens/s", flush=True)


if __name__ == "__main__":
    main()
