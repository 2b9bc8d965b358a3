"""The model runtime matches transformers' own implementation of each family."""
import os

import pytest
import torch

from outpace.runner.kv_cache import KVCache
from outpace.runner.model_runner import FP32_PREFILL_MIN_TOKENS, ModelRunner, Row
from outpace.weights.loader import load_model
from tiny import FAMILIES, make_tiny


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = make_tiny(request.param, folder, dtype=torch.float64)
    ours = load_model(folder, torch.float64, "cpu", max_len=512)
    return ref, ours


def test_prompt_forward_matches_reference(pair):
    ref, ours = pair
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    runner = ModelRunner(ours, num_slots=1, max_len=512, max_step_tokens=64)
    logits, _ = runner.forward([Row(0, ids[0].tolist(), 0)])
    torch.testing.assert_close(logits[0].double(), expected, atol=1e-6, rtol=1e-5)


def test_cached_decode_matches_reference(pair):
    """Step-by-step decoding through the KV cache gives the logits of a full forward."""
    ref, ours = pair
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    runner = ModelRunner(ours, num_slots=2, max_len=512, max_step_tokens=64)
    runner.forward([Row(1, ids[0, :10].tolist(), 0)], logits="none")
    for pos in range(10, 24):
        logits, _ = runner.forward([Row(1, [ids[0, pos].item()], pos)])
        torch.testing.assert_close(logits[0, 0].double(), expected[pos], atol=1e-6, rtol=1e-5)


def test_ragged_batch_equals_rows_alone(pair):
    """Rows of different lengths and positions in one forward (packed: the linears see only real
    tokens) give each row's own logits, whichever slots they sit in; so do prompt chunks."""
    _, ours = pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 30, 15)]
    slots, tails = [0, 1, 5], {0: 1, 1: 18, 5: 3}     # 18: padding enough to split attention
    runner = ModelRunner(ours, num_slots=6, max_len=512, max_step_tokens=64)
    alone = {}
    for slot, p in zip(slots, prompts):
        n = tails[slot]
        runner.forward([Row(slot, p[:-n], 0)], logits="none")
        alone[slot] = runner.forward([Row(slot, p[-n:], len(p) - n)])[0][0]
    # the same last rows again, batched, overwriting the same positions: 5, 0, 1 reads slots 0..5
    # as one view (2..4 idle), 1, 5 and 5, 0 gather each row's cache (their range is too wide for
    # two rows), 0, 1 is a plain view
    last = dict(zip(slots, prompts))
    for order in ([5, 0, 1], [1, 5], [5, 0], [0, 1]):
        batched, _ = runner.forward([Row(s, last[s][-tails[s]:], len(last[s]) - tails[s]) for s in order])
        for i, s in enumerate(order):
            torch.testing.assert_close(batched[i, :tails[s]], alone[s], atol=1e-9, rtol=1e-9)
    # prompt chunks of different lengths in one forward fill the cache as each alone did
    runner.forward([Row(s, p[:-tails[s]], 0) for s, p in zip(slots, prompts)], logits="none")
    batched, _ = runner.forward([Row(s, last[s][-tails[s]:], len(last[s]) - tails[s]) for s in slots])
    for i, s in enumerate(slots):
        torch.testing.assert_close(batched[i, :tails[s]], alone[s], atol=1e-9, rtol=1e-9)


def test_rows_of_one_length_from_the_start_equal_rows_alone(pair):
    """Rows of one length from position 0 (a trainer's padded batch, prompts of equal length) in
    one forward give each row's own logits: in consecutive slots (one causal attention, no mask)
    and scattered over a slot range (idle slots between them)."""
    _, ours = pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (12,), generator=g).tolist() for _ in range(2)]
    runner = ModelRunner(ours, num_slots=4, max_len=512, max_step_tokens=64)
    alone = [runner.forward([Row(0, p, 0)])[0][0] for p in prompts]
    for slots in ([0, 1], [2, 0]):
        batched, _ = runner.forward([Row(s, p, 0) for s, p in zip(slots, prompts)])
        for i in range(2):
            torch.testing.assert_close(batched[i], alone[i], atol=1e-9, rtol=1e-9)


