"""The recurrent layers' CPU kernels (kernels/recurrent_kernels.c) against the PyTorch path they
replace, and the exactness they promise: a verify row's token computes the bits a decode step of
that token computes, so rolling back (by snapshot or by replay) leaves a slot's state, bit for
bit, as if only the accepted tokens had run, and speculative greedy output equals plain output.

Tiny random models in float32 (against the PyTorch path within float32 rounding) and bfloat16
(against the PyTorch path within bfloat16 rounding: both round where the reference rounds, in
other orders).
"""
import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.kernels import recurrent_kernels
from outpace.model.layers import ForwardBatch
from outpace.model.recurrent_rows import row_groups
from outpace.runner.model_runner import ModelRunner, Row
from outpace.weights.loader import load_model
from test_spec_lossless import OracleDrafter, RandomDrafter
from tiny import make_tiny, slot_state

MAX_LEN = 256
pytestmark = pytest.mark.skipif(not recurrent_kernels.serves(torch.zeros(1)), reason="no C compiler")


# DeltaNet heads of 144 values: the AVX-512 loops' blocks of 8 registers and a 1-register tail (the
# tiny models' heads of 8 values take the scalar loops)
WIDE_HEADS = dict(linear_key_head_dim=32, linear_value_head_dim=144)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5-wide", "lfm2"])
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    family, _, wide = request.param.partition("-")
    make_tiny(family, folder, dtype=torch.float32, **(WIDE_HEADS if wide else {}))
    return folder


@pytest.fixture
def pytorch_path(monkeypatch):
    """Within: the recurrent layers run their PyTorch ops."""
    def use(on: bool):
        if on:
            monkeypatch.setattr(recurrent_kernels, "serves", lambda *tensors: False)
        else:
            monkeypatch.undo()
    return use


