"""The GPU path's static-shape step and device drafting, checked on the CPU (the same code runs
eagerly there); the CUDA parts skip without a GPU.

Guards: a graph shape whose rows are slots (dummy rows for idle slots, rows in any order, drafts
fed from the device) must give ModelRunner's logits; a dummy row must never touch a real cache
entry; no tier may reallocate a buffer (a captured graph would read freed memory); the device
n-gram drafter must draft exactly what the CPU drafter drafts; the engine on this path must keep
speculative greedy output equal to plain greedy output, with steps launched before the host has
read the step before them (overlap) too, whatever ends a request and whenever requests join.
"""
import random

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import ModelRunner, Row
from outpace.weights.loader import load_model
from outpace.engine.graph_step import GraphStep
from outpace.speculative.controller import DraftController
from outpace.speculative.drafter import DraftBatch, Verified
from outpace.speculative.ngram import NgramDrafter
from outpace.speculative.ngram_device import DeviceNgramDrafter
from tiny import make_tiny

MAX_LEN, SPARE, SLOTS = 64, 16, 5


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-graphs")
    make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder


def runners(folder, device="cpu", **kw):
    model = load_model(folder, torch.float64, device, MAX_LEN)
    static = CudaGraphRunner(model, SLOTS, MAX_LEN, SPARE, num_draft_tokens=5, kv_lens=[32, 64, 128],
                             progress=False, **kw)
    return ModelRunner(model, SLOTS, MAX_LEN, SPARE), static


def prefill(runner, prompts: dict[int, list[int]]):
    for slot, ids in prompts.items():
        runner.forward([Row(slot, ids, 0)], logits="none")


PROMPTS = {0: [5, 6, 7, 8, 9, 10], 2: [1, 2, 3], 3: list(range(20, 40))}


def steps():
    """(rows, description): buckets 1..8, tiers 1..6, rows out of slot order, ragged lengths."""
    return [
        [Row(0, [11], 6)],                                              # bucket 1, tier 1
        [Row(2, [4, 5, 6], 3)],                                         # bucket 4, slots 0,1,3 dummy
        [Row(3, [40, 41], 20), Row(0, [11, 12, 13, 14, 15, 16], 6)],    # out of order, ragged
        [Row(2, [4], 3), Row(0, [11, 12], 6), Row(3, [40], 20)],
    ]


def test_static_step_matches_model_runner(tiny_folder):
    base, static = runners(tiny_folder)
    prefill(base, PROMPTS)
    prefill(static, PROMPTS)
    for rows in steps():
        want, _ = base.forward(rows)
        got, _ = static.forward(rows)
        assert got.shape[:2] == want.shape[:2]
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            torch.testing.assert_close(got[i, :n], want[i, :n], rtol=1e-9, atol=1e-9)


def test_device_drafts_equal_host_tokens(tiny_folder):
    _, static = runners(tiny_folder)
    prefill(static, PROMPTS)
    rows = [Row(3, [40], 20), Row(0, [11], 6)]
    drafts = torch.tensor([[41, 42, 43], [12, 13, 14]])
    host, _ = static.forward([Row(r.slot, r.token_ids + d, r.start) for r, d in zip(rows, drafts.tolist())])
    host = host.clone()
    device, _ = static.forward(rows, draft_tokens=drafts)
    torch.testing.assert_close(device, host, rtol=0, atol=0)


def test_a_device_token_alone_is_a_rows_input(tiny_folder):
    """Rows that hold no host token (a draft model feeding its drafted tokens back) take the
    device token as their input, in either runner."""
    rows = [Row(3, [40, 41], 20), Row(0, [11, 12], 6)]
    for runner in runners(tiny_folder):
        prefill(runner, PROMPTS)
        host, _ = runner.forward(rows)
        host = host.clone()
        runner.forward([Row(r.slot, r.token_ids[:1], r.start) for r in rows])
        device, _ = runner.forward([Row(r.slot, [], r.start + 1) for r in rows],
                                   draft_tokens=torch.tensor([[41], [12]]))
        assert device.shape[:2] == (2, 1)
        torch.testing.assert_close(device[:, 0], host[:, 1], rtol=1e-9, atol=1e-9)


