"""The compiled CPU kernels (outpace.kernels.cpu_kernels) against PyTorch's ops and transformers.

They replace the norms, rotation, cache writes, attention and SwiGLU of small CPU steps, so they
must give the reference's logits in float32, round as PyTorch's ops round in bfloat16, give each
token the same result whatever else the call holds, attend within a sliding window and the
token's own slot, and fall back to PyTorch's ops where no compiler builds them. Every test runs
once per instruction-set level this machine executes (the cpu_level fixture)."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from outpace.runner import model_runner
from outpace.runner.model_runner import ModelRunner, Row
from outpace.kernels import cpu_kernels
from outpace.kernels.fused import _rms_norm
from outpace.model.decoder import DecoderLM
from outpace.weights.loader import load_model
from tiny import FAMILIES, make_tiny

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the kernels cannot build here"),
              pytest.mark.usefixtures("cpu_level")]

BF16_ULP = 2.0 ** -7      # relative spacing of bfloat16 values


def spy_attention(monkeypatch) -> list[int]:
    """The tokens of each layer's attention kernel call from here on: per layer (rope_attend from
    Python) or inside a DecoderStack call (one entry a layer)."""
    calls = []
    monkeypatch.setattr(cpu_kernels, "rope_attend",
                        lambda qkv, *a, _f=cpu_kernels.rope_attend, **k: calls.append(len(qkv)) or _f(qkv, *a, **k))
    stack = cpu_kernels.DecoderStack.__call__
    monkeypatch.setattr(cpu_kernels.DecoderStack, "__call__",
                        lambda self, h, *a: calls.extend([len(h)] * len(self.array)) or stack(self, h, *a))
    return calls


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of b's bfloat16 spacing."""
    scale = b.float().abs().clamp_min(1e-3) * BF16_ULP
    return ((a.float() - b.float()).abs() / scale).max().item()


def test_kernels_build(cpu_level):
    assert cpu_kernels.level() == cpu_level


