"""Seeded sampling is speculation-proof: whatever a drafter proposes, whatever shares the batch and
whenever it joins, a seeded request's sampled tokens equal plain seeded sampling's token for token.

Guards: each call of the sampler drew a fixed count of random numbers from the request's own
generator, so the number of verify steps (which drafts decide) changed the text: seed 7 at
temperature 0.8 gave two different texts in three identical runs. Tiny random models in float64
(logits of a verify forward equal a decode step's but for the last bits), a vocabulary of 2,048
(shaping a 49,152-token one dominates a CPU step), the adversarial drafters of
test_spec_lossless.py (the true continuation, corrupted, random tokens), fewer slots than requests,
small prompt chunks, and unseeded neighbours joining mid-way.
"""
import random

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.config import EngineConfig
from outpace.engine.llm_engine import LLMEngine
from outpace.speculative.drafter import Drafter, Drafts
from test_spec_lossless import RandomDrafter
from tiny import make_tiny

VOCAB = 2048

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42],
           list(range(500, 520)) * 2]
NEIGHBOURS = [[9, 8, 7, 6], [300, 301, 302, 300, 301], [11] * 12]
MAX_TOKENS = 32


def seeded_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0 + 0.2 * (i % 3), top_p=0.95 if i % 2 else 1.0, top_k=100 * (i % 3),
                          min_p=0.01 if i % 3 == 1 else 0.0, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True)


