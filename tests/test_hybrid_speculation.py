"""Speculation on hybrid models (recurrent state beside attention): whatever a drafter proposes,
greedy output equals plain greedy output, with the state rolled back from snapshots or by replay.

Tiny random float64 models of both kinds of recurrent layer; more prompts than slots and prompt
chunks of 8 tokens, so rollback happens in batched verify steps beside prompt chunks, and slots
are reused. The adversaries of tests/test_spec_lossless.py draft: the true continuation (every
draft accepted: the state after all of them must be the plain run's), the truth corrupted after a
few tokens (rollback to the middle of a row), random tokens (rollback every step) and n-gram.
"""
import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from test_spec_lossless import OracleDrafter, RandomDrafter
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def options(**kw):
    return dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=128, max_prefill_tokens=8,
                calibrate=False) | kw


@pytest.fixture(scope="module", params=["qwen3_5-vl", "lfm2"])
def hybrid(request, tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny(request.param, folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    plain = LLM(str(folder), spec="none", **options()).generate(PROMPTS, PARAMS)
    return folder, {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}


@pytest.mark.parametrize("snapshots", [True, False])
@pytest.mark.parametrize("name", ["oracle", "corrupt-after-2", "random", "ngram"])
def test_speculative_greedy_equals_plain_on_hybrids(hybrid, name, snapshots):
    folder, plain = hybrid
    drafter = {"oracle": OracleDrafter(plain), "corrupt-after-2": OracleDrafter(plain, corrupt_after=2),
               "random": RandomDrafter(49152), "ngram": None}[name]
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), drafter=drafter,
              **options(recurrent_snapshots=snapshots))
    out = llm.generate(PROMPTS, PARAMS)
    for prompt, o in zip(PROMPTS, out):
        assert o.token_ids == plain[tuple(prompt)], f"{name} changed the output of {prompt}"
    drafted = sum(o.spec["num_draft_tokens"] for o in out)
    accepted = sum(o.spec["num_accepted_tokens"] for o in out)
    if name == "oracle":
        assert accepted == drafted > 0
    if name in ("corrupt-after-2", "random"):
        assert drafted > accepted
    assert sorted(llm.engine.scheduler.free_slots) == [0, 1, 2]


@pytest.mark.parametrize("snapshots", [True, False])
def test_state_bytes_is_what_the_cache_allocates(hybrid, snapshots):
    from outpace.runner.state_cache import StateCache, state_bytes
    model = LLM(str(hybrid[0]), spec="none", **options()).engine.model
    shapes = model.state_shapes()
    cache = StateCache(shapes, 3, 5, snapshots, torch.float64)
    assert state_bytes(shapes, 3, 5, snapshots, torch.float64) == cache.nbytes > 0


def test_snapshots_give_way_to_replay_when_memory_is_short(hybrid, monkeypatch, capsys):
    """By default a hybrid rolls back from snapshots, unless they would take over a quarter of the
    memory left: then by replay, said on stderr, and output still equals plain output."""
    from outpace.engine import llm_engine
    folder, plain = hybrid
    monkeypatch.setattr(llm_engine, "free_memory", lambda device: 1000)
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), drafter=RandomDrafter(49152), **options())
    assert not llm.engine.snapshots and not llm.engine.runner.cache.state.snapshots
    assert "rolling back by replay" in capsys.readouterr().err
    for prompt, o in zip(PROMPTS, llm.generate(PROMPTS, PARAMS)):
        assert o.token_ids == plain[tuple(prompt)]
    monkeypatch.setattr(llm_engine, "free_memory", lambda device: 1 << 40)
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), **options())
    assert llm.engine.snapshots and llm.engine.runner.cache.state.snapshots
    monkeypatch.setattr(llm_engine, "free_memory", lambda device: 1000)
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), **options(recurrent_snapshots=True))
    assert llm.engine.runner.cache.state.snapshots, "an explicit choice is kept"


@pytest.mark.parametrize("flag,value", [("auto", None), ("snapshots", True), ("replay", False)])
def test_recurrent_rollback_flag(flag, value):
    import argparse
    from outpace.cli import add_model_args, model_options
    p = argparse.ArgumentParser()
    add_model_args(p)
    assert model_options(p.parse_args(["--recurrent-rollback", flag]))["recurrent_snapshots"] is value
