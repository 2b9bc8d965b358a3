"""`outpace bench` bookkeeping: what results.json holds is computed from the runs it made; and
the scripts in benchmarks/ run in small forms, their figures measured.

A tiny random model keeps the end-to-end run to seconds; a fake LLM checks the conversation
logic (alternation, each run's own earlier answers, divergence only where contexts match).
"""
import argparse
import copy
import gc
import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from outpace import LLM, SamplingParams
from outpace.bench import specbench
from outpace.bench.dataset import Record, load_spec_bench
from outpace.bench.margin import divergence, first_difference
from outpace.bench.summary import summarize
from outpace.cli import main
from outpace.kernels import cpu_isa, cpu_kernels
from outpace.llm import RequestOutput
from tiny import make_tiny

RECORDS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now one about snow."]},
    {"question_id": 2, "category": "summarization", "turns": ["Summarize: the cat sat on the mat. The cat sat."]},
    {"question_id": 3, "category": "summarization", "turns": ["Summarize: dogs bark."]},
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-bench")
    make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float32)
    return folder


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    """script(name, *argv): benchmarks/<name>.py imported as a module, sys.argv set as its command
    line would set it (its main() then parses them)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    def load(name: str, *argv: str):
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        return importlib.import_module(name)
    return load


def test_dataset_filters_and_limits(dataset):
    assert [r.question_id for r in load_spec_bench(dataset)] == [1, 2, 3]
    assert [r.question_id for r in load_spec_bench(dataset, ["summarization"], 1)] == [2]
    with pytest.raises(ValueError, match="no records of categories"):
        load_spec_bench(dataset, ["poetry"])


def test_bench_results_are_computed_from_the_runs(tiny_folder, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    gc.unfreeze()
    main(["bench", "--dataset", str(dataset), "--limit-per-category", "1", "--max-tokens", "8",
          "--model", str(tiny_folder), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
          "--num-draft-tokens", "4", "--out", str(out), "--quiet"])
    results = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text().strip() in capsys.readouterr().out
    assert (out / "speedup.png").stat().st_size > 0
    assert gc.get_freeze_count() > 0            # the loaded engine left the collector's sweeps
    assert set(results["categories"]) == {"writing", "summarization"}
    assert {"config", "definitions", "overall", "questions", "skipped"} <= set(results)
    environment = results["config"]["environment"]      # what a CPU figure depends on
    assert environment["cpu"] == cpu_isa.cpu_description() and environment["cpu_kernels"] == cpu_kernels.level()

    questions = results["questions"]
    assert [q["question_id"] for q in questions] == [1, 2]
    turns = [t for q in questions for t in q["turns"]]
    assert len(turns) == results["overall"]["num_prompts"] == 3
    # alternation: prompt 1 speculative first, prompt 2 baseline first, prompt 3 speculative first
    assert [t["first"] for t in turns] == ["spec", "baseline", "spec"]
    for t in turns:
        for run in (t["spec"], t["baseline"]):
            assert 1 <= run["num_tokens"] == len(run["token_ids"]) <= 8
            assert run["prefill_s"] > 0 and run["decode_s"] >= 0
        assert t["baseline"]["spec"]["num_draft_tokens"] == 0, "the baseline must not speculate"
    # both runs' second turns start from their own first turn's keys, whichever run goes first
    assert turns[1]["spec"]["num_cached_tokens"] > 0 and turns[1]["baseline"]["num_cached_tokens"] > 0

    overall = results["overall"]
    for side in ("spec", "baseline"):
        runs = [t[side] for t in turns]
        tokens = sum(r["num_tokens"] for r in runs)
        seconds = sum(r["prefill_s"] + r["decode_s"] for r in runs)
        assert overall[side]["num_tokens"] == tokens
        assert overall[side]["tokens_per_s"] == pytest.approx(tokens / seconds)
    assert overall["speedup"] == pytest.approx(overall["spec"]["tokens_per_s"] / overall["baseline"]["tokens_per_s"])
    same = [all(t["spec"]["token_ids"] == t["baseline"]["token_ids"] for t in q["turns"]) for q in questions]
    assert overall["identical_share"] == pytest.approx(sum(same) / len(same))
    drafted = sum(t["spec"]["spec"]["num_draft_tokens"] for t in turns)
    accepted = sum(t["spec"]["spec"]["num_accepted_tokens"] for t in turns)
    assert overall["acceptance_rate"] == (accepted / drafted if drafted else None)

    # the summary follows the records: slow the baseline down, break one question's identity
    changed = copy.deepcopy(questions)
    for t in changed[0]["turns"]:
        t["baseline"]["decode_s"] += 10.0
    changed[0]["identical"] = False
    again = summarize(changed)["overall"]
    assert again["speedup"] > overall["speedup"]
    assert again["identical_share"] == pytest.approx((sum(same) - same[0]) / 2)


def test_bench_repeat_times_requests_that_repeat_earlier_ones(tiny_folder, dataset, tmp_path, capsys):
    """--repeat 2 times a second run of the questions, whose speculative requests repeat the
    first run's: n-gram lookup's memory (--lookup-memory) drafts their answers, so nearly every
    step accepts its whole draft, where a single run's steps do not."""
    rates = {}
    for repeat in (1, 2):
        out = tmp_path / f"out{repeat}"
        main(["bench", "--dataset", str(dataset), "--max-tokens", "24", "--model", str(tiny_folder),
              "--dtype", "float32", "--device", "cpu", "--max-model-len", "256", "--num-draft-tokens", "4",
              "--lookup-memory", "65536", "--repeat", str(repeat), "--out", str(out), "--quiet"])
        results = json.loads((out / "results.json").read_text())
        assert results["config"]["repeat"] == repeat and results["overall"]["num_prompts"] == 4
        rates[repeat] = results["overall"]["acceptance_rate"]
    assert rates[2] > 0.9 > rates[1]
    with pytest.raises(SystemExit):
        main(["bench", "--dataset", str(dataset), "--model", str(tiny_folder), "--repeat", "0"])
    assert "--repeat must be at least 1" in capsys.readouterr().err


