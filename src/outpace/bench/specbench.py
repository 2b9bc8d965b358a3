"""`outpace bench`: Spec-Bench prompts, each run with speculation and without it in one engine.

Every prompt runs twice, speculative and plain (the baseline), alternating which goes first from
one prompt to the next so that slow drift of the machine (heat, other load) cancels. A multi-turn
question is two conversations, each built from its own run's earlier answers. Greedy pairs are
compared token for token; where they part, the target's top-2 logit margin there is recorded.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from outpace.bench.dataset import Record, load_spec_bench
from outpace.bench.margin import divergence
from outpace.bench.summary import DEFINITIONS, markdown_table, summarize
from outpace.cli import model_options, settle_heap
from outpace.config import SamplingParams, SpecConfig
from outpace.errors import OutpaceError, PromptTooLongError
from outpace.kernels import cpu_isa, cpu_kernels
from outpace.llm import LLM, RequestOutput

RUNS = ("spec", "baseline")


def _run(out: RequestOutput) -> dict:
    return {
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,     # of the prompt, reused from the conversation's last turn
        "num_tokens": out.num_generated_tokens,
        "prefill_s": out.timing["prefill_s"],
        "decode_s": out.timing["decode_s"],
        "finish_reason": out.finish_reason,
        "spec": out.spec,
        "text": out.text,
        "token_ids": out.token_ids,
    }


def run_question(llm: LLM, record: Record, params: SamplingParams, prompt_counter, on_prompt=None) -> dict:
    """Both conversations of one question; prompt_counter numbers prompts from 1 across the run:
    odd prompts run speculative first, even ones the baseline first."""
    history: dict[str, list[dict]] = {name: [] for name in RUNS}
    turns = []
    same_context = True             # both runs' conversations equal so far
    for index, user in enumerate(record.turns):
        number = next(prompt_counter)
        order = RUNS if number % 2 == 1 else RUNS[::-1]
        turn_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + number)
        outs: dict[str, RequestOutput] = {}
        for name in order:
            history[name].append({"role": "user", "content": user})
            # each run reuses the prefixes its own conversation left (its next turn's), never the other's
            outs[name] = llm.chat(history[name], turn_params, speculate=name == "spec", cache_salt=name)[0]
            history[name].append({"role": "assistant", "content": outs[name].text})
        spec, base = outs["spec"], outs["baseline"]
        identical = diverged = None
        if params.is_greedy and same_context:
            identical = spec.token_ids == base.token_ids
            if not identical:
                diverged = divergence(llm.engine, base.prompt_token_ids, spec.token_ids, base.token_ids)
            same_context = identical
        turns.append({"turn": index, "first": order[0], "spec": _run(spec), "baseline": _run(base),
                      "identical": identical, "divergence": diverged})
        if on_prompt is not None:
            on_prompt()
    judged = [t["identical"] for t in turns if t["identical"] is not None]
    return {"question_id": record.question_id, "category": record.category,
            "identical": all(judged) if judged else None, "turns": turns}


def run_bench(llm: LLM, records: list[Record], params: SamplingParams, progress: bool = True) -> tuple[list, list]:
    """(question records, skipped questions) of a whole run, with a progress bar over prompts."""
    counter = itertools.count(1)
    results, skipped = [], []
    bar = tqdm(total=sum(len(r.turns) for r in records), unit="prompt", desc="outpace bench", disable=not progress)
    try:
        for record in records:
            bar.set_postfix_str(record.category)
            try:
                results.append(run_question(llm, record, params, counter, on_prompt=lambda: bar.update(1)))
            except PromptTooLongError as e:
                skipped.append({"question_id": record.question_id, "category": record.category, "reason": str(e)})
                tqdm.write(f"outpace bench: skipped question {record.question_id}: {e}", file=sys.stderr)
    finally:
        bar.close()
    return results, skipped


def warm_up(llm: LLM, record: Record) -> None:
    """One short run of each kind, untimed: first calls allocate and pick kernels."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for speculate in (True, False):
        llm.chat([{"role": "user", "content": record.turns[0]}], params, speculate=speculate)


def environment(llm: LLM) -> dict:
    """What the figures depend on: a CPU's by its feature flags (cpu_isa.cpu_description) and the
    level its kernels ran at (None on a GPU, or where they are off), since a figure from one CPU
    is not a figure for another."""
    on_cpu = str(llm.engine.device) == "cpu"
    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
            "cpu": cpu_isa.cpu_description(), "cpu_kernels": cpu_kernels.level() if on_cpu else None,
            "device": llm.engine.device, "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "load_s": llm.engine.load_s, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def bench(llm: LLM, records: list[Record], params: SamplingParams, out_dir: str | Path, config: dict,
          chart: bool = True, progress: bool = True, repeat: int = 1) -> dict:
    """Run, then write results.json, results.md and speedup.png into out_dir; returns the results.
    repeat > 1: the questions run repeat - 1 times untimed first, so the timed run's requests
    repeat earlier ones (as retries, or a workload's fixed calls, do), each mode after its own."""
    if not records:
        raise OutpaceError("no records to run: check --category and --limit-per-category")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    warm_up(llm, records[0])
    for _ in range(repeat - 1):
        run_bench(llm, records, params, progress)
    started = time.perf_counter()
    questions, skipped = run_bench(llm, records, params, progress)
    if not questions:
        raise OutpaceError("every question was skipped (prompts too long): raise --max-model-len")
    summary = summarize(questions)
    results = {"config": {**config, "sampling": dataclasses.asdict(params), "environment": environment(llm),
                          "wall_s": time.perf_counter() - started},
               "definitions": DEFINITIONS, **summary, "skipped": skipped, "questions": questions}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(summary)
    (out_dir / "results.md").write_text(table + "\n")
    if chart:
        from outpace.bench.chart import speedup_chart
        try:
            speedup_chart(summary, out_dir / "speedup.png")
        except OutpaceError as e:
            print(f"outpace bench: {e}", file=sys.stderr)
    return results


def bench_command(args, spec: SpecConfig, params: SamplingParams) -> None:
    """The `outpace bench` subcommand, given its parsed arguments."""
    if not spec.enabled:
        raise OutpaceError("outpace bench compares speculation with plain decoding: use --spec ngram")
    if args.repeat < 1:
        raise OutpaceError(f"--repeat must be at least 1 (the timed run), got {args.repeat}")
    records = load_spec_bench(args.dataset, args.category, args.limit_per_category)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    # one request at a time, in two slots: each run's conversation keeps its own slot's prefix for its
    # next turn (with one, the run that goes second in a turn would evict the other's)
    llm = LLM(args.model, spec=spec, max_num_seqs=2, **model_options(args))
    settle_heap()
    config = {"command": " ".join(["outpace"] + sys.argv[1:]), "model": args.model, "dataset": str(args.dataset),
              "categories": args.category, "limit_per_category": args.limit_per_category, "repeat": args.repeat,
              "spec": dataclasses.asdict(spec)}
    results = bench(llm, records, params, args.out, config, progress=not args.quiet, repeat=args.repeat)
    print(markdown_table(results))
    overall = results["overall"]
    if overall["num_divergences"]:
        print(f"\n{overall['num_divergences']} greedy divergence(s); largest top-2 logit margin at the first "
              f"differing token: {overall['max_divergence_margin']:.4g}, "
              f"{overall['max_divergence_margin_resolutions']:.3g}x the {results['config']['environment']['dtype']} "
              "spacing at that logit (see results.json)")
    print(f"\nwritten: {Path(args.out) / 'results.json'}, results.md, speedup.png")
