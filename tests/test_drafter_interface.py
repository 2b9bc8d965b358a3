"""The drafter interface as model drafters will use it, exercised by test drafters on a tiny model.

Guards: hidden states a drafter asks for must be the target's own at every accepted position
(prompt chunks and verify steps alike, rejected drafts never among them); a cache allocated
a runner made through the DraftContext must have a cache of the target's slots, length and dtype; a drafter's reported
cost per drafted token must reach the controller (an expensive drafter is not drafted for); a
drafter whose drafts stay on the device (priced_after_drafting False) must keep greedy output.
"""
import random

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.runner.model_runner import ModelRunner, Row
from outpace.speculative.controller import PROBE_DRAFTS
from outpace.speculative.chain import DrafterChain
from outpace.speculative.drafter import DraftBatch, Drafter, Drafts
from outpace.speculative.ngram import NgramDrafter
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], list(range(500, 520)) * 2]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=2, max_model_len=128, max_prefill_tokens=8,
               calibrate=False)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-drafters")
    make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder


@pytest.fixture(scope="module")
def plain(tiny_folder):
    return [o.token_ids for o in LLM(str(tiny_folder), spec="none", **OPTIONS).generate(PROMPTS, PARAMS)]


class HiddenProbe(Drafter):
    """Drafts random tokens (mostly rejected) and records the hidden states it is given at each
    sequence's accepted positions, from prompt chunks and from verify steps."""

    hidden_layers = (0, 1)

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.by_position: dict[int, dict[int, torch.Tensor]] = {}   # seq_id -> position -> [layers, H]
        self.context = None

    def bind(self, context):
        self.context = context
        self.runner = context.make_runner(context.target)

    def begin(self, seq_id, token_ids):
        self.by_position[seq_id] = {}

    def propose(self, batch):
        return Drafts.from_lists([[self.rng.randrange(49152) for _ in range(k)] for k in batch.budget])

    def prefilled(self, chunks):
        for i, (seq_id, start, n) in enumerate(zip(chunks.seq_ids, chunks.starts, chunks.lengths)):
            for j in range(n):
                self.by_position[seq_id][start + j] = chunks.hidden[i, j]

    def verified(self, result):
        for i, (seq_id, last) in enumerate(zip(result.batch.seq_ids, result.batch.positions)):
            for j in range(int(result.num_out[i])):       # the last token and the accepted drafts
                self.by_position[seq_id][last + j] = result.hidden[i, j]


def test_hidden_states_are_the_targets_at_accepted_positions(tiny_folder, plain):
    drafter = HiddenProbe()
    llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=3), drafter=drafter, **OPTIONS)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0       # verify steps carried (rejected) drafts
    reference = ModelRunner(llm.engine.model, 1, 128, 8)
    for seq_id, (prompt, o) in enumerate(zip(PROMPTS, out)):
        tokens = prompt + o.token_ids
        # every position whose token was fed to the target: the prompt, then each output token but the last
        assert sorted(drafter.by_position[seq_id]) == list(range(len(tokens) - 1))
        _, want = reference.forward([Row(0, tokens[:-1], 0)], hidden_layers=(0, 1))
        got = torch.stack([drafter.by_position[seq_id][p] for p in range(len(tokens) - 1)])
        torch.testing.assert_close(got, want[0], rtol=1e-9, atol=1e-9)
    target, own = llm.engine.runner.cache, drafter.runner.cache
    assert (own.num_slots, own.max_len, own.k.dtype) == (target.num_slots, target.max_len, target.k.dtype)
    assert drafter.context.max_step_tokens == 4 and drafter.context.target is llm.engine.model


class Costly(Drafter):
    """Drafts the true continuation, at a price per drafted token it reports."""

    def __init__(self, truth: dict[tuple, list[int]], price: float):
        self.truth, self.tokens, self.price = truth, {}, price

    def begin(self, seq_id, token_ids):
        self.tokens[seq_id] = [tuple(token_ids), 0]

    def accept(self, seq_id, token_ids):
        self.tokens[seq_id][1] += len(token_ids)

    def propose(self, batch):
        rows = []
        for seq_id, k in zip(batch.seq_ids, batch.budget):
            prompt, done = self.tokens[seq_id]
            rows.append(self.truth[prompt][done:done + k])
        return Drafts.from_lists(rows)

    def cost_per_token(self, batch_size):
        return self.price