NEIGHBOUR_PARAMS = [SamplingParams(temperature=1.3, max_tokens=MAX_TOKENS, ignore_eos=True),
                    SamplingParams(temperature=0, max_tokens=MAX_TOKENS // 2, ignore_eos=True),
                    SamplingParams(temperature=0.9, top_k=5, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)]


class OracleDrafter(Drafter):
    """Drafts the plain run's continuation (nothing for other prompts); `corrupt_after` replaces
    tokens past that many with others of this vocabulary (test_spec_lossless's oracle knows
    neither neighbours nor vocabularies other than the default model's)."""

    def __init__(self, plain: dict[tuple, list[int]], corrupt_after: int | None = None, seed: int = 0):
        self.plain, self.corrupt_after = plain, corrupt_after
        self.rng = random.Random(seed)
        self.tokens: dict[int, list[int]] = {}
        self.prompts: dict[int, tuple] = {}

    def begin(self, seq_id, token_ids):
        self.tokens[seq_id], self.prompts[seq_id] = list(token_ids), tuple(token_ids)

    def accept(self, seq_id, token_ids):
        self.tokens[seq_id] += token_ids

    def propose(self, batch):
        drafts = []
        for seq_id, k in zip(batch.seq_ids, batch.budget):
            prompt = self.prompts[seq_id]
            done = len(self.tokens[seq_id]) - len(prompt)
            truth = self.plain.get(prompt, [])[done:done + k]
            if self.corrupt_after is not None:
                truth = [t if i < self.corrupt_after else (t + 1 + self.rng.randrange(50)) % VOCAB
                         for i, t in enumerate(truth)]
            drafts.append(truth)
        return Drafts.from_lists(drafts)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models step in microseconds: on a shared CPU a second torch thread only waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-sampled")
    make_tiny("llama", folder, vocab_size=VOCAB, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder


def make_engine(folder, spec="none", drafter=None, max_num_seqs=3) -> LLMEngine:
    spec = SpecConfig(method=spec, num_draft_tokens=5) if spec != "none" else SpecConfig(method="none")
    return LLMEngine(EngineConfig(model=str(folder), dtype="float64", device="cpu", max_num_seqs=max_num_seqs,
                                  max_model_len=256, max_prefill_tokens=8, spec=spec, calibrate=False), drafter)


def run(engine: LLMEngine, schedule: list[tuple[int, list[int], SamplingParams]]) -> list[list[int]]:
    """Add each (step, prompt, params) at that step of the engine; returns every request's output."""
    seqs, step = [], 0
    pending = sorted(schedule, key=lambda s: s[0])
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            seqs.append((prompt, params, engine.add_request(prompt, params)))
        engine.step()
        step += 1
    order = {(tuple(p), id(q)): s.output_ids for p, q, s in seqs}
    return [order[(tuple(p), id(q))] for _, p, q in schedule]


@pytest.fixture(scope="module")
def plain(tiny_folder):
    """Each seeded prompt sampled alone without speculation."""
    engine = make_engine(tiny_folder, max_num_seqs=1)
    outputs = {tuple(p): run(engine, [(0, p, seeded_params(i))])[0] for i, p in enumerate(PROMPTS)}
    greedy = run(engine, [(0, p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
                          for p in PROMPTS])
    assert sum(outputs[tuple(p)] != g for p, g in zip(PROMPTS, greedy)) >= 4, "sampling should differ from greedy"
    return outputs


def with_neighbours(steps: list[int]) -> list[tuple[int, list[int], SamplingParams]]:
    """The seeded prompts and the neighbours, each added at its step."""
    schedule = [(steps[i % len(steps)], p, seeded_params(i)) for i, p in enumerate(PROMPTS)]
    return schedule + [(2 + 3 * j, p, q) for j, (p, q) in enumerate(zip(NEIGHBOURS, NEIGHBOUR_PARAMS))]


@pytest.mark.parametrize("name", ["oracle", "corrupt-after-0", "corrupt-after-2", "random", "ngram"])
def test_speculative_sampling_equals_plain_sampling(name, tiny_folder, plain):
    """Every drafter, three slots for eight requests (queueing, prompt chunks riding in verify
    forwards), neighbours joining mid-way: each seeded request's tokens are plain sampling's."""
    drafter = {
        "oracle": OracleDrafter(plain),
        "corrupt-after-0": OracleDrafter(plain, corrupt_after=0),
        "corrupt-after-2": OracleDrafter(plain, corrupt_after=2),
        "random": RandomDrafter(VOCAB),
        "ngram": None,
    }[name]
    engine = make_engine(tiny_folder, spec="ngram", drafter=drafter)
    schedule = with_neighbours([0, 0, 1, 4, 9])
    outputs = run(engine, schedule)
    for (_, prompt, _), out in zip(schedule, outputs[:len(PROMPTS)]):
        assert out == plain[tuple(prompt)], f"{name} changed the sampled output of {prompt}"
    stats = engine.stats
    if name == "oracle":
        seeded_drafts = stats.num_draft_tokens
        assert seeded_drafts > 0 and stats.num_accepted_tokens == seeded_drafts
    if name == "corrupt-after-0":
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2] and not engine.scheduler.running


@pytest.mark.parametrize("max_num_seqs", [1, 4, 8])
def test_speculative_sampling_equals_plain_in_any_batch(max_num_seqs, tiny_folder, plain):
    """n-gram speculation alone (one slot) and in batches of 4 and 8 slots, with requests
    joining at different steps: the same tokens as plain sampling alone."""
    engine = make_engine(tiny_folder, spec="ngram", max_num_seqs=max_num_seqs)
    schedule = with_neighbours([0, 3, 3, 7, 12])
    outputs = run(engine, schedule)
    for (_, prompt, _), out in zip(schedule, outputs[:len(PROMPTS)]):
        assert out == plain[tuple(prompt)]
    assert engine.stats.num_accepted_tokens > 0, "speculation should have accepted some drafts"


def test_same_seed_same_text_through_llm(tiny_folder):
    """The LLM API: one seed, three runs in other batches and orders, speculation on and off, one text."""
    params = SamplingParams(temperature=0.8, top_k=100, seed=7, max_tokens=20, ignore_eos=True)
    texts = []
    for spec, prompts in [("ngram", PROMPTS[:3]), ("ngram", PROMPTS[2::-1]), ("none", PROMPTS[:1])]:
        llm = LLM(str(tiny_folder), spec=spec, dtype="float64", device="cpu", max_num_seqs=2, max_model_len=256,
                  calibrate=False)
        out = llm.generate(prompts, params)
        texts.append(next(o.token_ids for p, o in zip(prompts, out) if p == PROMPTS[0]))
    assert texts[0] == texts[1] == texts[2]
