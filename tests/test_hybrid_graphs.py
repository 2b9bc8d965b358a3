"""Hybrid models in the CUDA graph runner's static steps: rows for every slot of a batch bucket,
padded to a tier, idle slots' dummy rows on the state cache's sink slot, the host recording each
replay's verify. On the CPU the same steps run eagerly (the C kernels); the CUDA tests capture the
graphs (the Triton kernels) and run the engine.

Guards: a static step must give ModelRunner's logits for every real token, whatever dummy rows
the bucket adds, and leave a slot idle during it (one whose prompt is half cached) exactly as it
was; a verify step committed at any length must leave the states ModelRunner's commit leaves; on
CUDA, speculative greedy output must equal plain greedy output, graphs on, in both rollback modes.
"""
import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.engine.graph_step import GraphStep
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import ModelRunner, Row
from outpace.weights.loader import load_model
from test_spec_lossless import OracleDrafter, RandomDrafter
from tiny import make_tiny, slot_state

MAX_LEN, SPARE, SLOTS = 64, 16, 5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")


@pytest.fixture(scope="module", params=["qwen3_5", "lfm2"])
def folder(request, tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}-graphs")
    make_tiny(request.param, folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float32)
    return folder


def runners(folder, snapshots: bool):
    """ModelRunner and the graph runner (graphs captured on CUDA, eager on the CPU), float32."""
    model = load_model(folder, torch.float32, DEVICE, MAX_LEN)
    static = CudaGraphRunner(model, SLOTS, MAX_LEN, SPARE, num_draft_tokens=4, kv_lens=[32, 64, 128],
                             progress=False, snapshots=snapshots)
    return ModelRunner(model, SLOTS, MAX_LEN, SPARE, max_verify_tokens=5, snapshots=snapshots), static


PROMPTS = {0: [5, 6, 7, 8, 9, 10], 2: [1, 2, 3], 3: list(range(20, 40))}


def steps():
    """(rows, accepted drafts per row or None): buckets 1..8, dummy rows, ragged verify rows."""
    return [
        ([Row(0, [11], 6)], None),                                              # bucket 1, tier 1
        ([Row(2, [4, 5, 6], 3)], [1]),                                          # bucket 4: 0, 1, 3 dummy
        ([Row(3, [40, 41], 20), Row(0, [12, 13, 14, 15, 16], 7)], [0, 4]),      # out of order, ragged
        ([Row(2, [6], 5), Row(0, [17, 18], 12), Row(3, [41], 21)], [0, 1, 0]),
        ([Row(4, [7], 0)], None),                                                # fresh, bucket 8
    ]


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_static_steps_match_model_runner(folder, snapshots):
    base, static = runners(folder, snapshots)
    for runner in (base, static):
        for slot, ids in PROMPTS.items():
            runner.forward([Row(slot, ids, 0)], logits="none")
        runner.forward([Row(1, [9, 9, 9, 9], 0)], logits="none")     # slot 1: half its prompt cached
    held = slot_state(static.cache.state, 1)
    for rows, accepted in steps():
        want, _ = base.forward(rows)
        got, _ = static.forward(rows)
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            torch.testing.assert_close(got[i, :n], want[i, :n], rtol=1e-4, atol=1e-4)
        if accepted is not None:
            for runner in (base, static):
                runner.cache.commit([r.slot for r in rows], accepted)
        for got_state, want_state in zip(slot_state(static.cache.state, 1), held):
            assert torch.equal(got_state, want_state), "a dummy row changed an idle slot's state"
    # the rest of slot 1's prompt, then a decode step: its state came through the steps intact
    for runner in (base, static):
        runner.forward([Row(1, [8, 8], 4)], logits="none")
    want, _ = base.forward([Row(1, [3], 6)])
    got, _ = static.forward([Row(1, [3], 6)])
    torch.testing.assert_close(got[0, :1], want[0, :1], rtol=1e-4, atol=1e-4)


ENGINE_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_graph_path_speculation_is_lossless_on_the_cpu(folder, snapshots):
    """The engine as it runs on CUDA (the graph runner's static steps, GraphStep with overlap),
    eagerly on the CPU in float64: the truth corrupted after two tokens (rows rolled back to their
    middle, or kept whole) and random drafts keep plain greedy output."""
    options = dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=128, max_prefill_tokens=8,
                   calibrate=False, recurrent_snapshots=snapshots)
    plain = {tuple(p): o.token_ids for p, o in
             zip(ENGINE_PROMPTS, LLM(str(folder), spec="none", **options).generate(ENGINE_PROMPTS, PARAMS))}
    for drafter in (OracleDrafter(plain, corrupt_after=2), RandomDrafter(49152)):
        llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), drafter=drafter, **options)
        engine = llm.engine
        engine.runner = CudaGraphRunner(engine.model, 3, 128, 8, num_draft_tokens=4, progress=False,
                                        snapshots=snapshots)
        engine.steps = GraphStep(engine.runner, drafter, engine.controller, 128, 4, scheduler=engine.scheduler,
                                 overlap=True)
        out = llm.generate(ENGINE_PROMPTS, PARAMS)
        for prompt, o in zip(ENGINE_PROMPTS, out):
            assert o.token_ids == plain[tuple(prompt)], f"{type(drafter).__name__} changed {prompt}"
        assert sum(o.spec["num_draft_tokens"] for o in out) > 0


@needs_cuda
@pytest.mark.parametrize("dtype, snapshots", [("float32", True), ("bfloat16", True), ("float32", False)],
                         ids=["float32-snapshots", "bfloat16-snapshots", "float32-replay"])
def test_speculative_greedy_equals_plain_in_graphs(folder, dtype, snapshots):
    """The engine on CUDA with graphs (more prompts than slots, prompt chunks of 8): the truth,
    the truth corrupted after two tokens and random drafts keep plain greedy output."""
    options = dict(dtype=dtype, device="cuda", max_num_seqs=3, max_model_len=128, max_prefill_tokens=8,
                   calibrate=False, recurrent_snapshots=snapshots)
    llm = LLM(str(folder), spec="none", **options)
    assert llm.engine.uses_graphs
    plain = {tuple(p): o.token_ids for p, o in zip(ENGINE_PROMPTS, llm.generate(ENGINE_PROMPTS, PARAMS))}
    for drafter in (OracleDrafter(plain), OracleDrafter(plain, corrupt_after=2), RandomDrafter(49152)):
        llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), drafter=drafter, **options)
        out = llm.generate(ENGINE_PROMPTS, PARAMS)
        for prompt, o in zip(ENGINE_PROMPTS, out):
            assert o.token_ids == plain[tuple(prompt)], f"{type(drafter).__name__} changed {prompt}"
        assert sum(o.spec["num_draft_tokens"] for o in out) > 0
        assert sorted(llm.engine.scheduler.free_slots) == [0, 1, 2]