def runner_for(model, num_slots=6, max_row_tokens=5, snapshots=True) -> ModelRunner:
    return ModelRunner(model, num_slots=num_slots, max_len=MAX_LEN, max_step_tokens=160,
                       max_verify_tokens=max_row_tokens, snapshots=snapshots)


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scenario(runner) -> list[torch.Tensor]:
    """Logits of: prompts cached in chunks (one longer than gated_deltanet.STEP_TOKENS), decode
    steps, a verify row committed in the middle, then ragged verify rows on scattered slots with
    two prompt chunks packed after them (one from position 0)."""
    prompts = {s: tokens(n, seed=s) for s, n in ((0, 30), (1, 12), (4, 21), (2, 17), (5, 9))}
    out = []
    for s in (0, 1, 4):
        p = prompts[s]
        for start in range(0, len(p) - 5, 11):
            runner.forward([Row(s, p[start:min(start + 11, len(p) - 5)], start)], logits="none")
    for s in (0, 1, 4):
        p = prompts[s]
        out.append(runner.forward([Row(s, p[-5:-4], len(p) - 5)])[0])
        out.append(runner.forward([Row(s, p[-4:], len(p) - 4)])[0])
        runner.cache.commit([s], [1])
    step = [Row(s, prompts[s][len(prompts[s]) - 2:][:n], len(prompts[s]) - 2) for s, n in ((0, 2), (1, 1), (4, 2))]
    runner.forward([Row(2, prompts[2][:8], 0)], logits="none")
    chunks = [Row(5, prompts[5], 0), Row(2, prompts[2][8:], 8)]
    logits, _ = runner.forward(step, chunks=chunks)
    runner.cache.commit([0, 1, 4], [1, 0, 0])
    out.append(logits)
    out.append(runner.forward([Row(2, [3], 17), Row(5, [4], 9)])[0])
    return out


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_kernels_match_pytorch_path(folder, pytorch_path, dtype, tolerance, snapshots, cpu_level):
    """At every instruction-set level, every kind of forward (prompt chunks, decode, verify and commit, ragged rows beside packed
    prompt chunks) gives the PyTorch path's logits (about 10 in size: a bfloat16 step is 0.0625,
    and bfloat16 roundings in another order move them by a step)."""
    model = load_model(folder, dtype, "cpu", max_len=MAX_LEN)
    pytorch_path(True)
    want = scenario(runner_for(model, snapshots=snapshots))
    pytorch_path(False)
    got = scenario(runner_for(model, snapshots=snapshots))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_layers_match_pytorch_path(folder, pytorch_path, dtype, tolerance, snapshots):
    """A recurrent layer alone, its weights redrawn or scaled so that its output is about 1 in size
    (a tiny model's layers add little to the residual stream, which would hide their errors in the
    logits): a prompt chunk, a decode step, a verify forward and its commit give the PyTorch path's
    outputs and leave its convolution history and states, within rounding (relative to size)."""
    model = load_model(folder, dtype, "cpu", max_len=MAX_LEN)
    layer = next(layer for layer in model.layers if not layer.is_attention)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.mixer.parameters():          # convolution taps, decays, norm weights
            p.copy_(torch.randn_like(p) * 0.7)
        layer.mixer.in_proj.packed.mul_(6)          # the projections, in their packed layout
        layer.mixer.out.packed.mul_(30)
    results = []
    for on in (True, False):
        pytorch_path(on)
        cache = model.make_cache(3, MAX_LEN, dtype, "cpu", max_row_tokens=4, snapshots=snapshots).state
        outs = []
        for start, width, logits in ((0, 11, False), (11, 1, True), (12, 4, True)):
            positions = start + torch.arange(width)[None].expand(2, -1)
            batch = ForwardBatch(input_ids=torch.zeros(2, width, dtype=torch.long), positions=positions,
                                 slots=torch.tensor([2, 0]), kv_len=start + width, logits=logits)
            x = torch.randn(2, width, model.cfg.hidden_size, generator=torch.Generator().manual_seed(start))
            outs.append(layer.mixer(x.to(dtype), row_groups(batch, cache), cache, 0))
        cache.commit([2, 0], [1, 3])
        results.append((outs, [cache.conv[0]] + ([cache.state[0]] if cache.state[0] is not None else [])))
    (want, want_cache), (got, got_cache) = results
    for g, w in zip(got + got_cache, want + want_cache):
        assert float(w.abs().max()) > 0.3
        torch.testing.assert_close(g.float(), w.float(), atol=tolerance * float(w.abs().max()), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_rollback_is_bit_exact(folder, dtype, snapshots, cpu_level):
    """Verify 1 + k tokens on several rows, commit n drafts (0, some, all): every slot's
    convolution window, delta-rule state and next logits equal a plain run of its first n + 1
    tokens one by one, bit for bit."""
    model = load_model(folder, dtype, "cpu", max_len=MAX_LEN)
    slots = [0, 2, 3]
    prompts = {s: tokens(11 + s, seed=20 + s) for s in slots}
    for k, accepted in ((1, [0, 1, 1]), (4, [0, 2, 4])):
        runner, plain = runner_for(model, max_row_tokens=k + 1, snapshots=snapshots), runner_for(model)
        verify, next_rows = [], []
        for s, n in zip(slots, accepted):
            p = prompts[s]
            for r in (runner, plain):
                r.forward([Row(s, p[:-1], 0)], logits="none")
            row = [p[-1]] + tokens(k, seed=30 + s + k)
            verify.append(Row(s, row, len(p) - 1))
            for j in range(n + 1):
                plain.forward([Row(s, row[j:j + 1], len(p) - 1 + j)])
            next_rows.append(Row(s, [7], len(p) + n))
        runner.forward(verify)
        runner.cache.commit(slots, accepted)
        for s in slots:
            for got, want in zip(slot_state(runner.cache.state, s), slot_state(plain.cache.state, s)):
                assert torch.equal(got, want)
        got, _ = runner.forward(next_rows)
        assert torch.equal(got, torch.cat([plain.forward([r])[0] for r in next_rows]))


def test_float32_prompt_chunks_of_a_bfloat16_model(folder, pytorch_path):
    """A bfloat16 model's long prompt chunks may compute in float32 (ModelRunner.prefill_dtype)
    while the convolution history stays bfloat16: the kernels read and write it in its own dtype."""
    model = load_model(folder, torch.bfloat16, "cpu", max_len=MAX_LEN)
    prompt = tokens(140, seed=60)
    outs = []
    for on in (True, False):
        pytorch_path(on)
        runner = runner_for(model)
        runner.prefill_dtype = torch.float32
        runner.forward([Row(1, prompt[:-1], 0)], logits="none")
        outs.append(runner.forward([Row(1, prompt[-1:], 139)])[0])
    torch.testing.assert_close(outs[1], outs[0], atol=0.15, rtol=0)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_speculation_is_bit_exact_in_bfloat16(tmp_path, default_model_dir, snapshots):
    """The engine in bfloat16 on the kernels: whatever the drafter proposes (the truth, the truth
    corrupted after two tokens, random tokens), greedy output equals plain greedy output."""
    make_tiny("qwen3_5-vl", tmp_path, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.bfloat16)
    options = dict(dtype="bfloat16", device="cpu", max_num_seqs=3, max_model_len=128, max_prefill_tokens=8,
                   calibrate=False, recurrent_snapshots=snapshots)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = {tuple(p): o.token_ids for p, o in zip(PROMPTS, LLM(str(tmp_path), spec="none", **options)
                                                     .generate(PROMPTS, params))}
    for drafter in (OracleDrafter(plain), OracleDrafter(plain, corrupt_after=2), RandomDrafter(49152)):
        llm = LLM(str(tmp_path), spec=SpecConfig(num_draft_tokens=4), drafter=drafter, **options)
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
            assert out.token_ids == plain[tuple(prompt)]
