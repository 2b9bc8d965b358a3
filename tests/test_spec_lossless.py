"""Losslessness: whatever a drafter proposes, speculative greedy output equals plain greedy output.

Tiny random models in float64 (no near-ties), each drafted for by adversaries: random tokens,
the true continuation, the true continuation corrupted after a few tokens, and the n-gram drafter.
Several prompts share the engine with fewer slots than requests, so batching, queueing, ragged
draft lengths and rollback of rejected tokens are all exercised.
"""
import random

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.speculative.drafter import Drafter, Drafts
from tiny import make_tiny


class OracleDrafter(Drafter):
    """Drafts the plain run's continuation; `corrupt_after` replaces tokens past that many."""

    def __init__(self, plain: dict[tuple, list[int]], corrupt_after: int | None = None, seed: int = 0):
        self.plain, self.corrupt_after = plain, corrupt_after
        self.rng = random.Random(seed)
        self.tokens: dict[int, list[int]] = {}
        self.prompts: dict[int, tuple] = {}

    def begin(self, seq_id, token_ids):
        self.tokens[seq_id] = list(token_ids)
        self.prompts[seq_id] = tuple(token_ids)

    def accept(self, seq_id, token_ids):
        self.tokens[seq_id] += token_ids

    def propose(self, batch):
        drafts = []
        for seq_id, k in zip(batch.seq_ids, batch.budget):
            prompt = self.prompts[seq_id]
            done = len(self.tokens[seq_id]) - len(prompt)
            truth = self.plain[prompt][done:done + k]
            if self.corrupt_after is not None:
                truth = [t if i < self.corrupt_after else (t + 1 + self.rng.randrange(50)) % 49152
                         for i, t in enumerate(truth)]
            drafts.append(truth)
        return Drafts.from_lists(drafts)


class RandomDrafter(Drafter):
    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, batch):
        return Drafts.from_lists([[self.rng.randrange(self.vocab) for _ in range(k)] for k in batch.budget])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42],
           list(range(500, 520)) * 2]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def engine_options(**kw):
    """Fewer slots than prompts and small prompt chunks: later prompts are cached in chunks
    that ride in the others' decode and verify forwards."""
    return dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=256, max_prefill_tokens=8) | kw


@pytest.fixture(scope="module")
def plain_outputs(tiny_folder):
    """Each prompt decoded alone: no batching, no prompt chunk beside a decode step."""
    llm = LLM(str(tiny_folder), spec="none", **engine_options(max_num_seqs=1))
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, PARAMS))}


@pytest.mark.parametrize("name", ["oracle", "corrupt-after-0", "corrupt-after-2", "random", "ngram"])
def test_speculative_greedy_equals_plain(name, tiny_folder, plain_outputs):
    spec = SpecConfig(method="ngram", num_draft_tokens=5)
    drafter = {
        "oracle": OracleDrafter(plain_outputs),
        "corrupt-after-0": OracleDrafter(plain_outputs, corrupt_after=0),
        "corrupt-after-2": OracleDrafter(plain_outputs, corrupt_after=2),
        "random": RandomDrafter(49152),
        "ngram": None,
    }[name]
    llm = LLM(str(tiny_folder), spec=spec, drafter=drafter, **engine_options(calibrate=False))
    outputs = llm.generate(PROMPTS, PARAMS)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == plain_outputs[tuple(prompt)], f"{name} changed the output of {prompt}"
    total = sum(o.spec["num_draft_tokens"] for o in outputs)
    accepted = sum(o.spec["num_accepted_tokens"] for o in outputs)
    if name == "oracle":
        assert accepted == total > 0, "the true continuation must always be accepted"
    if name == "corrupt-after-0":
        assert accepted == 0 and total > 0
    # every slot is free again: nothing leaked through rejection
    scheduler = llm.engine.scheduler
    assert sorted(scheduler.free_slots) == [0, 1, 2] and not scheduler.running


def test_oracle_needs_fewer_target_steps(tiny_folder, plain_outputs):
    """The oracle's verify steps are ~max_tokens / (k+1): speculation really skips target forwards."""
    llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=4), drafter=OracleDrafter(plain_outputs),
              **engine_options(calibrate=False))
    out = llm.generate([PROMPTS[0]], PARAMS)[0]
    assert out.spec["num_verify_steps"] == -(-PARAMS.max_tokens // 5)
    assert out.spec["mean_acceptance_length"] == pytest.approx(PARAMS.max_tokens / out.spec["num_verify_steps"])


def test_sampled_speculation_is_reproducible_with_seed(tiny_folder):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=4), **engine_options(calibrate=False))
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    again = [o.token_ids for o in llm.generate(PROMPTS[::-1], params)][::-1]
    assert first == again


def test_abort_frees_the_slot_at_once(tiny_folder):
    llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=4), **engine_options(calibrate=False))
    engine = llm.engine
    seqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
    engine.step()
    engine.abort(seqs[0].seq_id)
    assert seqs[0].finish_reason == "abort" and seqs[0].slot in engine.scheduler.free_slots
    while engine.has_unfinished():
        engine.step()
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2]
    assert all(s.num_output_tokens == PARAMS.max_tokens for s in seqs[1:])


def test_lookup_memory_repeats_and_decoys(tiny_folder, plain_outputs):
    """n-gram lookup's memory of ended requests: decoys (each prompt followed by other tokens, as
    ended requests) make it draft wrong continuations that agree far back, and the output is still
    plain's; the same prompts again draft their first run's answers, in fewer target steps than
    the first run took."""
    llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=5, lookup_memory=65536),
              **engine_options(calibrate=False))
    rng = random.Random(3)
    decoys = [p + [rng.randrange(49152) for _ in range(12)] for p in PROMPTS]
    llm.generate(decoys, SamplingParams(temperature=0, max_tokens=1))
    runs = [llm.generate(PROMPTS, PARAMS) for _ in range(2)]
    for outputs in runs:
        for prompt, out in zip(PROMPTS, outputs):
            assert out.token_ids == plain_outputs[tuple(prompt)]
    steps = [sum(o.spec["num_verify_steps"] for o in outputs) for outputs in runs]
    assert steps[1] < steps[0]
    memory = llm.engine.drafter.memory
    assert len(memory.docs) == 3 * len(PROMPTS)
