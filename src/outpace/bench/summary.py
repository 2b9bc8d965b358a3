"""Per-category and overall figures of a Spec-Bench run, from its per-prompt records. Plain Python.

A record is one Spec-Bench question: {question_id, category, identical, turns: [turn, ...]}, and a
turn holds one speculative and one baseline run: {spec: run, baseline: run, identical, divergence}.
A run is {num_tokens, prefill_s, decode_s, spec: {num_verify_steps, num_draft_tokens,
num_accepted_tokens, draft_s, ...}} as LLM.chat reports them.
"""
from __future__ import annotations

from outpace.engine.sequence import add_lists

DEFINITIONS = {
    "tokens_per_s": "generated tokens / (prefill_s + decode_s), summed over the prompts of a group: "
                    "end-to-end throughput of one request at a time, prompt processing included",
    "decode_tokens_per_s": "(generated tokens - 1) / decode_s, summed over the prompts of a group: the "
                           "first token comes from the prefill, the rest from decoding",
    "speedup": "spec tokens_per_s / baseline tokens_per_s (decode_speedup: the same for decode_tokens_per_s)",
    "mean_acceptance_length": "(accepted draft tokens + verify steps) / verify steps of the speculative runs: "
                              "tokens gained per target forward, its own token included (vLLM/SGLang convention)",
    "acceptance_rate": "accepted draft tokens / drafted tokens of the speculative runs",
    "acceptance_by_position": "for draft position i (from 1): drafted tokens at i that were accepted / drafts that "
                              "reached i (a token is accepted only after every token before it was)",
    "identical_share": "greedy only: share of questions whose speculative output equals the baseline output token "
                       "for token in every turn (null when sampling)",
    "draft_time_share": "time spent drafting / (prefill_s + decode_s) of the speculative runs",
    "divergences": "greedy only: for each turn whose outputs part although its context was the same, the target's "
                   "top-2 logit margin at the first differing position (a near-tie, or a bug)",
}


def _side(runs: list[dict]) -> dict:
    num_tokens = sum(r["num_tokens"] for r in runs)
    total_s = sum(r["prefill_s"] + r["decode_s"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    decode_tokens = sum(max(r["num_tokens"] - 1, 0) for r in runs)
    return {
        "num_tokens": num_tokens,
        "total_s": total_s,
        "decode_s": decode_s,
        "tokens_per_s": num_tokens / total_s if total_s > 0 else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def summarize_group(records: list[dict]) -> dict:
    turns = [t for r in records for t in r["turns"]]
    spec_runs = [t["spec"] for t in turns]
    spec, base = _side(spec_runs), _side([t["baseline"] for t in turns])
    counters = {k: sum(r["spec"][k] for r in spec_runs)
                for k in ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens", "draft_s")}
    accepted, drafted = [], []
    for r in spec_runs:
        accepted = add_lists(accepted, r["spec"].get("accepted_per_position", []))
        drafted = add_lists(drafted, r["spec"].get("drafted_per_position", []))
    steps = counters["num_verify_steps"]
    judged = [r["identical"] for r in records if r["identical"] is not None]
    divergences = [t["divergence"] for t in turns if t.get("divergence")]
    margins = [d["top2_margin"] for d in divergences]
    return {
        "num_questions": len(records),
        "num_prompts": len(turns),
        "spec": spec,
        "baseline": base,
        "speedup": _ratio(spec["tokens_per_s"], base["tokens_per_s"]),
        "decode_speedup": _ratio(spec["decode_tokens_per_s"], base["decode_tokens_per_s"]),
        "mean_acceptance_length": (counters["num_accepted_tokens"] + steps) / steps if steps else None,
        "acceptance_rate": _ratio(counters["num_accepted_tokens"], counters["num_draft_tokens"]),
        "acceptance_by_position": [_ratio(a, d) for a, d in zip(accepted, drafted)],
        "drafted_by_position": drafted,
        "identical_share": sum(judged) / len(judged) if judged else None,
        "num_divergences": len(margins),
        "max_divergence_margin": max(margins) if margins else None,
        # the same in units of the dtype's spacing at the top logit: a few units is a rounding-level tie
        "max_divergence_margin_resolutions": max(d["top2_margin"] / d["logit_resolution"] for d in divergences)
                                             if divergences else None,
        "draft_time_share": _ratio(counters["draft_s"], spec["total_s"]),
    }


def summarize(records: list[dict]) -> dict:
    """{categories: {name: figures}, overall: figures}; categories in first-seen order."""
    by_category: dict[str, list[dict]] = {}
    for r in records:
        by_category.setdefault(r["category"], []).append(r)
    return {"categories": {c: summarize_group(rs) for c, rs in by_category.items()},
            "overall": summarize_group(records)}


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(summary: dict) -> str:
    header = ("| category | prompts | spec tok/s | plain tok/s | speedup | decode speedup | mean acc. len "
              "| acc. rate | identical | draft time |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    rows = list(summary["categories"].items()) + [("**overall**", summary["overall"])]
    for name, s in rows:
        lines.append(" | ".join([
            f"| {name}", str(s["num_prompts"]),
            _fmt(s["spec"]["tokens_per_s"], ".1f"), _fmt(s["baseline"]["tokens_per_s"], ".1f"),
            _fmt(s["speedup"], ".2f", "x"), _fmt(s["decode_speedup"], ".2f", "x"),
            _fmt(s["mean_acceptance_length"], ".2f"), _fmt(s["acceptance_rate"], ".0%"),
            _fmt(s["identical_share"], ".0%"), _fmt(s["draft_time_share"], ".1%"),
        ]) + " |")
    overall = summary["overall"]
    if overall.get("drafted_by_position"):
        lines.append("\nacceptance by draft position, overall (accepted / drafts that reached it): " + ", ".join(
            f"{i}: {_fmt(rate, '.0%')} of {n}"
            for i, (rate, n) in enumerate(zip(overall["acceptance_by_position"], overall["drafted_by_position"]), 1)))
    return "\n".join(lines)