def test_acceptance_by_position_counts_the_drafts_that_reached_it():
    from outpace.engine.sequence import SpecStats
    a, b = SpecStats(), SpecStats()
    a.record(3, 1)          # positions 1-3 drafted, 1 accepted
    a.record(1, 1)
    a.record(0, 0)          # a step without a draft reaches no position
    b.record(2, 2)
    assert a.drafted_per_position == [2, 1, 1] and a.accepted_per_position == [2, 0, 0]
    runs = [{"num_tokens": 4, "prefill_s": 0.1, "decode_s": 0.1, "spec": s.as_dict()} for s in (a, b)]
    record = {"question_id": 1, "category": "c", "identical": True,
              "turns": [{"spec": r, "baseline": {**r, "spec": SpecStats().as_dict()}} for r in runs]}
    overall = summarize([record])["overall"]
    assert overall["drafted_by_position"] == [3, 2, 1]
    assert overall["acceptance_by_position"] == [1.0, 0.5, 0.0]
    a.add(b)
    assert a.drafted_per_position == [3, 2, 1] and a.accepted_per_position == [3, 1, 0]


class FakeLLM:
    """Answers 'spec N' or 'plain N' by run and turn; the speculative run departs at `spec_departs`."""

    engine = None

    def __init__(self, spec_departs: int):
        self.spec_departs = spec_departs
        self.calls = []
        self.salts = set()

    def chat(self, messages, params, speculate, cache_salt):
        self.calls.append((speculate, [m["content"] for m in messages]))
        self.salts.add((speculate, cache_salt))
        turn = len(messages) // 2
        ids = [5, 6, 7] if speculate and turn >= self.spec_departs else [5, 6, 8]
        text = f"{'spec' if speculate else 'plain'} {turn}"
        timing = {"prefill_s": 0.1, "decode_s": 0.2}
        return [RequestOutput(None, [1, 2], text, ids, "length", timing, {})]


