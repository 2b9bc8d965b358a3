"""Draft-model speculation on tiny random float64 models: whatever the draft model drafts, greedy
output equals plain greedy output, batched, with chunked prefill and rollback in every step.

Guards: the draft model's cache must stay consistent through rollback (a draft model that is the
target itself drafts the target's own continuation, so every draft must be accepted: any stale
or misplaced cache entry would show as a rejection); a draft model with other random weights (an
adversary) must not change the output; sampled output with a seed must stay reproducible; an
draft whose ids mean other tokens is refused with a clear error; a draft vocabulary (the first
ids alone) drafts only those ids and leaves the output alone. The GPU's drafting (tokens fed on
the device, rows cut after one host read) runs here too, forced (`drafts_on_device`): it must
draft what the CPU's per-position loop drafts, and record the entries it fed past each cut.
"""
import json
import time

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.engine.graph_step import GraphStep
from outpace.engine.llm_engine import LLMEngine
from outpace.errors import IncompatibleModelsError, InvalidParameterError
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.speculative.chain import DrafterChain
from outpace.speculative.controller import PROBE_DRAFTS
from outpace.speculative.factory import lookup_twin
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42],
           list(range(500, 520)) * 2]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=256, max_prefill_tokens=8,
               calibrate=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model_dir):
    target = tmp_path_factory.mktemp("tiny-target")
    make_tiny("llama", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    other = tmp_path_factory.mktemp("tiny-draft")
    make_tiny("qwen2", other, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64, seed=3)
    # the same model with two tokens' texts swapped in its tokenizer: ids no longer mean the same
    swapped = tmp_path_factory.mktemp("tiny-swapped-vocab")
    make_tiny("llama", swapped, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (text for text, i in vocab.items() if i in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    return target, other, swapped


@pytest.fixture(scope="module")
def plain(folders):
    llm = LLM(str(folders[0]), spec="none", **OPTIONS)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_the_target_as_its_own_draft_is_always_accepted(folders, plain):
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    drafted = sum(o.spec["num_draft_tokens"] for o in out)
    assert drafted > 0 and sum(o.spec["num_accepted_tokens"] for o in out) == drafted
    drafter = llm.engine.drafter
    assert not drafter.tokens and sorted(llm.engine.scheduler.free_slots) == [0, 1, 2]


def test_a_draft_window_reads_the_prompts_tail_alone(folders, plain):
    """draft_window=6: the draft model caches at most a prompt's last 6 tokens and drafts from
    them as from a prompt of its own. With the target as its own draft, every draft is the target's
    greedy continuation of the window plus the output so far (a misplaced position or a stale
    entry would show as another token); the output stays plain's."""
    window = 6
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0,
                      draft_window=window)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
    drafter = llm.engine.drafter
    runner, propose = drafter.runner, drafter.propose
    forward, cached, drafts = runner.forward, [], []

    def counting(rows, *args, **kwargs):
        if kwargs.get("logits") == "none":
            cached.extend(len(r.token_ids) for r in rows)
        return forward(rows, *args, **kwargs)

    def recording(batch):       # a fresh engine numbers its sequences 0, 1, ... in prompt order
        out = propose(batch)
        drafts.extend((s, m, d) for s, m, d in zip(batch.seq_ids, batch.num_output, out.host_rows()) if d)
        return out
    runner.forward, drafter.propose = counting, recording
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(cached) <= sum(min(len(p), window) for p in PROMPTS)
    reference = LLM(str(folders[0]), spec="none", **OPTIONS)
    checked = 0
    for i, num_output, draft in drafts[:40]:
        context = PROMPTS[i][-window:] + plain[i][:num_output]
        params = SamplingParams(temperature=0, max_tokens=len(draft), ignore_eos=True)
        assert reference.generate([context], params)[0].token_ids == draft
        checked += len(PROMPTS[i]) > window
    assert checked > 5


def test_a_plain_request_costs_the_draft_model_nothing(folders, plain):
    """speculate=False (the benchmarks' plain baseline in the same engine): the draft model caches
    none of its prompt and drafts nothing for it, so the baseline pays nothing for the drafter."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
    runner = llm.engine.drafter.runner
    forward, calls = runner.forward, []

    def counting(rows, *args, **kwargs):
        calls.append(len(rows))
        return forward(rows, *args, **kwargs)
    runner.forward = counting
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, speculate=False)] == plain and not calls
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain and calls


def test_deferred_prompts_wait_for_the_catch_up(folders, plain):
    """Where the controller does not expect a sequence to repay its prompt's setup, its prompt
    chunks are not cached (no forward), and a row that later drafts catches up on its whole prompt
    in propose: the target as its own draft, every draft accepted, shows that cache equals the
    chunked one."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
    llm.engine.controller.pays_setup = lambda seconds, room, batch_size, seq_id: False
    drafter = llm.engine.drafter
    forward, prefills = drafter.runner.forward, []

    def counting(rows, logits="all", *args, **kwargs):
        prefills.extend(rows if logits == "none" else [])
        return forward(rows, logits, *args, **kwargs)
    drafter.runner.forward = counting
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain and not prefills
    drafted = sum(o.spec["num_draft_tokens"] for o in out)
    assert drafted > 0 and sum(o.spec["num_accepted_tokens"] for o in out) == drafted


def test_a_catch_up_that_would_not_be_repaid_is_not_paid(folders, plain):
    """A timed controller weighs the catch-up a row must pay before its first draft (its prompt,
    deferred here) against what drafting saves over the tokens the row has left: priced at an
    hour, it is never paid, probes included, and the draft model drafts nothing (the prompts it
    cached before the controller's first decision aside)."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0)
    llm = LLM(str(folders[0]), spec=spec, **{**OPTIONS, "calibrate": True})
    engine = llm.engine
    assert engine.controller.is_timed
    engine.drafter.setup_seconds = lambda seq_ids: [3600.0] * len(seq_ids)
    forward, calls = engine.drafter.runner.forward, []

    def counting(rows, logits="all", *args, **kwargs):
        calls.extend([rows] if logits != "none" else [])
        return forward(rows, logits, *args, **kwargs)
    engine.drafter.runner.forward = counting
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert not calls and sum(o.spec["num_draft_tokens"] for o in out) == 0
    # priced at nothing, the same rows draft (the probes at least)
    engine.drafter.setup_seconds = lambda seq_ids: [0.0] * len(seq_ids)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain and calls and sum(o.spec["num_draft_tokens"] for o in out) > 0


def test_the_catch_up_is_priced_by_the_tokens_the_model_lacks(folders):
    """setup_seconds: nothing for the one or two tokens a drafting step leaves, the measured
    curve for more (the whole prompt before it is cached), growing with them."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0)
    drafter = LLM(str(folders[0]), spec=spec, **OPTIONS).engine.drafter
    assert [n for n, _ in drafter.catch_up] == [1, 5, 6, 32, 128]     # both sides of a verify row (4 drafts)
    drafter.catch_up = [(1, 0.0), (8, 0.7), (32, 3.1), (128, 12.7)]
    drafter.begin(0, [5] * 2)
    drafter.begin(1, [5] * 20)
    drafter.begin(2, [5] * 200)
    assert drafter.setup_seconds([0, 1, 2]) == pytest.approx([0.0, 1.9, 19.9])
    drafter.valid[1] = 19
    assert drafter.setup_seconds([1]) == [0.0]


def test_the_draft_models_costs_are_measured_once_per_model_and_machine(folders, tmp_path, monkeypatch):
    """A second engine of the same pair reads the costs the first measured (timing them costs the
    Qwen pair's start 1.6 s); another draft model measures its own."""
    from outpace.speculative.draft_model import DraftModelDrafter

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    # a forward's time by its tokens (a tiny model's real ones can be too noisy to settle, and
    # then are not kept)
    timed = []
    monkeypatch.setattr(DraftModelDrafter, "_time", lambda self, rows: timed.append(1) or 1e-3 * sum(
        len(row.token_ids) for row in rows))
    costs = []
    for draft in (folders[0], folders[0], folders[1]):
        timed.clear()
        drafter = LLM(str(folders[0]), spec=SpecConfig(method="draft", draft_model=str(draft), num_draft_tokens=4,
                                                       draft_vocab=0), **OPTIONS).engine.drafter
        costs.append((bool(timed), drafter.per_token, drafter.catch_up))
    assert [measured for measured, _, _ in costs] == [True, False, True]
    assert costs[1][1:] == costs[0][1:] and set(costs[1][1]) == {1, 2, 3}


def test_a_draft_models_costs_timed_unsteadily_are_not_kept(folders, tmp_path, monkeypatch):
    """Timings that no second timing repeats within 10% (a busy machine) serve the engine that
    took them, and the next engine of the pair times them again."""
    from outpace.speculative.draft_model import DraftModelDrafter

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    timed = []
    # each timing 20% above the one before: none is ever repeated
    monkeypatch.setattr(DraftModelDrafter, "_time", lambda self, rows: timed.append(1) or 1e-3 * 1.2 ** len(timed))
    measured = []
    for _ in range(2):
        timed.clear()
        LLM(str(folders[0]), spec=SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4,
                                             draft_vocab=0), **OPTIONS)
        measured.append(len(timed))
    assert measured[0] == measured[1] > 0


def test_another_draft_model_keeps_greedy_output(folders, plain):
    spec = SpecConfig(method="draft", draft_model=str(folders[1]), num_draft_tokens=5)
    out = LLM(str(folders[0]), spec=spec, **OPTIONS).generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0


def test_ngram_first_then_the_draft_model(folders, plain):
    """The chain: n-gram lookup where the tail matches, the draft model elsewhere; the draft
    model catches up on the rows n-gram drafted, so its drafts stay the target's own."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, ngram_first=True,
                      draft_vocab=0)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
    chain = llm.engine.drafter
    model = chain.drafters[1]
    drafted = {"model": 0}
    model_propose = model.propose

    def counted(batch):
        drafts = model_propose(batch)
        drafted["model"] += sum(drafts.num_draft_host)
        return drafts
    model.propose = counted
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    total = sum(o.spec["num_draft_tokens"] for o in out)
    assert 0 < drafted["model"] < total                  # both drafted; the model's were all accepted
    assert not model.tokens


def test_ngram_rows_are_not_priced_as_the_draft_model(folders, plain):
    """In a chain the controller's length, decided before drafting, prices the draft model; the
    lookup drafts up to each row's room and its rows are cut after drafting at no drafting cost.
    A draft model too dear to pay for (10 s a token) is then only probed, while the n-gram rows
    still draft several tokens a step; the output stays plain's. The verify forward is priced
    flat and the step-time fit is off, so that a noisy machine's timings decide nothing here."""
    spec = SpecConfig(method="draft", draft_model=str(folders[1]), num_draft_tokens=4, ngram_first=True)
    llm = LLM(str(folders[0]), spec=spec, **dict(OPTIONS, calibrate=True))
    ngram, model = llm.engine.drafter.drafters
    model.cost_per_token = lambda batch_size: 10.0
    controller = llm.engine.controller
    controller.curves = {b: [(x, 1e-3) for x, _ in curve] for b, curve in controller.curves.items()}
    controller.observe_step = controller.observe_tokens = lambda *args: None
    kept = []
    cut = llm.engine.steps._cut

    def recorded(seqs, budget, drafts, rows, paid=True):
        proposal = cut(seqs, budget, drafts, rows, paid)
        if drafts.free:
            kept.extend(n for n, free in zip(proposal.budget, drafts.free) if free)
        return proposal
    llm.engine.steps._cut = recorded
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert kept and max(kept) > 1           # the model's up-front length is 1 (probing) or 0


def test_a_chains_lookup_drafts_in_the_graph_where_the_model_would_not(folders, plain):
    """On the GPU's path (its static-shape runner and step, built here on the CPU), a chain whose
    lookup has a device twin drafts inside the graph step, launched ahead too, wherever the draft
    model would draft for no row, from 1-token matches up as n-gram alone does; the steps that
    probe the model run the chain on the host. A model too dear to pay for (10 s a token) is only
    probed. Output stays plain's, and the twin's
    buffer rows hold their sequences' tokens. The verify forward is priced flat and the fit is
    off, so that a noisy machine's timings decide nothing here."""
    spec = SpecConfig(method="draft", draft_model=str(folders[1]), num_draft_tokens=4, ngram_first=True)
    llm = LLM(str(folders[0]), spec=spec, **dict(OPTIONS, calibrate=True))
    engine = llm.engine
    ngram, model = engine.drafter.drafters
    model.cost_per_token = lambda batch_size: 10.0
    chain = engine.drafter = DrafterChain([ngram, model], lookup_twin(spec, 3, 256, "cpu", use_graph=False))
    assert (chain.lookup.min_ngram, ngram.min_ngram) == (1, 3)
    engine.runner = CudaGraphRunner(engine.model, 3, 256, 16, num_draft_tokens=4, progress=False,
                                    extension=chain.graph_step(3, 5))
    engine.steps = steps = GraphStep(engine.runner, chain, engine.controller, 256, 4, scheduler=engine.scheduler,
                                     overlap=True)
    controller = engine.controller
    controller.curves = {b: [(x, 1e-3) for x, _ in curve] for b, curve in controller.curves.items()}
    controller.observe_step = controller.observe_tokens = lambda *args: None
    counts = {"in graph": 0, "launched": 0, "on the host": 0, "model": 0}
    propose, resume, model_propose = steps.propose, steps.resume, model.propose

    def counted_propose(plan):
        proposal = propose(plan)
        where = "launched" if plan.launched is not None else "in graph" if proposal.in_graph else "on the host"
        counts[where] += sum(proposal.budget)          # tokens the step may draft there
        return proposal

    def counted_model(batch):
        drafts = model_propose(batch)
        counts["model"] += sum(drafts.num_draft_host)
        return drafts
    steps.propose, model.propose = counted_propose, counted_model
    seqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
        for seq in seqs:
            row = chain.lookup.rows.get(seq.seq_id)
            if row is not None and not seq.is_finished and engine.steps.launched is None:
                assert chain.lookup.tokens[row, :len(seq.token_ids)].tolist() == seq.token_ids
    assert [s.output_ids for s in seqs] == plain
    assert counts["in graph"] > 0 and counts["launched"] > 0 and counts["on the host"] > 0
    assert 0 < counts["model"] <= PROBE_DRAFTS + len(PROMPTS)      # probes only
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    assert not chain.lookup.rows and not model.tokens


def test_ngram_ahead_of_a_draft_model_matches_three_tokens_unless_told():
    from outpace.config import DRAFT_CHAIN_MIN_NGRAM
    assert SpecConfig().min_ngram == 1
    assert SpecConfig(method="draft", draft_model="d").min_ngram == 1
    assert SpecConfig(method="draft", draft_model="d", ngram_first=True).min_ngram == DRAFT_CHAIN_MIN_NGRAM == 3
    assert SpecConfig(method="draft", draft_model="d", ngram_first=True, min_ngram=1).min_ngram == 1


def test_a_draft_vocabulary_drafts_its_first_ids_alone(folders, plain):
    """draft_vocab: the draft's LM head computes the first ids' logits alone, so it drafts nothing
    else; the target as its own draft is then accepted wherever its token lies among them, and
    greedy output stays plain's."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=20000)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
    drafter = llm.engine.drafter
    drafted: list[int] = []
    propose = drafter.propose

    def recorded(batch):
        drafts = propose(batch)
        drafted.extend(t for row in drafts.host_rows() for t in row)
        return drafts
    drafter.propose = recorded
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert drafter.model.logit_rows == 20000
    assert drafted and max(drafted) < 20000
    outputs = [t for o in out for t in o.token_ids]
    assert any(t >= 20000 for t in outputs)     # the target wrote ids the draft could not propose
    assert sum(o.spec["num_accepted_tokens"] for o in out) > 0


def test_confidence_stop_drafts_less(folders, plain):
    spec = SpecConfig(method="draft", draft_model=str(folders[1]), num_draft_tokens=5, p_min=0.9)
    out = LLM(str(folders[0]), spec=spec, **OPTIONS).generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    full = LLM(str(folders[0]), spec=SpecConfig(method="draft", draft_model=str(folders[1]), num_draft_tokens=5),
               **OPTIONS).generate(PROMPTS, PARAMS)
    assert sum(o.spec["num_draft_tokens"] for o in out) < sum(o.spec["num_draft_tokens"] for o in full)


def static_draft_runner(engine, model):
    """The GPU's draft runner (CudaGraphRunner, run eagerly on the CPU) instead of ModelRunner."""
    config = engine.config
    return CudaGraphRunner(model, config.max_num_seqs, config.max_model_len,
                           engine.max_step_tokens,
                           num_draft_tokens=engine.num_draft_tokens, progress=False)


@pytest.mark.parametrize("runner", ["model", "static"])
def test_drafts_on_device_equal_drafts_by_position(folders, plain, runner, monkeypatch):
    """Drafting every position with the tokens kept on the device, then cutting each row at its
    budget or its first token below p_min, drafts what the per-position loop drafts, step by step,
    with budgets that differ by row and p_min cutting rows. The target is its own draft, so every
    draft must be accepted: a cut row's fed entries past its draft, listed wrongly in `fed`, would
    leave stale keys in the cache and show as a rejection."""
    if runner == "static":
        monkeypatch.setattr(LLMEngine, "_draft_runner", static_draft_runner)
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0, p_min=0.08)
    steps = {}
    for on_device in (False, True):
        llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
        drafter = llm.engine.drafter
        assert isinstance(drafter.runner, CudaGraphRunner) == (runner == "static")
        drafter.drafts_on_device = on_device
        recorded = steps[on_device] = []
        propose = drafter.propose

        def recording(batch, propose=propose, recorded=recorded):
            drafts = propose(batch)
            recorded.append((list(batch.budget), drafts.host_rows()))
            return drafts
        drafter.propose = recording
        out = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in out] == plain
        drafted = sum(o.spec["num_draft_tokens"] for o in out)
        assert drafted > 0 and sum(o.spec["num_accepted_tokens"] for o in out) == drafted
        assert not drafter.tokens and not drafter.fed
    assert steps[True] == steps[False]
    budgets = [b for b, _ in steps[True]]
    assert any(len({k for k in b if k > 0}) > 1 for b in budgets)       # rows of different budgets
    assert any(0 < len(d) < k for b, rows in steps[True] for k, d in zip(b, rows))     # cut by p_min
    assert any(not d and k > 0 for b, rows in steps[True] for k, d in zip(b, rows))    # cut at the first