def test_a_drafters_cost_per_token_reaches_the_controller(tiny_folder, plain):
    """With a flat calibration an always-right drafter pays; the same drafter priced at ten
    forwards a token never does, and the controller drafts nothing for it beyond its probe (one
    token a step until about PROBE_DRAFTS drafts were verified)."""
    truth = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    drafted = {}
    for price in (0.0, 10e-3):
        drafter = Costly(truth, price)
        llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=3), drafter=drafter, **OPTIONS)
        engine = llm.engine
        # a flat calibration: a drafted token adds nothing to the verify forward
        engine.controller.__init__(3, {b: [[0, 1e-3], [2 * 3, 1e-3]] for b in (1, 2)}, packed=True,
                                   draft_cost=drafter.cost_per_token)
        out = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in out] == plain
        drafted[price] = sum(o.spec["num_draft_tokens"] for o in out)
    assert PROBE_DRAFTS <= drafted[10e-3] < 2 * PROBE_DRAFTS < drafted[0.0]


class OnDevice(Drafter):
    """Random drafts whose lengths stay on the 'device' (the host learns them at the step's
    synchronisation): the controller's length is its budget."""

    priced_after_drafting = False

    def __init__(self):
        self.rng, self.budgets = random.Random(1), []

    def propose(self, batch):
        self.budgets.append(list(batch.budget))
        width = max(batch.budget)
        tokens = torch.tensor([[self.rng.randrange(49152) for _ in range(width)] for _ in batch.budget])
        num = torch.tensor([self.rng.randrange(0, k + 1) for k in batch.budget])
        return Drafts(tokens.view(len(batch.budget), width), num)


def test_device_lengths_keep_greedy_output(tiny_folder, plain):
    drafter = OnDevice()
    out = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=3), drafter=drafter, **OPTIONS).generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert drafter.budgets and all(max(b) <= 3 for b in drafter.budgets)


class FixedDrafts(Drafter):
    """A paying drafter behind n-gram lookup: drafts its budget of token 900 for each row it is
    given, except rows of `silent` sequences (nothing); a lookup match shorter than 2 yields to it."""

    priced_after_drafting = False
    lookup_yields_below = 2

    def __init__(self, silent: set[int]):
        self.silent, self.asked = silent, []

    def propose(self, batch: DraftBatch) -> Drafts:
        self.asked += batch.seq_ids
        return Drafts.from_lists([[] if s in self.silent else [900] * k for s, k in zip(batch.seq_ids, batch.budget)])


def test_a_short_lookup_match_yields_to_the_paying_drafter_where_it_drafts():
    """In a chain, a lookup draft from a match shorter than the next drafter's lookup_yields_below
    gives way to that drafter's draft of the row; it stays where that drafter has no budget for
    the row or gives no draft, and a long enough match keeps the row."""
    paying = FixedDrafts(silent={3})
    chain = DrafterChain([NgramDrafter(SpecConfig()), paying])
    tokens = {0: [5, 6, 7, 5],          # a 1-token match (5): 6 7 5
              1: [5, 6, 7, 5, 6],       # a 2-token match (5 6): 7 5 6
              2: [5, 6, 7, 5],          # a 1-token match, no budget for the paying drafter
              3: [5, 6, 7, 5],          # a 1-token match, the paying drafter drafts nothing
              4: [1, 2, 3]}             # no match
    for seq_id, t in tokens.items():
        chain.begin(seq_id, t)
    batch = DraftBatch(list(tokens), budget=[2, 2, 0, 2, 2], slots=[0] * 5, positions=[0] * 5, room=[3] * 5)
    drafts = chain.propose(batch)
    assert drafts.host_rows() == [[900, 900], [7, 5, 6], [6, 7, 5], [6, 7, 5], [900, 900]]
    assert drafts.match_len == [0, 2, 1, 1, 0]
    assert drafts.free == [False, True, True, True, False]
    assert paying.asked == [0, 3, 4]


class OutOfVocabulary(Costly):
    """Costly's true continuations, free, each third token an id past the vocabulary (or -1)."""

    def __init__(self, truth):
        super().__init__(truth, 0.0)

    def propose(self, batch):
        rows = [list(row) for row in super().propose(batch).host_rows()]
        for seq_id, row in zip(batch.seq_ids, rows):
            if len(row) > 2:
                row[2] = 10 ** 9 if seq_id % 2 else -1
        return Drafts.from_lists(rows)


def test_draft_ids_outside_the_vocabulary_cost_their_tokens_never_the_output(tiny_folder, plain, capsys):
    """A drafter proposing ids no embedding holds: every output stays plain greedy output, each
    draft verified up to the bad id, and stderr says so once."""
    truth = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=6), drafter=OutOfVocabulary(truth), **OPTIONS)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert all(0 < o.spec["num_draft_tokens"] <= 2 * o.spec["num_verify_steps"] for o in out)
    assert capsys.readouterr().err.count("outside the target's vocabulary") == 1