@pytest.mark.parametrize("spec_departs", [0, 1, 2])
def test_conversations_use_their_own_answers(monkeypatch, spec_departs):
    calls = []
    monkeypatch.setattr(specbench, "divergence", lambda engine, p, s, b: calls.append((s, b)) or {"top2_margin": 0.0})
    llm = FakeLLM(spec_departs)
    record = Record(7, "writing", ("first?", "second?"))
    counter = iter(range(2, 10))                 # prompts 2 and 3: baseline first, then speculative first
    q = specbench.run_question(llm, record, SamplingParams(temperature=0, max_tokens=3), counter)
    assert [speculate for speculate, _ in llm.calls] == [False, True, True, False]
    # each run reuses only its own conversation's cached prefixes
    assert llm.salts == {(True, "spec"), (False, "baseline")}
    second_turn = {speculate: contents for speculate, contents in llm.calls[2:]}
    assert second_turn[True] == ["first?", "spec 0", "second?"]
    assert second_turn[False] == ["first?", "plain 0", "second?"]
    # compared only while both conversations were equal; margins only at the first departure
    expected = {0: [False, None], 1: [True, False], 2: [True, True]}[spec_departs]
    assert [t["identical"] for t in q["turns"]] == expected
    assert q["identical"] == (spec_departs == 2)
    assert len(calls) == (spec_departs < 2)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_divergence_margin_is_the_targets_view(tiny_folder):
    """At a fabricated departure the baseline's token is the target's argmax and the margin is its lead."""
    llm = LLM(str(tiny_folder), spec="ngram", dtype="float32", device="cpu", max_model_len=256,
              max_num_seqs=1, calibrate=False)
    base = llm.generate([3, 14, 15, 92, 65], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        speculate=False)[0]
    spec_ids = list(base.token_ids)
    spec_ids[3] = (spec_ids[3] + 1) % 49152
    d = divergence(llm.engine, base.prompt_token_ids, spec_ids, base.token_ids)
    assert d["position"] == 3 and d["baseline_token"] == base.token_ids[3] == d["top1_token"]
    assert d["baseline_token_rank"] == 1 and d["spec_token_rank"] > 1
    assert d["top2_margin"] > 0 and d["baseline_logit"] - d["spec_logit"] >= d["top2_margin"] - 1e-6
    assert divergence(llm.engine, base.prompt_token_ids, base.token_ids, base.token_ids) is None
    assert llm.engine.scheduler.free_slots == [0], "the margin's forward must not take a slot"


def test_engine_ab_runs_speculation_against_plain(tiny_folder, dataset, script, capsys):
    """benchmarks/engine_ab.py: speculation's speedup over the plain run of the same rounds, with
    the same greedy outputs in both modes."""
    script("engine_ab", "--dataset", str(dataset), "--model", str(tiny_folder), "--concurrency", "2", "--rounds", "2",
           "--max-tokens", "8").main()
    out = capsys.readouterr().out
    assert "differ" not in out
    assert out.count("round 0 ") == out.count("round 1 ") == 2
    assert "spec / plain:" in out


def test_ab_revisions_runs_a_command_in_both_revisions(script, monkeypatch, capsys):
    """benchmarks/ab_revisions.py: the command runs in a worktree of each revision, alternately,
    and the metric comes from each run's own stdout."""
    # the metric: 1 when the run imported the outpace of its own folder (its revision's src/)
    probe = [sys.executable, "-c",
             "import outpace, os; print('own', int(os.path.realpath(outpace.__file__).startswith(os.getcwd())))"]
    ab_revisions = script("ab_revisions", "--base", "HEAD", "--rounds", "2", "--metric", "own ([0-9]+)", "--", *probe)
    ab_revisions.main()
    out = capsys.readouterr().out
    assert out.count("base 1, head 1,") == 2 and "head / base: 1.000x" in out
    monkeypatch.setattr(sys, "argv", ["ab_revisions.py", "--base", "no-such-revision", "--metric", "x", "--", "true"])
    with pytest.raises(SystemExit, match="cannot check out no-such-revision"):
        ab_revisions.main()