@pytest.mark.parametrize("on_device", [False, True])
def test_sampled_drafts_couple_through_the_targets_noise(folders, on_device):
    """A sampling draft model samples with the target's noise for each position: the target as its
    own draft then drafts exactly the target's samples (every draft accepted), another model's
    drafts leave the output alone, and the text is plain seeded sampling's; drafting on the device
    (each position's noise taken from one [B, K] copy) too."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(folders[0]), spec="none", **OPTIONS).generate(PROMPTS, params)]
    for draft in folders[:2]:
        spec = SpecConfig(method="draft", draft_model=str(draft), num_draft_tokens=3, draft_vocab=0)
        llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
        llm.engine.drafter.drafts_on_device = on_device
        out = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in out] == want
        drafted = sum(o.spec["num_draft_tokens"] for o in out)
        if draft == folders[0]:
            assert sum(o.spec["num_accepted_tokens"] for o in out) == drafted > 0


def test_a_draft_whose_ids_mean_other_tokens_is_refused(folders):
    spec = SpecConfig(method="draft", draft_model=str(folders[2]))
    with pytest.raises(IncompatibleModelsError, match="1000"):
        LLM(str(folders[0]), spec=spec, **OPTIONS)


def test_draft_needs_a_model():
    with pytest.raises(InvalidParameterError, match="method 'draft' needs draft_model"):
        SpecConfig(method="draft")


@pytest.mark.parametrize("overlap", [False, True])
def test_host_work_is_a_step_cost_where_steps_are_launched_ahead(folders, overlap):
    """Where steps are launched ahead (GraphStep), a step that is not leaves the device idle while
    the host accepts its tokens, so that time is the step's own cost; elsewhere every step pays it
    alike, a cost per token (observe_tokens). The host's work is made 0.2 s a step here."""
    llm = LLM(str(folders[0]), spec=SpecConfig(num_draft_tokens=4), **dict(OPTIONS, calibrate=True))
    engine = llm.engine
    engine.steps.overlap = overlap          # the CPU's EagerStep never launches ahead: as if it could
    steps, tokens = [], []
    engine.controller.observe_step = lambda rows, n, seconds, *paid: steps.append(seconds)
    engine.controller.observe_tokens = lambda n, seconds: tokens.append(seconds)
    accept = engine.accept
    engine.accept = lambda *args: (time.sleep(0.2), accept(*args))[1]
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert steps and tokens
    if overlap:
        assert min(steps) >= 0.2 and max(tokens) == 0.0
    else:
        assert max(steps) < 0.2 and min(t for t in tokens if t) >= 0.2 / 5