def test_prompt_chunks_cache_inside_a_decode_forward(pair):
    """Prompt chunks riding in a decode forward (one from position 0, one continuing its prompt)
    fill the cache as a forward of their own does, and the decode rows' logits are their own."""
    _, ours = pair
    g = torch.Generator().manual_seed(5)
    prompts = {s: torch.randint(0, 256, (n,), generator=g).tolist() for s, n in ((0, 9), (2, 20), (3, 12), (4, 26))}
    rows = {0: 1, 2: 4}                           # decode rows: slot -> tokens in the step
    runner = ModelRunner(ours, num_slots=5, max_len=512, max_step_tokens=64)
    alone = {}
    for s, n in rows.items():
        p = prompts[s]
        runner.forward([Row(s, p[:-n], 0)], logits="none")
        alone[s] = runner.forward([Row(s, p[-n:], len(p) - n)])[0][0]
    runner.forward([Row(4, prompts[4][:10], 0)], logits="none")
    step_rows = [Row(s, prompts[s][-n:], len(prompts[s]) - n) for s, n in rows.items()]
    chunks = [Row(3, prompts[3][:-1], 0), Row(4, prompts[4][10:-1], 10)]
    mixed, _ = runner.forward(step_rows, chunks=chunks)
    assert mixed.shape[:2] == (2, 4)
    for i, (s, n) in enumerate(rows.items()):
        torch.testing.assert_close(mixed[i, :n], alone[s], atol=1e-9, rtol=1e-9)
    # the chunks' caches: the prompts' last tokens decode as after a forward of their own
    fresh = ModelRunner(ours, num_slots=5, max_len=512, max_step_tokens=64)
    for s in (3, 4):
        p = prompts[s]
        fresh.forward([Row(s, p[:-1], 0)], logits="none")
        expected = fresh.forward([Row(s, p[-1:], len(p) - 1)])[0][0]
        got = runner.forward([Row(s, p[-1:], len(p) - 1)])[0][0]
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_long_chunk_beside_bf16_rows(tmp_path, monkeypatch, bf16_dot, cpu_level):
    """A chunk long enough to make the forward float32 (bf16 weights on a CPU without bf16 dot
    products) leaves the decode rows beside it computing as bf16 rows do, up to the rounding of
    their float32 products; where the chunk stays bf16 (cpu_kernels' products on vdpbf16ps), the
    rows beside it compute bit for bit as alone."""
    from outpace.kernels import cpu_kernels
    if bf16_dot and not cpu_kernels.has_bf16_dot():
        pytest.skip("cpu_kernels.linear has no bf16 dot products here")
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: bf16_dot)
    make_tiny("llama", tmp_path, dtype=torch.bfloat16)
    model = load_model(tmp_path, torch.bfloat16, "cpu", max_len=512)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 30, 200)]
    runner = ModelRunner(model, num_slots=3, max_len=512, max_step_tokens=256)
    for slot, p in enumerate(prompts[:2]):
        runner.forward([Row(slot, p[:-3], 0)], logits="none")
    rows = [Row(slot, p[-3:], len(p) - 3) for slot, p in enumerate(prompts[:2])]
    alone, _ = runner.forward(rows)
    joined, _ = runner.forward(rows, chunks=[Row(2, prompts[2][:-1], 0)])
    assert len(prompts[2]) - 1 >= FP32_PREFILL_MIN_TOKENS
    if bf16_dot:
        assert runner.prefill_dtype is None and torch.equal(joined, alone)
    else:
        assert runner.prefill_dtype is torch.float32
        torch.testing.assert_close(joined, alone, atol=0.1, rtol=0.05)
        assert (joined.argmax(-1) == alone.argmax(-1)).float().mean() > 0.8
    fresh = ModelRunner(model, num_slots=3, max_len=512, max_step_tokens=256)
    fresh.forward([Row(2, prompts[2][:-1], 0)], logits="none")
    last = [Row(2, prompts[2][-1:], len(prompts[2]) - 1)]
    torch.testing.assert_close(runner.forward(last)[0], fresh.forward(last)[0], atol=1e-3, rtol=1e-3)


def test_exact_mode_prompt_cache_does_not_depend_on_chunking(tmp_path, monkeypatch, cpu_level):
    """In exact mode a prompt cached in one chunk or in several leaves the same cache, bit for bit,
    on a bfloat16 model where long chunks would otherwise compute in float32 (no bf16 dot
    products): how a load chunks prompts must not change exact mode's tokens."""
    from outpace.kernels import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: False)
    make_tiny("llama", tmp_path, dtype=torch.bfloat16)
    model = load_model(tmp_path, torch.bfloat16, "cpu", max_len=512)
    prompt = torch.randint(0, 256, (201,), generator=torch.Generator().manual_seed(8)).tolist()
    last = [Row(0, prompt[-1:], len(prompt) - 1)]
    logits = []
    for cuts in ([0, 200], [0, 150, 200], [0, 40, 200]):
        runner = ModelRunner(model, num_slots=1, max_len=512, max_step_tokens=256, exact_width=3)
        for a, b in zip(cuts, cuts[1:]):
            runner.forward([Row(0, prompt[a:b], a)], logits="none")
        logits.append(runner.forward(last)[0])
    assert all(torch.equal(logits[0], other) for other in logits[1:])


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux's /proc")
def test_cpu_kv_cache_pages_arrive_as_written():
    """A CPU cache of the default model's shape (0.47 GB) takes memory as positions are written:
    a request's first 64 positions in a fresh slot, not that slot's whole 120 MB (huge pages)."""
    before = _resident_bytes()
    cache = KVCache(30, 8, 3, 2560, 64, torch.bfloat16)
    assert _resident_bytes() - before < 8 << 20
    cache.k[:, 5, :, :64] = 1
    cache.v[:, 5, :, :64] = 1
    assert _resident_bytes() - before < 16 << 20
    assert cache.k[:, 4].abs().sum() == 0 and cache.v[:, 5, :, 64:].abs().sum() == 0