@pytest.mark.parametrize("turns", ["first", "all"])
def test_head_acceptance_counts_every_category(tmp_path, dataset, default_model_dir, script, capsys, turns):
    """benchmarks/head_acceptance.py on a tiny target and a random head: a row per category and
    overall (and with --turns all per turn), the overall's positions those of the categories and
    of the turns, a first draft right at no more positions than drafts accepted in a row (each
    right first draft is one of them); by the lookup's match length, the same positions split,
    and the same bound for each drafter. With --tree-nodes, the chain of --steps (7) accepts what
    the overall's drafts accepted in a row, a chain of 1 what its first drafts got right, and the
    best static tree of N nodes never less than the chain of N nor than a smaller tree."""
    from heads import target_config, write_eagle3_head

    target, head = tmp_path / "target", tmp_path / "head"
    make_tiny("llama-4-layers", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float32)
    write_eagle3_head(head, target_config(target), layer_ids=(1, 2, 4), dtype=torch.float32)
    out = tmp_path / "acceptance.json"
    script("head_acceptance", "--dataset", str(dataset), "--model", str(target), "--draft-head", str(head),
           "--max-tokens", "12", "--out", str(out), "--turns", turns, "--tree-nodes", "1", "2", "7", "9").main()
    results = json.loads(out.read_text())[str(head)]
    figures, by_match = results["by_category"], results["by_match"]
    by_turn = {"turn 1", "turn 2"} if turns == "all" else set()
    assert set(figures) == {"writing", "summarization", "overall"} | by_turn
    assert figures["overall"]["positions"] == figures["writing"]["positions"] + figures["summarization"]["positions"] > 0
    if turns == "all":
        assert figures["overall"]["positions"] == figures["turn 1"]["positions"] + figures["turn 2"]["positions"]
        assert figures["turn 2"]["positions"] > 0
    for f in figures.values():
        assert 0 <= f["first_right"] <= f["mean_accepted"]
    assert by_match["all"]["positions"] == figures["overall"]["positions"]
    assert sum(row["positions"] for m, row in by_match.items() if m != "all") == by_match["all"]["positions"]
    assert by_match.get("0", {"ngram_accepted": 0})["ngram_accepted"] == 0
    for row in by_match.values():
        assert 0 <= row["ngram_first_right"] <= row["ngram_accepted"] and 0 <= row["head_first_right"] <= row["head_accepted"]
    assert by_match["all"]["head_accepted"] == pytest.approx(figures["overall"]["mean_accepted"])
    trees = {row["nodes"]: row for row in results["trees"]}
    assert trees[7]["chain"] == pytest.approx(figures["overall"]["mean_accepted"]) and trees[9]["chain"] is None
    assert trees[1]["chain"] == trees[1]["tree"] == pytest.approx(figures["overall"]["first_right"])
    assert all(trees[n]["tree"] >= trees[n]["chain"] for n in (1, 2, 7))
    assert trees[1]["tree"] <= trees[2]["tree"] <= trees[7]["tree"] <= trees[9]["tree"]
    printed = capsys.readouterr().out
    assert "| overall |" in printed and "| all |" in printed and "static token trees" in printed


def test_controller_costs_times_the_same_decisions_alike(script, capsys):
    """benchmarks/controller_costs.py with this checkout's controller as its own baseline: both
    take the same decisions (one digest) and each step's time is measured. Regression: the script
    called pays_setup without the sequence it asks for (a TypeError since 7186494)."""
    script("controller_costs", "--rows", "4", "--steps", "40", "--repeats", "1", "--baseline",
           str(BENCHMARKS.parent / "src")).main()
    line = capsys.readouterr().out.strip()
    times = re.findall(r"(\S+) us a step \(decisions (\w+)\)", line)
    assert line.startswith("4 rows: this ") and len(times) == 2
    assert times[0][1] == times[1][1] and all(float(t) > 0 for t, _ in times)


def test_draft_costs_prints_both_tables(tmp_path, default_model_dir, script, capsys):
    """benchmarks/draft_costs.py on a tiny target drafted by itself: the calibrated costs by batch
    size and the timed proposes, a row for each calibrated bucket in each table. Regression: its
    proposes' sequences are not the engine's, and since prefix caching the draft model's first
    write asked the engine for theirs (KeyError)."""
    target = tmp_path / "target"
    make_tiny("llama", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float32)
    script("draft_costs", "--model", str(target), "--draft-model", str(target), "--draft-vocab", "0",
           "--num-draft-tokens", "2", "--max-num-seqs", "2", "--ks", "1", "2").main()
    tables = capsys.readouterr().out.split("| rows |")[1:]     # each table: its header's rest, its rule, its rows
    assert len(tables) == 2
    for table in tables:
        rows = [row.strip("|").split("|") for row in table.strip().splitlines()[2:]]
        assert [int(row[0]) for row in rows] == [1, 2]
        # a calibration that a busy machine stalled (a forward of 0.1 s) rounds a best case to 0.00x
        values = [float(cell.strip().rstrip("x")) for row in rows for cell in row[1:]]
        assert all(math.isfinite(v) and v >= 0 for v in values) and float(rows[0][1]) > 0