@pytest.mark.parametrize("cols", [5, 16, 49, 49152])
def test_argmax_picks_as_torch_does(cols):
    """The greedy token of each row: ties go to the first maximum, a row with NaNs to its first
    NaN, a row of -inf to 0, in rows shorter and longer than a vector and not a multiple of it."""
    g = torch.Generator().manual_seed(cols)
    rows = [torch.randn(cols, generator=g), torch.randint(0, 3, (cols,), generator=g).float(),
            torch.full((cols,), -float("inf")), torch.zeros(cols)]
    for at in {0, cols // 2, cols - 1}:
        nan = torch.randint(0, 3, (cols,), generator=g).float()
        nan[at] = float("nan")
        nan[-1] = float("nan")
        tied = torch.randn(cols, generator=g)
        tied[at] = tied[-1] = tied.max() + 1
        rows += [nan, tied]
    x = torch.stack(rows)
    assert cpu_kernels.argmax(x).tolist() == x.argmax(-1).tolist()
    many = torch.randn(40, cols, generator=g)        # enough values to share rows among threads
    assert torch.equal(cpu_kernels.argmax(many), many.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_and_silu_mul_follow_torch(dtype):
    g = torch.Generator().manual_seed(0)
    h, delta = (torch.randn(5, 576, generator=g).to(dtype) for _ in range(2))
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    h_out, x = cpu_kernels.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h_out, h + delta)
    expected = _rms_norm(h + delta, weight, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(x, expected, atol=1e-6, rtol=1e-5)
    else:
        assert ulps(x, expected) <= 1.01       # the norm's sum may round its last bit otherwise
    same, x_alone = cpu_kernels.add_rms_norm(h, None, weight, 1e-5)
    assert same is h and torch.equal(x_alone, cpu_kernels.add_rms_norm(h, None, weight, 1e-5)[1])

    gate_up = (torch.randn(3, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got, expected = cpu_kernels.silu_mul(gate_up), F.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    else:
        assert ulps(got, expected) <= 1.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_body_and_scalar_tail_compute_alike(dtype):
    # 16 values a vector, the 17th in the scalar tail: the same inputs give the same outputs
    # (exp's polynomial, its scale at both ends of the clamped range, the norm's rounding)
    gate = torch.tensor([-100.0, -88.5, -87.0, -30.0, -2.5, -1e-3, 0.0, 1e-3,
                         0.7, 3.0, 9.0, 30.0, 60.0, 87.5, 88.6, 100.0])
    for value in gate.tolist():
        g = torch.cat([gate, torch.tensor([value])])
        up = torch.full((17,), 1.5)
        out = cpu_kernels.silu_mul(torch.cat([g, up])[None].to(dtype))[0]
        assert torch.equal(out[16], out[gate.tolist().index(value)])
    h = torch.linspace(-3, 3, 17).to(dtype)[None]
    weight = torch.linspace(0.5, 1.5, 17).to(dtype)
    x = cpu_kernels.add_rms_norm(h, None, weight, 1e-5)[1][0]
    expected = _rms_norm(h, weight, 1e-5)[0]
    assert ulps(x, expected) <= 1.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 700])       # 700: shared among threads
def test_rope_equals_torch_bit_for_bit(dtype, tokens):
    """The query and key heads of a qkv product (a strided slice) rotated as fused.rope does."""
    from outpace.kernels.fused import _rope
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, tokens, 9 + 2 * 3, 64, generator=g).to(dtype)
    cos, sin = (torch.randn(1, tokens, 1, 64, generator=g).to(dtype) for _ in range(2))
    qk = qkv[..., :12, :]
    got = cpu_kernels.rope(qk, cos, sin)
    assert got.shape == qk.shape and torch.equal(got, _rope(qk, cos, sin))


def reference_attention(qkv, heads, cos, sin, k_cache, v_cache, slots, positions, window):
    """rope_attend with PyTorch's ops, on copies of the caches: (output, k_cache, v_cache)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    KVH, L, D = k_cache.shape[1:]
    T = positions.numel()
    qkv = qkv.reshape(T, heads + 2 * KVH, D)
    rotated = qkv[:, :heads + KVH] * cos + qkv[:, :heads + KVH].roll(D // 2, -1) * sin      # [T, heads+KVH, D]
    token_slots = slots.repeat_interleave(T // slots.numel())
    for t in range(T):
        k_cache[token_slots[t], :, positions[t]] = rotated[t, heads:]
        v_cache[token_slots[t], :, positions[t]] = qkv[t, heads + KVH:]
    keys = torch.arange(L)
    seen = keys[None, :] <= positions[:, None]
    if window:
        seen &= keys[None, :] > positions[:, None] - window
    out = F.scaled_dot_product_attention(rotated[:, None, :heads].transpose(1, 2), k_cache[token_slots],
                                         v_cache[token_slots], attn_mask=seen[:, None, None, :], enable_gqa=True)
    return out.reshape(T, heads * D), k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (4, 4, 16, None), (8, 2, 128, 5),
                                                       (6, 2, 24, None)])
def test_rope_attend_equals_masked_attention(dtype, heads, kv_heads, dim, window):
    """Rows of several tokens on scattered slots, each token over its own slot's keys up to its
    position (within the window); stale cache entries past it must not count."""
    g = torch.Generator().manual_seed(1)
    slots_n, L = 5, 40
    k_cache = torch.randn(slots_n, kv_heads, L, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots_n, kv_heads, L, dim, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 4])
    positions = torch.tensor([[10, 11], [0, 1], [30, 31]])
    qkv = torch.randn(3, 2, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = positions[..., None].float() * torch.linspace(0.1, 1.0, dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)[:, :, None]
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)[:, :, None]
    expected, k_expected, v_expected = reference_attention(qkv, heads, cos.reshape(6, 1, dim), sin.reshape(6, 1, dim),
                                                           k_cache, v_cache, slots, positions.flatten(), window)
    out = cpu_kernels.rope_attend(qkv, heads, cos, sin, k_cache, v_cache, slots, positions, window)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (3, 1, 128, 700), (15, 5, 32, None),
                                                       (8, 2, 64, None)])
def test_rope_attend_long_contexts_equal_masked_attention(dtype, heads, kv_heads, dim, window):
    """Rows of a thousand keys and more, and across 512, on scattered slots; one, two, three and
    five key/value heads; a window that still holds hundreds."""
    g = torch.Generator().manual_seed(3)
    L = 1300
    k_cache = torch.randn(2, kv_heads, L, dim, generator=g).to(dtype)
    v_cache = torch.randn(2, kv_heads, L, dim, generator=g).to(dtype)
    slots = torch.tensor([1, 0])
    positions = torch.tensor([[507, 508, 509, 510, 511, 512], [1200, 1201, 1202, 1203, 1204, 1205]])
    qkv = torch.randn(2, 6, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = positions[..., None].float() * torch.linspace(0.1, 1.0, dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)[:, :, None]
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)[:, :, None]
    expected, k_expected, v_expected = reference_attention(qkv, heads, cos.reshape(12, 1, dim),
                                                           sin.reshape(12, 1, dim), k_cache, v_cache, slots,
                                                           positions.flatten(), window)
    out = cpu_kernels.rope_attend(qkv, heads, cos, sin, k_cache, v_cache, slots, positions, window)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,window,tokens,start", [
    (6, 2, 32, None, 4, 300), (9, 3, 64, 37, 12, 300), (32, 2, 64, None, 3, 300), (6, 2, 24, 20, 5, 300),
    (9, 3, 64, None, 70, 300), (9, 3, 64, None, 12, 505), (6, 3, 128, 600, 5, 900), (9, 3, 64, None, 70, 480)])
def test_each_token_computes_alike_in_any_call(dtype, heads, kv_heads, dim, window, tokens, start):
    """What exact mode rests on: a token's output does not depend on the other tokens of the call
    (a row of several tokens, split into several pieces of work or not, in the longer runs of a
    call of more than 64 tokens; a window; one query head a group or many; past 512 keys), nor on
    how the call's work was shared among threads (300 keys make it parallel)."""
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(1, kv_heads, start + 100, dim, generator=g).to(dtype)
    v_cache = torch.randn(1, kv_heads, start + 100, dim, generator=g).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    cos, sin = (torch.rand(tokens, 1, dim, generator=g).to(dtype) for _ in range(2))
    positions, slot = torch.arange(start, start + tokens), torch.tensor([0])
    together = cpu_kernels.rope_attend(qkv, heads, cos, sin, k_cache, v_cache, slot, positions, window)
    for t in range(tokens):
        alone = cpu_kernels.rope_attend(qkv[t:t + 1], heads, cos[t:t + 1], sin[t:t + 1], k_cache, v_cache, slot,
                                        positions[t:t + 1], window)
        assert torch.equal(alone[0], together[t])
    h = torch.randn(4, 64, generator=g).to(dtype)
    weight = torch.rand(64, generator=g).to(dtype)
    rows = cpu_kernels.add_rms_norm(h, h, weight, 1e-6)[1]
    assert all(torch.equal(cpu_kernels.add_rms_norm(h[t:t + 1], h[t:t + 1], weight, 1e-6)[1][0], rows[t])
               for t in range(4))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernel_steps_match_reference(family, tmp_path):
    """A float32 prompt, decode steps and verify rows through the kernels give transformers'
    logits, on every family (attention bias, q/k norms, tied embeddings, rope variants)."""
    ref = make_tiny(family, tmp_path)
    ours = load_model(tmp_path, torch.float32, "cpu", max_len=512)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    runner = ModelRunner(ours, num_slots=3, max_len=512, max_step_tokens=64)
    assert cpu_kernels.attention_fits(ours.cfg, torch.float32, runner.device)
    tokens = ids[0].tolist()
    got = [runner.forward([Row(2, tokens[:12], 0)])[0][0]]
    for start in range(12, 18):
        got.append(runner.forward([Row(2, [tokens[start]], start)])[0][0])
    got.append(runner.forward([Row(2, tokens[18:30], 18)])[0][0])
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_batches_equal_torch_steps(dtype, tmp_path, monkeypatch):
    """Batched rows (one length: a [B, S] batch, of one token: the attention kernel; ragged:
    packed) on scattered slots, through the kernels and through PyTorch's ops, give the same
    logits up to rounding."""
    make_tiny("qwen2", tmp_path)
    model = load_model(tmp_path, dtype, "cpu", max_len=512)
    g = torch.Generator().manual_seed(4)
    prompts = {s: torch.randint(0, 256, (n,), generator=g).tolist() for s, n in ((0, 20), (3, 9), (5, 33))}

    def run(use_kernels: bool):
        monkeypatch.setattr(cpu_kernels, "attention_fits",
                            lambda *a, _f=cpu_kernels.attention_fits: use_kernels and _f(*a))
        runner = ModelRunner(model, num_slots=6, max_len=512, max_step_tokens=64)
        for s, p in prompts.items():
            runner.forward([Row(s, p[:-4], 0)], logits="none")
        same = runner.forward([Row(s, p[-4:-2], len(p) - 4) for s, p in prompts.items()])[0]
        single = runner.forward([Row(s, p[-2:-1], len(p) - 2) for s, p in prompts.items()])[0]
        ragged = runner.forward([Row(s, p[-1:] if s else p[-1:] + [7, 8], len(p) - 1) for s, p in prompts.items()])[0]
        return same, single, ragged
    for a, b in zip(run(True), run(False)):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


def test_many_rows_verify_through_the_kernels(tmp_path, monkeypatch):
    """A verify forward of many rows of a few tokens (as at 32 clients) runs in one kernel call a
    layer, and each row's logits equal the row's forward alone bit for bit (float32)."""
    make_tiny("llama", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu", max_len=256)
    rows_n = 17
    g = torch.Generator().manual_seed(8)
    lengths = torch.randint(10, 60, (rows_n,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    runner = ModelRunner(model, num_slots=rows_n, max_len=256, max_step_tokens=256)
    for s, p in enumerate(prompts):
        runner.forward([Row(s, p[:-5], 0)], logits="none")
    rows = [Row(s, p[-5:], len(p) - 5) for s, p in enumerate(prompts)]
    calls = spy_attention(monkeypatch)
    together = runner.forward(rows)[0]
    assert calls == [5 * rows_n] * model.cfg.num_layers
    for b, row in enumerate(rows):
        assert torch.equal(runner.forward([row])[0][0], together[b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,fields", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 6})])
def test_stacked_layers_compute_as_the_layers_do(dtype, family, fields, tmp_path, monkeypatch):
    """A CPU model of plain decoder layers runs them all in one DecoderStack call, whose logits
    and kept hidden states equal the layers' own forwards bit for bit: a prompt, packed rows of
    unequal lengths on scattered slots, a decode row beside a prompt chunk; with attention biases
    (qwen2) and a sliding window too."""
    make_tiny(family, tmp_path, **fields)
    model = load_model(tmp_path, dtype, "cpu", max_len=256)
    g = torch.Generator().manual_seed(11)
    p0, p1, p2 = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 20, 9))

    def run():
        runner = ModelRunner(model, num_slots=4, max_len=256, max_step_tokens=64)
        return [runner.forward([Row(1, p0[:20], 0)], hidden_layers=(0, 1)),
                runner.forward([Row(3, p1[:12], 0)]),
                runner.forward([Row(1, p0[20:21], 20), Row(3, p1[12:15], 12)], hidden_layers=(1,)),
                runner.forward([Row(1, p0[21:22], 21)], chunks=[Row(0, p2, 0)])]
    calls = spy_attention(monkeypatch)
    stacked = run()
    assert calls == [20, 20, 12, 12, 4, 4, 10, 10] and model.cpu_stack(dtype) is not None
    monkeypatch.setattr(DecoderLM, "cpu_stack", lambda self, dtype: None)
    layered = run()
    for (logits, hidden), (expected, expected_hidden) in zip(stacked, layered):
        assert torch.equal(logits, expected)
        assert (hidden is None) == (expected_hidden is None)
        assert hidden is None or torch.equal(hidden, expected_hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_the_logits_argmax(dtype, tmp_path):
    """forward(logits='tokens'), which greedy steps take, gives each real token the argmax of
    its logits, for packed rows of unequal lengths and for a [B, 1] batch."""
    make_tiny("llama", tmp_path)
    model = load_model(tmp_path, dtype, "cpu", max_len=256)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 12, 45)]
    runner = ModelRunner(model, num_slots=3, max_len=256, max_step_tokens=64)
    for s, p in enumerate(prompts):
        runner.forward([Row(s, p[:-4], 0)], logits="none")
    for rows in ([Row(s, p[-4:-4 + n], len(p) - 4) for (s, p), n in zip(enumerate(prompts), (1, 4, 2))],
                 [Row(s, p[-4:-3], len(p) - 4) for s, p in enumerate(prompts)]):
        logits = runner.forward(rows)[0]
        tokens = runner.forward(rows, logits="tokens")[0]
        assert tokens.shape == logits.shape[:2] and tokens.dtype == torch.int64
        for b, row in enumerate(rows):
            n = len(row.token_ids)
            assert torch.equal(tokens[b, :n], logits[b, :n].argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_beside_prompt_chunks_compute_as_alone(family, tmp_path, monkeypatch):
    """Decode and verify rows in a forward that also caches prompt chunks attend through the
    attention kernel, the chunks' tokens in the same call: in float32 (products by the
    row-independent kernel) the rows' logits equal, bit for bit, a forward of the rows alone, and
    the chunks fill the cache as a forward of their own."""
    make_tiny(family, tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu", max_len=512)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 30, 40, 25)]
    runner = ModelRunner(model, num_slots=4, max_len=512, max_step_tokens=64)
    for slot in (0, 1):
        runner.forward([Row(slot, prompts[slot][:-3], 0)], logits="none")
    runner.forward([Row(2, prompts[2][:10], 0)], logits="none")
    rows = [Row(0, prompts[0][-3:], 17), Row(1, prompts[1][-3:-2], 27)]
    alone = runner.forward(rows)[0]
    calls = spy_attention(monkeypatch)
    joined = runner.forward(rows, chunks=[Row(2, prompts[2][10:-1], 10), Row(3, prompts[3][:-1], 0)])[0]
    assert torch.equal(joined, alone)
    # every layer's rows (their 4 tokens) and chunks (29 and 24) in one kernel call
    assert calls == [4 + 29 + 24] * model.cfg.num_layers
    fresh = ModelRunner(model, num_slots=4, max_len=512, max_step_tokens=64)
    for slot in (2, 3):
        p = prompts[slot]
        fresh.forward([Row(slot, p[:-1], 0)], logits="none")
        last = [Row(slot, p[-1:], len(p) - 1)]
        assert torch.equal(runner.forward(last)[0], fresh.forward(last)[0])


def test_rows_beside_float32_prompt_chunks(tmp_path, monkeypatch):
    """Where a bfloat16 model's long prompt chunks compute in float32 (a CPU without AVX512_BF16),
    the rows beside them still attend through the kernel, in the caches' dtype, and the chunks
    through PyTorch; the rows' logits stay those of a forward of the rows alone up to rounding."""
    make_tiny("llama", tmp_path)
    model = load_model(tmp_path, torch.bfloat16, "cpu", max_len=512)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 30, 40)]
    runner = ModelRunner(model, num_slots=3, max_len=512, max_step_tokens=64)
    runner.prefill_dtype = torch.float32
    monkeypatch.setattr(model_runner, "FP32_PREFILL_MIN_TOKENS", 16)
    for slot in (0, 1):
        runner.forward([Row(slot, prompts[slot][:-3], 0)], logits="none")
    rows = [Row(0, prompts[0][-3:], 17), Row(1, prompts[1][-3:-2], 27)]
    alone = runner.forward(rows)[0]
    calls = []
    monkeypatch.setattr(cpu_kernels, "rope_attend", lambda *a, _f=cpu_kernels.rope_attend: calls.append(a) or _f(*a))
    joined = runner.forward(rows, chunks=[Row(2, prompts[2], 0)])[0]
    assert len(calls) == model.cfg.num_layers and all(len(a[0]) == 4 for a in calls)
    torch.testing.assert_close(joined, alone, atol=0.1, rtol=0.05)


def test_without_a_compiler_steps_use_torch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
    cpu_kernels.reload()
    try:
        assert cpu_kernels.level() is None
        assert "CPU kernels off" in capsys.readouterr().err
        make_tiny("llama", tmp_path / "model")
        model = load_model(tmp_path / "model", torch.float32, "cpu", max_len=64)
        assert not cpu_kernels.attention_fits(model.cfg, torch.float32, torch.device("cpu"))
        logits, _ = ModelRunner(model, num_slots=1, max_len=64, max_step_tokens=8).forward([Row(0, [1, 2, 3], 0)])
        assert torch.isfinite(logits).all()
    finally:
        cpu_kernels.reload()