def test_hidden_states_are_each_layers_output(pair):
    """hidden_layers gives each asked layer's output, the residual stream before the next norm."""
    ref, ours = pair
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(ids, output_hidden_states=True).hidden_states       # embeddings, then each layer's
    runner = ModelRunner(ours, num_slots=1, max_len=512, max_step_tokens=64)
    last = ours.cfg.num_layers - 1
    _, hidden = runner.forward([Row(0, ids[0].tolist(), 0)], hidden_layers=tuple(range(last + 1)))
    assert hidden.shape == (1, 12, last + 1, ours.cfg.hidden_size)
    for i in range(last):
        torch.testing.assert_close(hidden[0, :, i], expected[i + 1][0], atol=1e-6, rtol=1e-5)
    # transformers' last hidden state is after the final norm: apply ours to compare
    torch.testing.assert_close(ours.norm(hidden[0, :, last]), expected[-1][0], atol=1e-6, rtol=1e-5)


def test_packed_cpu_linear_is_bit_identical(monkeypatch):
    """bf16 linears packed for oneDNN (where the CPU kernels do not build) give F.linear's
    products bit for bit, for any row count."""
    from outpace.kernels import cpu_kernels, cpu_linear
    if not cpu_linear._onednn_bf16_works():
        pytest.skip("oneDNN's bfloat16 products do not run on this CPU")
    monkeypatch.setattr(cpu_kernels, "has_library", lambda: False)
    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    packed = cpu_linear.PackedLinear(linear)
    assert not packed.kernel
    for rows in (1, 3, 9, 33):
        x = torch.randn(2, rows, 96, generator=g).to(torch.bfloat16)
        assert torch.equal(packed(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
        # a float32 input (a prompt chunk computed in float32) takes the widened weight
        assert torch.equal(packed(x.float()), torch.nn.functional.linear(x.float(), linear.weight.float(),
                                                                        linear.bias.float()))


def test_cpu_kernel_linear_sums_in_order(cpu_level):
    """cpu_kernels.linear, bfloat16: each output is x's products with the weight summed in input
    order in float32 (products of bf16 values are exact there; with vdpbf16ps each pair of inputs
    adds its odd input's product first), plus the bias, rounded once to bf16: bit for bit, whatever
    the rows beside it. Shapes cover a partial last block of 16 columns and rows split into several
    tiles; F.linear (oneDNN, which sums in another order for some row and thread counts) agrees to
    within a bf16 step. At every instruction-set level."""
    from outpace.kernels import cpu_kernels, cpu_linear
    g = torch.Generator().manual_seed(5)
    for n_in, n_out, bias in ((96, 160, True), (576, 1000, False), (64, 37, True)):
        linear = torch.nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)
        packed = cpu_linear.PackedLinear(linear)
        assert packed.kernel
        w = linear.weight.float()
        for rows in (1, 3, 13, 33):
            x = torch.randn(rows, n_in, generator=g).to(torch.bfloat16)
            expected = torch.zeros(rows, n_out)
            order = [k ^ 1 if cpu_kernels.has_bf16_dot() else k for k in range(n_in)]
            for k in order:
                expected += x[:, k:k + 1].float() * w[:, k]
            if bias:
                expected += linear.bias.float()
            got = packed(x)
            assert torch.equal(got, expected.to(torch.bfloat16))
            assert torch.equal(packed(x[-1:]), got[-1:])
            reference = torch.nn.functional.linear(x, linear.weight, linear.bias).float()
            assert ((got.float() - reference).abs() <= reference.abs() * 2 ** -7 + 2 ** -8).all()


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32])
def test_cpu_kernel_linear_float32_inputs(weights, cpu_level):
    """cpu_kernels.linear with float32 inputs and outputs, over bfloat16 weights (a bf16 model's
    prompt chunk computed in float32) or float32 ones (a float32 model): the float64 product to
    float32 rounding, and each row alike in any call. At every instruction-set level."""
    from outpace.kernels import cpu_linear
    g = torch.Generator().manual_seed(6)
    for n_in, n_out, bias in ((96, 160, True), (576, 1000, False), (64, 37, True)):
        linear = torch.nn.Linear(n_in, n_out, bias=bias).to(weights)
        packed = cpu_linear.PackedLinear(linear)
        assert packed.kernel
        for rows in (1, 13, 33):
            x = torch.randn(rows, n_in, generator=g)
            got = packed(x)
            assert got.dtype == torch.float32
            expected = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                                  None if linear.bias is None else linear.bias.double())
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(packed(x[:1]), got[:1])