@pytest.mark.parametrize("tree_width", [1, 3])
def test_head_costs_times_every_drafting_step(tmp_path, dataset, default_model_dir, script, capsys, tree_width):
    """benchmarks/head_costs.py on a tiny target and a random head: the uncalibrated controller
    drafts the asked tokens (chains, or trees of that many nodes) at every step (a random head's
    drafts are rarely right, so a controller that priced them would stop), every output equals
    plain, and each figure it prints was measured."""
    from heads import target_config, write_eagle3_head

    target, head = tmp_path / "target", tmp_path / "head"
    make_tiny("llama-4-layers", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float32)
    write_eagle3_head(head, target_config(target), layer_ids=(1, 2, 4), dtype=torch.float32)
    script("head_costs", "--dataset", str(dataset), "--model", str(target), "--draft-head", str(head), "--max-tokens",
           "10", "--num-draft-tokens", "3", "--tree-width", str(tree_width), "--weights", "fp32").main()
    out = capsys.readouterr().out
    assert ("trees of width 3" if tree_width == 3 else "(chains)") in out
    prompts = int(out.split(" prompts")[0])
    assert f"{prompts} of {prompts} outputs equal plain" in out
    calls = int(out.split(" median over ")[1].split(" calls")[0])
    drafted = int(out.split(" of ")[-1].split(" drafted tokens")[0])
    # three drafted at every step but where the room left in max_tokens is less
    assert calls > 0 and 2 * calls < drafted <= 3 * calls
    accepted = int(out.split("accepted ")[-1].split(" of ")[0])
    steps = int(out.split(" over ")[-1].split(" verify steps")[0])
    assert steps >= calls and f"mean acceptance length {(accepted + steps) / steps:.2f}" in out



def test_spec_variants_runs_each_variant_against_plain(tmp_path, dataset, default_model_dir, script, capsys):
    """benchmarks/spec_variants.py on a tiny target and a random head: a row per variant, each
    variant's SpecConfig fields set on its own engine (p_min here), every output equal to plain's."""
    from heads import target_config, write_eagle3_head

    target, head = tmp_path / "target", tmp_path / "head"
    make_tiny("llama-4-layers", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float32)
    write_eagle3_head(head, target_config(target), layer_ids=(1, 2, 4), dtype=torch.float32)
    module = script("spec_variants", "--dataset", str(dataset), "--model", str(target), "--variant",
                    f"draft_head='{head}',p_min=0", "--variant", f"draft_head='{head}',p_min=0.5",
                    "--limit-per-category", "1", "--max-tokens", "6", "--rounds", "2")
    assert module.variant("p_min=0.5,num_draft_tokens=3") == {"p_min": 0.5, "num_draft_tokens": 3}
    with pytest.raises(argparse.ArgumentTypeError):
        module.variant("p_min")
    module.main()
    out = capsys.readouterr().out
    prompts = 2 * len({r["category"] for r in RECORDS})
    rows = [line for line in out.splitlines() if line.startswith(f"| draft_head={head},p_min=")]
    assert len(rows) == 2 and all(row.endswith(f"| {prompts} of {prompts} |") for row in rows)
    assert out.count("round 0: plain ") == out.count("round 1: plain ") == 1

def test_transformers_assisted_generation_is_a_peer(tiny_folder):
    """benchmarks/spec_peers.py with --spec draft runs transformers' assisted generation (its
    assistant_model) as the peer's speculative mode: with the target as its own assistant every
    draft is its own pick, and greedy output equals its plain generate's."""
    from outpace.bench.peers import TransformersEngine, load_transformers

    hf = load_transformers(tiny_folder, torch.float32, "cpu")
    assistant = load_transformers(tiny_folder, torch.float32, "cpu")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    plain = TransformersEngine(hf, [0]).generate(prompt, 12, ignore_eos=True)
    assisted = TransformersEngine(hf, [0], assistant=assistant).generate(prompt, 12, ignore_eos=True)
    assert assisted.token_ids == plain.token_ids and len(plain.token_ids) == 12
    assert assisted.prefill_s > 0 and assisted.decode_s > 0