def test_dummy_rows_leave_real_entries_alone(tiny_folder):
    _, static = runners(tiny_folder)
    prefill(static, PROMPTS)
    before = static.cache.k[:, :, :, :MAX_LEN].clone()
    static.forward([Row(2, [4, 5], 3)])                    # bucket 4: slots 0, 1, 3 run dummy rows
    after = static.cache.k[:, :, :, :MAX_LEN]
    changed = (before != after).any(dim=(0, 2, 4)).nonzero().tolist()   # [slot, position]
    assert changed == [[2, 3], [2, 4]]


def test_no_shape_reallocates_a_buffer(tiny_folder):
    _, static = runners(tiny_folder)
    buffers = [static.inputs, static.positions, static.mask, static.logits,
               static.cache.k, static.cache.v]
    pointers = [b.data_ptr() for b in buffers]
    for b in static.buckets:
        for t in static.tiers:
            for start, kv in ((8, 32), (40, 64), (70, 128)):
                rows = [Row(slot, [1] * t, start) for slot in range(b)]
                assert static.shape_for(rows) == (b, t, kv)
                logits, _ = static.forward(rows)
                assert logits.data_ptr() == static.logits.data_ptr()
    assert [b.data_ptr() for b in buffers] == pointers
    assert static.buckets == [1, 2, 4, 5] and static.tiers == [1, 2, 3, 4, 5, 6]
    assert static.cache_len == 128 and static.kv_lens == [32, 64, 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_static_step_returns_its_own_hidden_states(tiny_folder, dtype):
    """A runner built with hidden layers returns from its static step (every graph's body) the
    step's own hidden states: the last layer's, through the final norm and LM head, give the
    step's logits bit for bit; they are ModelRunner's up to the rounding of its other attention
    (a misplaced row, slot or position is off by their whole size); decode and verify tiers,
    dummy rows, rows out of slot order; the logits are those of a runner without hidden layers,
    bit for bit. A request for other layers runs eagerly; a runner built without them allocates
    no buffer and returns none."""
    model = load_model(tiny_folder, dtype, "cpu", MAX_LEN)
    layers = (0, model.cfg.num_layers - 1)
    kw = dict(num_draft_tokens=5, kv_lens=[32, 64, 128], progress=False)
    base, plain = ModelRunner(model, SLOTS, MAX_LEN, SPARE), CudaGraphRunner(model, SLOTS, MAX_LEN, SPARE, **kw)
    static = CudaGraphRunner(model, SLOTS, MAX_LEN, SPARE, hidden_layers=layers, **kw)
    assert plain.hidden is None and static.hidden.shape == (SLOTS * 6, 2, model.cfg.hidden_size)
    for runner in (base, plain, static):
        prefill(runner, PROMPTS)
    # float64: ModelRunner's attention (a boolean mask or none, over fewer keys) sums in another
    # order, a unit in the last place here and there; float32: also its CPU kernels
    tolerance = 1e-15 if dtype == torch.float64 else 1e-6
    for rows in steps():
        _, want = base.forward(rows, hidden_layers=layers)
        logits, hidden = static.forward(rows, hidden_layers=layers)
        assert static.last_shape is not None and hidden.shape[:2] == logits.shape[:2]
        assert torch.equal(logits, plain.forward(rows)[0])
        with torch.inference_mode():
            last = model.lm_logits(model.norm(hidden[:, :, 1]).flatten(0, 1)).view(logits.shape)
        assert torch.equal(last, logits)
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            torch.testing.assert_close(hidden[i, :n], want[i, :n], rtol=0, atol=tolerance)
        assert static.forward(rows)[1] is None and static.last_shape is not None
        _, other = static.forward(rows, hidden_layers=(1,))        # not the runner's layers: eager
        assert static.last_shape is None and torch.equal(other, want[:, :, 1:])
    assert plain.forward(steps()[2])[1] is None and plain.hidden is None


CHUNKS = [Row(0, PROMPTS[0], 0), Row(2, PROMPTS[2], 0), Row(3, PROMPTS[3][:9], 0), Row(3, PROMPTS[3][9:], 9)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_padded_prompt_chunks_cache_what_eager_chunks_cache(tiny_folder, device):
    """Prompt chunks padded to a tier (on the CPU the graph's body runs eagerly) cache what
    ModelRunner's unpadded chunks cache, a chunk after position 0 included; their padding lands
    past each chunk's end in its own slot, and the decode step after them reads alike."""
    base, static = runners(tiny_folder, device, max_prefill_tokens=SPARE)
    assert static.prefill_tiers == [16]
    if device == "cuda":
        assert len(static.chunk_graphs) == len(static.kv_lens)
    before = static.cache.k.clone()
    for row in CHUNKS:
        base.forward([row], logits="none")
        if device == "cpu":
            static._replay_chunk(row, static.chunk_shape(row))
        else:
            static.forward([row], logits="none")
    assert static.chunk_shape(CHUNKS[-1]) == (16, 32)
    changed = (static.cache.k != before).any(dim=(0, 2, 4)).nonzero().tolist()    # [slot, position]
    assert changed == [[0, p] for p in range(16)] + [[2, p] for p in range(16)] + [[3, p] for p in range(25)]
    # graphs' compiled norms round in float32 (as in test_graph_replay_equals_eager): 3e-8 apart
    # on the H100; a key cached at a wrong position or slot is off by its whole size
    tolerance = 1e-9 if device == "cpu" else 1e-6
    for cache, want in ((static.cache.k, base.cache.k), (static.cache.v, base.cache.v)):
        for slot, ids in PROMPTS.items():
            torch.testing.assert_close(cache[:, slot, :, :len(ids)], want[:, slot, :, :len(ids)],
                                       rtol=tolerance, atol=tolerance)
    for rows in steps():
        want, _ = base.forward(rows)
        got, _ = static.forward(rows)
        for i, r in enumerate(rows):
            torch.testing.assert_close(got[i, :len(r.token_ids)], want[i, :len(r.token_ids)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_prompt_chunk_graphs_return_their_hidden_states(tiny_folder, device):
    """Prompt chunks replayed one after the other (each overwriting the buffer) return each
    chunk's own hidden states, zeros past its end, as ModelRunner's unpadded chunks do up to the
    rounding of their other attention (causal, or a boolean mask)."""
    base, static = runners(tiny_folder, device, max_prefill_tokens=SPARE, hidden_layers=(0, 1))
    tolerance = 1e-15 if device == "cpu" else 1e-6     # on CUDA graphs' compiled norms round in float32
    for chunks in (CHUNKS[:3], CHUNKS[3:]):
        shapes = [static.chunk_shape(r) for r in chunks]
        if device == "cpu":
            hidden = static._replay_chunks(chunks, shapes, with_hidden=True)
        else:
            _, hidden = static.forward(chunks, logits="none", hidden_layers=(0, 1))
        assert hidden.shape[:2] == (len(chunks), max(len(r.token_ids) for r in chunks))
        for i, row in enumerate(chunks):
            _, want = base.forward([row], logits="none", hidden_layers=(0, 1))
            n = len(row.token_ids)
            torch.testing.assert_close(hidden[i, :n], want[0], rtol=0, atol=tolerance)
            assert not hidden[i, n:].any()


def test_exact_mode_has_one_tier(tiny_folder):
    model = load_model(tiny_folder, torch.float64, "cpu", MAX_LEN)
    static = CudaGraphRunner(model, 2, MAX_LEN, SPARE, exact_width=5, num_draft_tokens=4, progress=False)
    logits, _ = static.forward([Row(0, [3], 0)])
    assert static.tiers == [5] and logits.shape[1] == 5 and static.kv_lens == [static.cache_len]


@pytest.mark.parametrize("match", ["recent", "first"])
def test_device_drafter_equals_cpu_drafter(match):
    """Random sequences over a small vocabulary (many repeats), ragged room and acceptance."""
    rng = random.Random(0)
    spec = SpecConfig(num_draft_tokens=6, min_ngram=1, max_ngram=3, match=match)
    cpu, device = NgramDrafter(spec), DeviceNgramDrafter(spec, max_seqs=4, max_len=200, device="cpu")
    seqs = {i: [rng.randrange(6) for _ in range(rng.randrange(1, 12))] for i in range(5)}
    for seq_id, tokens in seqs.items():
        cpu.begin(seq_id, tokens)
        device.begin(seq_id, tokens)
    device.end(4)                                       # ended before it ever drafted: holds no row
    cpu.end(4)
    del seqs[4]
    for _ in range(30):
        ids = list(seqs)
        room = [rng.choice([0, 1, 3, 6]) for _ in ids]
        if not any(room):
            continue
        batch = DraftBatch(ids, room, list(range(len(ids))), [len(seqs[i]) - 1 for i in ids])
        want = cpu.propose(batch).host_rows()
        got = device.propose(batch)
        for i, seq_id in enumerate(ids):
            n = int(got.num_draft[i])
            assert got.tokens[i, :n].tolist() == want[i]
        new = torch.tensor([[rng.randrange(6) for _ in range(7)] for _ in ids])
        num_new = torch.tensor([rng.randrange(1, 3) for _ in ids])
        device.verified(Verified(batch, new, num_new))
        for i, seq_id in enumerate(ids):
            appended = new[i, :num_new[i]].tolist()
            cpu.accept(seq_id, appended)
            device.accept(seq_id, appended)
            seqs[seq_id] += appended
    for seq_id, row in device.rows.items():
        assert device.tokens[row, :device.lengths[row]].tolist() == seqs[seq_id]


PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
ENGINE_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]


def device_path_llm(folder, spec, device="cpu", overlap=True):
    """An LLM whose engine runs the GPU path (static-shape runner, device drafter) on `device`."""
    opts = dict(dtype="float64", device=device, max_num_seqs=3, max_model_len=128, calibrate=False, overlap=overlap)
    llm = LLM(str(folder), spec=spec, **opts)
    engine = llm.engine
    if device == "cpu":     # the GPU path's runner, drafter and step, built as on CUDA
        drafter = engine.drafter
        if spec.method == "ngram":
            drafter = DeviceNgramDrafter(spec, 3, 128, "cpu")
        engine.drafter = drafter
        engine.runner = CudaGraphRunner(engine.model, 3, 128, 16, num_draft_tokens=engine.num_draft_tokens,
                                        progress=False, extension=drafter.graph_step(3, engine.num_draft_tokens + 1))
        engine.steps = GraphStep(engine.runner, drafter, engine.controller, 128, engine.num_draft_tokens,
                                 scheduler=engine.scheduler, overlap=overlap)
    return llm


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_device_path_speculation_is_lossless(tiny_folder, device):
    plain = LLM(str(tiny_folder), spec="none", dtype="float64", device="cpu", max_num_seqs=3,
                max_model_len=128).generate(ENGINE_PROMPTS, PARAMS)
    spec = SpecConfig(num_draft_tokens=5)
    llm = device_path_llm(tiny_folder, spec, device)
    in_graph, launched = count_in_graph(llm.engine), count_launched(llm.engine)
    out = llm.generate(ENGINE_PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert in_graph["calls"] > 0                      # greedy steps drafted and verified inside the step
    assert launched["calls"] > 0                      # and steps launched before the last one was read
    assert sum(o.spec["num_accepted_tokens"] for o in out) > 0
    # without overlap the CPU drafter proposes the same drafts, so the same steps are taken (a
    # launched step drafts less near max_tokens: it cannot know how many tokens the step before adds)
    llm = device_path_llm(tiny_folder, spec, device, overlap=False)
    out = llm.generate(ENGINE_PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    cpu = LLM(str(tiny_folder), spec=spec, dtype="float64", device="cpu", max_num_seqs=3, max_model_len=128,
              calibrate=False).generate(ENGINE_PROMPTS, PARAMS)
    assert [o.spec["num_draft_tokens"] for o in out] == [o.spec["num_draft_tokens"] for o in cpu]
    engine = llm.engine
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2] and not engine.drafter.rows


@pytest.mark.parametrize("method", ["ngram", "none"])
def test_overlapped_steps_end_and_join_like_plain_steps(tiny_folder, method):
    """Steps launched before the host reads the step before them: requests ending on max_tokens,
    on a stop token and on the context limit at different steps, and requests joining while a
    launched step runs (one waits for a slot), all give plain greedy output; the launched step of
    a request that ended is dropped, and every slot and buffer row comes back."""
    first = LLM(str(tiny_folder), spec="none", dtype="float64", device="cpu", max_num_seqs=3,
                max_model_len=128).generate(ENGINE_PROMPTS[0], PARAMS)[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 30, 200, 13)]
    params[1].stop_token_ids = [first[11]]          # ends a request mid-run
    prompts = [ENGINE_PROMPTS[0], ENGINE_PROMPTS[0], ENGINE_PROMPTS[2] * 3, ENGINE_PROMPTS[1]]
    plain = LLM(str(tiny_folder), spec="none", dtype="float64", device="cpu", max_num_seqs=3,
                max_model_len=128)
    want = [plain.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert len(want[1]) == 12 and len(want[2]) == 128 - 90           # the stop token; the context limit
    llm = device_path_llm(tiny_folder, SpecConfig(method=method, num_draft_tokens=5))
    engine = llm.engine
    launched = count_launched(engine)
    # a timed controller (a flat calibration): launched steps are timed by the period between reads
    engine.controller = engine.steps.controller = DraftController(engine.num_draft_tokens,
                                                                  {b: [1e-3] * 6 for b in (1, 2, 3)})
    asked, num_draft = {"calls": 0}, engine.controller.num_draft

    def late_drafts(*args, **kwargs):     # no drafting over the first steps: it starts in launched steps
        asked["calls"] += 1
        return 0 if asked["calls"] <= 6 else num_draft(*args, **kwargs)
    engine.controller.num_draft = late_drafts
    seqs = [engine.add_request(prompts[0], params[0]), engine.add_request(prompts[1], params[1])]
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request(p, sp) for p, sp in zip(prompts[2:], params[2:])]    # the last one waits
    runner = engine.runner
    while engine.has_unfinished():
        engine.step()
        if engine.steps.launched is not None:   # a launched step's rows without a sequence stay dummies
            idle = set(range(engine.steps.launched.shape[0])) - {s.slot for s in engine.steps.launched.seqs}
            assert all(runner.starts[slot] == runner.max_len for slot in idle)
        for seq in seqs:                        # a buffer row holds its sequence's tokens (and the launched step's)
            row = engine.drafter.rows.get(seq.seq_id) if method == "ngram" else None
            if row is not None and not seq.is_finished:
                assert engine.drafter.tokens[row, :len(seq.token_ids)].tolist() == seq.token_ids
    assert [s.output_ids for s in seqs] == want
    assert launched["calls"] > 0 and engine.controller.fit
    if method == "ngram":
        assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2] and engine.steps.launched is None
    if method == "ngram":
        assert not engine.drafter.rows


def count_in_graph(engine) -> dict:
    """Counts steps whose graph drafted and verified itself."""
    counter, propose = {"calls": 0}, engine.steps.propose

    def counted(plan):
        proposal = propose(plan)
        counter["calls"] += proposal.in_graph and plan.launched is None
        return proposal
    engine.steps.propose = counted
    return counter


def count_launched(engine) -> dict:
    """Counts steps read after being launched ahead (overlap)."""
    counter, resume = {"calls": 0}, engine.steps.resume

    def counted():
        plan = resume()
        counter["calls"] += plan is not None
        return plan
    engine.steps.resume = counted
    return counter


def count_calls(obj, name: str) -> dict:
    counter = {"calls": 0}
    method = getattr(obj, name)

    def counted(*args, **kwargs):
        counter["calls"] += 1
        return method(*args, **kwargs)
    setattr(obj, name, counted)
    return counter


def test_device_path_mixed_greedy_and_sampled(tiny_folder):
    """A step with a sampled row drafts on the device, verifies on the host and appends there; the
    greedy rows beside it keep plain greedy output, and every row of the token buffer holds its
    sequence's tokens after each step."""
    spec = SpecConfig(num_draft_tokens=5)
    llm = device_path_llm(tiny_folder, spec)
    engine = llm.engine
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    plain = LLM(str(tiny_folder), spec="none", dtype="float64", device="cpu", max_num_seqs=3,
                max_model_len=128).generate(ENGINE_PROMPTS[:2], PARAMS)
    seqs = [engine.add_request(ENGINE_PROMPTS[0], PARAMS), engine.add_request(ENGINE_PROMPTS[2], sampled),
            engine.add_request(ENGINE_PROMPTS[1], PARAMS)]
    on_device = count_calls(engine.drafter, "propose")
    while engine.has_unfinished():
        engine.step()
        for seq in seqs:
            row = engine.drafter.rows.get(seq.seq_id)
            if row is not None:
                assert engine.drafter.tokens[row, :engine.drafter.lengths[row]].tolist() == seq.token_ids
    assert on_device["calls"] > 0
    assert seqs[0].output_ids == plain[0].token_ids and seqs[2].output_ids == plain[1].token_ids
    assert seqs[1].num_output_tokens == 30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_equals_eager(tiny_folder):
    _, graphs = runners(tiny_folder, device="cuda")
    _, eager = runners(tiny_folder, device="cuda", use_graphs=False)
    assert len(graphs.graphs) == len(graphs.buckets) * len(graphs.tiers) * len(graphs.kv_lens)
    for r in (graphs, eager):
        prefill(r, PROMPTS)
    for rows in steps():
        want, _ = eager.forward(rows)
        got, _ = graphs.forward(rows)
        # the norms work in float32 (the reference's rule) and the graphs' compiled kernels reduce
        # in another order, so results agree to float32 rounding (measured: 2e-6 on logits of a few
        # units); a wrong buffer or a stale entry is off by far more
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def assert_bf16_graphs_equal_eager(folder):
    model = load_model(folder, torch.bfloat16, "cuda", MAX_LEN)
    kw = dict(num_draft_tokens=5, kv_lens=[32, 64, 128], progress=False)
    graphs = CudaGraphRunner(model, SLOTS, MAX_LEN, SPARE, **kw)
    eager = CudaGraphRunner(model, SLOTS, MAX_LEN, SPARE, use_graphs=False, **kw)
    for r in (graphs, eager):
        prefill(r, PROMPTS)
    for rows in steps():
        want, _ = eager.forward(rows)
        got, _ = graphs.forward(rows)
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            # bf16 products and attention summed in another order: a few bf16 steps of the logits'
            # scale apart, where a wrong buffer or an unmasked key is off by their whole size
            scale = want[i, :n].abs().max().item()
            torch.testing.assert_close(got[i, :n], want[i, :n], rtol=0.0, atol=0.03 * scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_graph_replay_equals_eager(tiny_folder):
    """bf16 graphs run the Triton kernels: one-row products (bucket 1, tier 1) and decode
    attention, which builds no mask, for every shape."""
    assert_bf16_graphs_equal_eager(tiny_folder)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_fall_back_where_triton_kernels_fail(tiny_folder, monkeypatch, capsys):
    """A card or Triton build the kernels fail on: graphs capture with PyTorch's kernels (and
    the masks they need), and the engine says so once."""
    from outpace.kernels import fused, triton_ops
    fused._checked_ops.cache_clear()
    monkeypatch.setattr(triton_ops, "self_check", lambda device, dtype: "a broken build")
    try:
        assert_bf16_graphs_equal_eager(tiny_folder)
        assert capsys.readouterr().err.count("Triton kernels off") == 1
    finally:
        fused._checked_ops.cache_clear()