def test_llamacpp_model_draft_drafts_its_tokens_from_the_whole_sequence():
    """llama.cpp's draft-model hook: the second Llama gets the sequence's ids with its prefix reuse
    on (reset=True) and is stopped after num_tokens greedy tokens."""
    import numpy as np

    from outpace.bench.peers import LlamaCppModelDraft

    class Fake:
        def generate(self, tokens, temp, top_k, reset, **kwargs):
            self.seen = (tokens, temp, top_k, reset)
            yield from range(100, 200)

    fake = Fake()
    drafted = LlamaCppModelDraft(fake, 3)(np.array([5, 6, 7], dtype=np.intc))
    assert drafted.tolist() == [100, 101, 102] and drafted.dtype == np.intc
    assert fake.seen == ([5, 6, 7], 0.0, 1, True)


def test_gpu_run_shape_section_runs_on_the_cpu(tmp_path, default_model_dir, script, monkeypatch, capsys):
    """benchmarks/gpu_run.py's section on a random model of a given shape (Llama-3-8B's on a GPU), in
    a tiny shape on the CPU: the engine loads the random model through the script's loader, and
    decode, verification and transformers' rates are measured. Regression: the script's loader
    took four of the six arguments the engine passes load_model (a TypeError since 2026-11-28,
    found on a GPU a week later)."""
    import argparse

    gpu_run = script("gpu_run")
    tiny = dict(gpu_run.SMOKE_SHAPE, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(gpu_run, "SMOKE_SHAPE", tiny)
    monkeypatch.setattr(gpu_run, "VERIFY_K", list(range(9)))     # the 8B target reads k = 8
    monkeypatch.setattr(gpu_run, "VERIFY_BATCHES", [1, 2])
    monkeypatch.setattr(gpu_run, "results", {"checks": {}, "targets": {}, "copy_bandwidth_Bps": 1e10})
    args = argparse.Namespace(device="cpu", smoke=True, quick=True, scratch=str(tmp_path))
    gpu_run.llama3_shape(args, default_model_dir, list(range(20, 40)))
    out = gpu_run.results["llama3_8b_shape"]
    assert out["outpace_graphs_tokens_per_s"] > 0 and out["outpace_eager_tokens_per_s"] > 0
    assert out["transformers_tokens_per_s"] > 0 and out["verify"]["ratio"]["1"][0] == 1.0
    assert len(gpu_run.results["targets"]) == 3
    assert "Plain decode, batch 1, bf16, random Llama-3-8B shape" in capsys.readouterr().out


def test_exact_cost_times_each_mode(dataset, default_model_dir, script, capsys):
    """benchmarks/exact_cost.py in a small form: a decode rate for plain and n-gram decoding, each
    with and without exact mode, on the dataset's summarization questions."""
    script("exact_cost", "--dataset", str(dataset), "--num-prompts", "1", "--max-tokens", "8").main()
    rates = re.findall(r"^(.+): (\S+) decode tokens/s$", capsys.readouterr().out, re.M)
    assert [name for name, _ in rates] == ["plain", "plain --exact", "ngram", "ngram --exact"]
    assert all(float(rate) > 0 for _, rate in rates)


def test_first_requests_times_both_rounds(default_model_dir, script, capsys):
    """benchmarks/first_requests.py in a small form: a fresh engine's first requests, then as many
    more, each round's seconds printed."""
    script("first_requests", "--requests", "2", "--max-tokens", "2").main()
    rounds = re.findall(r"^(first|next) 2 requests: (\S+) s$", capsys.readouterr().out, re.M)
    assert [name for name, _ in rounds] == ["first", "next"] and all(float(s) > 0 for _, s in rounds)


def test_weights_ab_runs_every_mode_and_compares_outputs(dataset, default_model_dir, script, capsys):
    """benchmarks/weights_ab.py in a small form: the default model's quantized and bf16 engines,
    each plain and with n-gram drafting, and every speculative output equal to its engine's plain
    one (greedy)."""
    script("weights_ab", "--dataset", str(dataset), "--per-category", "1", "--max-tokens", "8").main()
    out = capsys.readouterr().out
    assert len(re.findall(r"^(quantized|bf16) (plain|n-gram): \S+ tok/s$", out, re.M)) == 4
    assert len(re.findall(r"^(quantized|bf16): n-gram / plain \S+x, 3 of 3 speculative outputs equal plain$",
                          out, re.M)) == 2
    assert re.search(r"^quantized / bf16: plain \S+x, n-gram \S+x$", out, re.M)


def _run_script(name: str, *args: str, timeout: float = 300) -> str:
    """A benchmark script run in a process of its own (it may set the kernels' level or serve a port):
    its standard output; the test fails with its error output's end where it fails."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_tp_bench_smoke_measures_both_sizes(tmp_path):
    """benchmarks/tp_bench.py --smoke: a tiny random shape over one and two CPU processes (gloo),
    each size's decode rate and verification costs written, T(1) / T(1) = 1."""
    _run_script("tp_bench.py", "--smoke", "--out", str(tmp_path), "--steps", "4", "--reps", "2", "--scratch",
                str(tmp_path / "models"))
    sizes = json.loads((tmp_path / "tp_bench.json").read_text())["shapes"]["tiny shape"]["by_size"]
    assert sorted(sizes) == ["1", "2"]
    for size in sizes.values():
        assert size["decode_tokens_per_s"] > 0 and size["verify_ratio"][0] == 1.0


def test_cpu_decode_levels_times_both_dtypes_at_each_level(default_model_dir):
    """benchmarks/cpu_decode_levels.py in a small form: a float32 and a bfloat16 step time at each
    level asked for."""
    from outpace.kernels import cpu_isa

    levels = list(cpu_isa.testable())
    out = _run_script("cpu_decode_levels.py", "--levels", ",".join(levels), "--rounds", "1", "--steps", "2")
    found = re.findall(r"^(\S+) +float32 +(\S+) ms/step  bfloat16 +(\S+) ms/step", out, re.M)
    assert [level for level, _, _ in found] == levels
    assert all(float(a) > 0 and float(b) > 0 for _, a, b in found)


def test_kernels_ab_times_another_level_of_this_checkout(tiny_folder, script, capsys):
    """benchmarks/kernels_ab.py --base-level: a recorded layers call timed with this checkout's
    portable build against the level the kernels run at, call by call, a line a token count."""
    if not cpu_kernels.has_library():
        pytest.skip("the CPU kernels do not load here (no C compiler, or turned off)")
    script("kernels_ab", "--base-level", "portable", "--model", str(tiny_folder), "--tokens", "1,3", "--calls", "4",
           "--min-position", "40").main()
    out = capsys.readouterr().out
    assert f"kernels at {cpu_kernels.level()}, base at portable" in out
    lines = re.findall(r"^(\d+) tokens at positions .* base / this [0-9.]+ .*same bits: (?:True|False)$", out, re.M)
    assert lines == ["1", "3"]


def test_serve_bench_measures_each_level_over_http(dataset, default_model_dir, tmp_path):
    """benchmarks/serve_bench.py in a small form: a server on a free port, two concurrency levels,
    both modes measured at each, and greedy speculative outputs equal plain ones."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _run_script("serve_bench.py", "--dataset", str(dataset), "--concurrency", "1", "2", "--requests", "2",
                "--max-tokens", "8", "--rounds", "1", "--port", str(port), "--out", str(tmp_path))
    levels = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert [level["concurrency"] for level in levels] == [1, 2]
    for level in levels:
        assert level["plain"]["tokens_per_s"] > 0 and level["spec"]["tokens_per_s"] > 0
        assert level["differing_outputs"] == 0


def test_decode_speed_compares_outpace_with_transformers(tiny_folder, dataset, tmp_path):
    """benchmarks/decode_speed.py in a small form, on a tiny model both engines load: each engine's
    decode and end-to-end rates, and their greedy tokens the same (float32)."""
    out = tmp_path / "decode_speed.json"
    _run_script("decode_speed.py", "--model", str(tiny_folder), "--num-prompts", "1", "--max-tokens", "8",
                "--dtypes", "float32", "--dataset", str(dataset), "--out", str(out))
    (result,) = json.loads(out.read_text())["results"]
    assert result["identical_share"] == 1.0 and result["decode_ratio"] > 0
    assert all(result["engines"][name]["decode_tokens_per_s"] > 0 for name in ("outpace", "transformers"))
