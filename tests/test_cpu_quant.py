"""cpu_kernels.linear over GGUF's quantized blocks (Q8_0, Q4_1, Q4_0, Q5_0, Q4_K, Q6_K), kept as the
file holds them (cpu_products.h, top).

The products quantize each input row to int8 per block of 32 and sum integer products exactly
(the k-quants' integer sub-block scales inside each sub-block's sum), then combine the blocks in float32 in one fixed order: the result is the numpy
emulation of that scheme below bit for bit, at every instruction-set level (the cpu_level
fixture), whatever rows share the call (exact mode and speculative greedy output rest on it). It
is NOT the float32 product over the dequantized weight: it differs from that by the inputs'
quantization, at most d / 2 an input (d its block's scale), which the bound test states."""
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from outpace.kernels import cpu_kernels
from gguf_blocks import quantize

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the kernels cannot build here"),
              pytest.mark.usefixtures("cpu_level")]

QTYPES = sorted(cpu_kernels.QUANT_FORMATS)
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")         # blocks of 32 inputs
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 18, "Q5_0": 22}
# the k-quants: the float16 scales of a block (Q4_K: d and dmin, Q6_K: d), bytes [start, end), and a
# spread for random ones that gives weights of about the normal weights' size
KQUANT_HALVES = {"Q4_K": (0, 4, 1e-3), "Q6_K": (208, 210, 2.5e-4)}
KQUANT_SHAPES = [(256, 1), (256, 37), (512, 160), (1536, 1000), (2304, 17)]


def quantized(qtype: str, n_out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight's GGUF blocks [n_out, bytes] uint8 and their dequantized float32 [n_out, n_in].
    A k-quant's second half of blocks is random bits (every bit pattern of scales and weights is a
    block; its float16 scales random finite values of either sign)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n_out, n_in)).astype(np.float32)
    weight[0, :256 if qtype in KQUANT_HALVES else 32] = 0.0     # a block of zeros: scale 0
    blocks = quantize(weight, qtype)
    if qtype == "Q8_0":                         # int8's ends, which GGUF's quantizer never writes: -128, 127
        blocks.reshape(n_out, -1, 34)[-1, :, 2:4] = [0x80, 0x7f]
    if qtype in KQUANT_HALVES:
        start, end, spread = KQUANT_HALVES[qtype]
        noise = rng.integers(0, 256, blocks.shape, dtype=np.uint8).reshape(n_out, -1, blocks.shape[1] * 256 // n_in)
        halves = spread * rng.standard_normal(noise.shape[:-1] + ((end - start) // 2,))
        noise[..., start:end] = halves.astype(np.float16).view(np.uint8)
        blocks[n_out // 2:] = noise.reshape(n_out, -1)[n_out // 2:]
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]))


def weight_parts(blocks: torch.Tensor, qtype: str):
    """The file's blocks read with numpy: q [N, G, 32] int64 with the offset taken off, scales d
    and (Q4_1) minima m [N, G] float32, so w = d * q (+ m)."""
    raw = blocks.numpy().reshape(blocks.shape[0], -1, BLOCK_BYTES[qtype])
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qtype == "Q4_1" else None
    if qtype == "Q8_0":
        return raw[..., 2:].view(np.int8).astype(np.int64), d, m
    qs = raw[..., {"Q4_1": 4, "Q4_0": 2, "Q5_0": 6}[qtype]:].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)                     # input i, then i + 16
    if qtype == "Q5_0":
        qh = raw[..., 2:6].copy().view(np.uint32).astype(np.int64)    # [N, G, 1]: bit i of input i
        q |= ((qh >> np.arange(32)) & 1) << 4
    return q - {"Q8_0": 0, "Q4_1": 0, "Q4_0": 8, "Q5_0": 16}[qtype], d, m


def quantize_rows(x: np.ndarray):
    """x [M, K] float32 -> q [M, G, 32] int64, d [M, G] float32: d = max |x| / 127, q = x / d
    rounded half to even (0 where d is 0), each op one float32 rounding."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(blocks / d[..., None]), 0)
    return q.astype(np.int64), d


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c in float32 with one rounding: the product is exact in float64; the float64 sum
    rounded to odd (TwoSum's error says which way) then rounded to float32 is the correctly
    rounded sum, as 53 >= 24 + 2 bits."""
    p, c = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    s = p + c
    t = s - p
    error = (p - (s - t)) + (c - t)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((error != 0) & even, np.nextafter(s, np.where(error > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """The scheme of cpu_products.h in numpy: x [M, K] float32 or bfloat16 -> the float32 sums
    [M, N] (the kernel adds a bias to them in float32, then rounds to x's dtype)."""
    q_w, d_w, m_w = weight_parts(blocks, qtype)
    q_x, d_x = quantize_rows(x.float().numpy())
    isum = np.einsum("mgk,ngk->mng", q_x, q_w)                           # exact
    d_sum = d_x * q_x.sum(-1).astype(np.float32)                         # [M, G] float32
    acc = np.zeros((x.shape[0], blocks.shape[0]), dtype=np.float32)
    for g in range(q_x.shape[1]):
        acc = fma32(d_w[None, :, g] * d_x[:, None, g], isum[..., g].astype(np.float32), acc)
        if m_w is not None:
            acc = fma32(m_w[None, :, g], d_sum[:, None, g], acc)
    return torch.from_numpy(acc)


def kquant_parts(blocks: torch.Tensor, qtype: str):
    """A k-quant's blocks read with numpy, per block of 32 inputs b: q [N, B, 32] int64 (Q4_K 0..15,
    Q6_K 0..63), d [N, B] float32 (the super-block's); Q4_K: sc, m [N, B] (6-bit) and dmin [N, B],
    so w = (d * sc) * q - dmin * m; Q6_K: sc [N, B, 2] (int8, per 16 inputs), so w = (d * sc) * (q - 32)."""
    n = blocks.shape[0]
    raw = blocks.numpy().reshape(-1, 144 if qtype == "Q4_K" else 210)             # [N * S, bytes]
    def per_block(a):                                                              # [N * S, ...] -> [N, B, ...]
        return np.repeat(a, 8, axis=0).reshape(n, -1, *a.shape[1:]) if a.ndim == 1 else a.reshape(n, -1, *a.shape[2:])
    if qtype == "Q4_K":
        d, dmin = (raw[:, a:a + 2].copy().view(np.float16)[:, 0].astype(np.float32) for a in (0, 2))
        sc, m = Q4_K.get_scale_min(raw[:, 4:16].copy())                            # [N * S, 8]
        qs = raw[:, 16:].reshape(-1, 4, 1, 32).astype(np.int64)
        q = ((qs >> np.array([0, 4]).reshape(1, 1, 2, 1)) & 15).reshape(-1, 8, 32)  # sub-block 2g: low nibbles
        return (q.reshape(n, -1, 32), per_block(d), sc.astype(np.int64).reshape(n, -1), m.astype(np.int64).reshape(n, -1),
                per_block(dmin))
    ql, qh = raw[:, :128].astype(np.int64), raw[:, 128:192].astype(np.int64)
    low = ((ql.reshape(-1, 2, 1, 64) >> np.array([0, 4]).reshape(1, 1, 2, 1)) & 15).reshape(-1, 2, 128)
    high = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3).reshape(-1, 2, 128)
    q = (low | high << 4).reshape(n, -1, 32)                                       # input 128h + r
    sc = raw[:, 192:208].copy().view(np.int8).astype(np.int64).reshape(n, -1, 2)
    d = raw[:, 208:210].copy().view(np.float16)[:, 0].astype(np.float32)
    return q, per_block(d), sc


def kquant_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """cpu_products.h's k-quant scheme in numpy: x [M, K] float32 or bfloat16 -> the float32 sums [M, N]."""
    q_x, d_x = quantize_rows(x.float().numpy())                                 # [M, B, 32], [M, B]
    acc = np.zeros((x.shape[0], blocks.shape[0]), dtype=np.float32)
    if qtype == "Q4_K":
        q_w, d_w, sc, m, dmin = kquant_parts(blocks, qtype)
        isum = np.einsum("mbk,nbk->mnb", q_x, q_w)                               # exact
        d_sum = d_x * q_x.sum(-1).astype(np.float32)
        scale, low = d_w * sc.astype(np.float32), -(dmin * m.astype(np.float32))  # [N, B]
        for b in range(q_x.shape[1]):
            acc = fma32(scale[None, :, b] * d_x[:, None, b], isum[..., b].astype(np.float32), acc)
            acc = fma32(low[None, :, b], d_sum[:, None, b], acc)
        return torch.from_numpy(acc)
    q_w, d_w, sc = kquant_parts(blocks, qtype)
    halves = np.einsum("mbhk,nbhk->mnbh", q_x.reshape(*q_x.shape[:2], 2, 16), q_w.reshape(*q_w.shape[:2], 2, 16))
    s = q_x.reshape(*q_x.shape[:2], 2, 16).sum(-1)                               # [M, B, 2]
    isum = (halves - 32 * s[:, None]) * sc[None]                                 # [M, N, B, 2], exact
    assert np.abs(isum).max() < 2 ** 24
    for b in range(q_x.shape[1]):
        for half in range(2):
            acc = fma32(d_w[None, :, b] * d_x[:, None, b], isum[..., b, half].astype(np.float32), acc)
    return torch.from_numpy(acc)


def test_every_format_is_tested_by_its_family_rule():
    assert sorted(INT8_TYPES + tuple(KQUANT_HALVES)) == QTYPES


def assert_products_equal_emulation(blocks, qtype, n_in, n_out, emulation):
    """The packed products of rows 1..16 (one tile, several, and a partial one), float32 and bfloat16
    inputs (a block of zeros among them), with and without a bias, equal emulation(x, blocks, qtype)
    bit for bit; the packing keeps the file's bytes, padded to whole blocks of 16 columns."""
    packed, fmt = cpu_kernels.pack_quantized(blocks, qtype), cpu_kernels.QUANT_FORMATS[qtype]
    assert packed.numel() == (n_out + 15) // 16 * 16 * blocks.shape[1]      # the file's bytes, padded
    bias = torch.randn(n_out)
    g = torch.Generator().manual_seed(n_out)
    for rows in range(1, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, n_in, generator=g).to(dtype)
            x[0, :32] = 0.0
            sums = emulation(x, blocks, qtype)
            for b in (bias, None):
                got = cpu_kernels.linear(x, packed, fmt, b, n_out)
                assert got.dtype == dtype
                assert torch.equal(got, (sums if b is None else sums + b).to(dtype)), (rows, dtype)


@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("n_in, n_out", [(32, 1), (64, 37), (96, 160), (576, 1000), (1536, 17)])
def test_quantized_products_follow_the_int8_scheme(qtype, n_in, n_out):
    """Rows 1..16 (one tile, several, and a partial one), float32 and bfloat16 inputs (a block of
    zeros among them), partial last blocks of 16 columns, a bias: the scheme's numpy emulation, bit
    for bit; the weights read from the file's bytes, which gguf's dequantize reads alike."""
    blocks, dequantized = quantized(qtype, n_out, n_in, seed=n_in + n_out)
    q_w, d_w, m_w = weight_parts(blocks, qtype)
    as_read = d_w[..., None] * q_w + (0 if m_w is None else m_w[..., None])
    assert np.array_equal(as_read.reshape(n_out, n_in).astype(np.float32), dequantized.numpy())
    assert_products_equal_emulation(blocks, qtype, n_in, n_out, reference)


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_products_are_within_the_inputs_quantization(qtype):
    """Against the float64 product over gguf's dequantized weight, float32 inputs of every scale:
    |error| <= sum over blocks of (d / 2) * sum |w| (each input off by at most half its block's
    step, and x / d's own rounding) plus float32 rounding of the sums."""
    n_in, n_out = 1536, 300
    blocks, dequantized = quantized(qtype, n_out, n_in, seed=7)
    packed, fmt = cpu_kernels.pack_quantized(blocks, qtype), cpu_kernels.QUANT_FORMATS[qtype]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(16, n_in, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(1)
    x[:, 100:140] *= 50.0                                              # outliers in a block
    got = cpu_kernels.linear(x, packed, fmt, None, n_out).double()
    w = dequantized.double()
    _, d = quantize_rows(x.numpy())
    step = torch.from_numpy(d).double().repeat_interleave(32, dim=1)     # [M, K]: each input's block's d
    bound = (0.5 + 1e-5) * step @ w.abs().T + 1e-5 * x.double().abs() @ w.abs().T
    error = (got - x.double() @ w.T).abs()
    assert (error <= bound).all(), (error / bound).max()
    assert (error > 0).any()                                           # not the float product in disguise


@pytest.mark.parametrize("qtype, n_in, n_out", [(q, k, n) for q in KQUANT_HALVES for k, n in KQUANT_SHAPES])
def test_kquant_products_follow_the_int8_scheme(qtype, n_in, n_out):
    """Rows 1..16 (one tile, several, and a partial one), float32 and bfloat16 inputs (a block of
    zeros among them), partial last blocks of 16 columns, a bias, blocks of random bits (every
    scale, int8's -128 among Q6_K's): the scheme's numpy emulation, bit for bit; the weights read
    from the file's bytes, which gguf's dequantize reads alike."""
    blocks, dequantized = quantized(qtype, n_out, n_in, seed=n_in + n_out)
    parts = kquant_parts(blocks, qtype)
    if qtype == "Q4_K":
        q_w, d_w, sc, m, dmin = parts
        as_read = (d_w * sc.astype(np.float32))[..., None] * q_w.astype(np.float32) - (dmin * m.astype(np.float32))[..., None]
    else:
        q_w, d_w, sc = parts
        as_read = (d_w[..., None] * sc.astype(np.float32)).repeat(16, -1) * (q_w - 32).astype(np.float32)
    assert np.array_equal(as_read.reshape(n_out, n_in).astype(np.float32), dequantized.numpy())
    assert_products_equal_emulation(blocks, qtype, n_in, n_out, kquant_reference)


# each format's quantized bytes in its GGUF block [start, end), set to all ones: every weight its
# format's largest (Q4_0, Q4_1, Q4_K 15, Q5_0 31, Q6_K 63; Q8_0 -1, and 127 below)
QUANT_BYTES = {"Q8_0": (2, 34), "Q4_1": (4, 20), "Q4_0": (2, 18), "Q5_0": (2, 22), "Q4_K": (16, 144), "Q6_K": (0, 192)}


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_largest_integer_sums_are_exact(qtype):
    """Every weight at its format's largest and every input at +-127 of one sign: the integer sums
    at their bound (the kernels add a few runs' products in 16 bits where the level allows,
    cpu_vec.h's SUM16_RUNS) still equal the emulation bit for bit."""
    n_in, n_out = 512, 32
    blocks, _ = quantized(qtype, n_out, n_in, seed=11)
    start, end = QUANT_BYTES[qtype]
    raw = blocks.view(n_out, -1, BLOCK_BYTES.get(qtype) or (144 if qtype == "Q4_K" else 210))
    raw[..., start:end] = 0xFF
    if qtype == "Q8_0":
        raw[n_out // 2:, :, start:end] = 0x7F
    packed, fmt = cpu_kernels.pack_quantized(blocks, qtype), cpu_kernels.QUANT_FORMATS[qtype]
    x = torch.ones(3, n_in)
    x[1] = -1.0
    x[2, ::2] = -1.0
    emulation = kquant_reference if qtype in KQUANT_HALVES else reference
    assert torch.equal(cpu_kernels.linear(x, packed, fmt, None, n_out), emulation(x, blocks, qtype))


@pytest.mark.parametrize("qtype", QTYPES)
def test_each_row_computes_alike_in_any_call(qtype):
    """A row's product is the same bits alone, first, last or in the middle of 1..16 rows."""
    blocks, _ = quantized(qtype, 200, 768, seed=3)
    packed, fmt = cpu_kernels.pack_quantized(blocks, qtype), cpu_kernels.QUANT_FORMATS[qtype]
    x = torch.randn(16, 768, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([cpu_kernels.linear(x[i:i + 1], packed, fmt, None, 200) for i in range(16)])
    for rows in range(1, 17):
        for start in (0, 16 - rows):
            got = cpu_kernels.linear(x[start:start + rows], packed, fmt, None, 200)
            assert torch.equal(got, alone[start:start + rows])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_is_not_hidden(bad):
    """A NaN or infinity in a row makes that row's outputs NaN (its block's scale is NaN), never
    a quantized number; the other rows are as they are alone."""
    blocks, _ = quantized("Q4_1", 48, 64, seed=5)
    packed, fmt = cpu_kernels.pack_quantized(blocks, "Q4_1"), cpu_kernels.QUANT_FORMATS["Q4_1"]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    clean = cpu_kernels.linear(x[2:], packed, fmt, None, 48)
    x[1, 40] = bad
    got = cpu_kernels.linear(x, packed, fmt, None, 48)
    assert got[1].isnan().all() and torch.equal(got[2:], clean)


@pytest.mark.parametrize("qtype, n_in, bad_in", [("Q8_0", 64, 48), ("Q4_K", 256, 224), ("Q6_K", 512, 384)])
def test_inputs_not_whole_blocks_are_refused(qtype, n_in, bad_in):
    """Inputs that are not whole blocks (32 inputs, a k-quant's 256) are an error, not a product."""
    blocks, _ = quantized(qtype, 16, n_in, seed=0)
    packed = cpu_kernels.pack_quantized(blocks, qtype)
    with pytest.raises(ValueError, match="cannot take"):
        cpu_kernels.linear(torch.randn(1, bad_in), packed, cpu_kernels.QUANT_FORMATS[qtype], None, 16)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantized_rows_are_ggufs_dequantizer_bit_for_bit(qtype):
    """An embedding's lookups (QuantizedEmbedding): rows of the blocks (a k-quant's random bit
    patterns, int8's ends and a block of zeros among them) in any order, repeated, as
    gguf.quants.dequantize gives them in float32, and those rounded once to bfloat16; an id
    outside the rows is an error."""
    n_in = 512
    blocks, weight = quantized(qtype, 40, n_in, seed=3)
    ids = torch.tensor([[39, 0, 20], [0, 25, 39]])
    got = cpu_kernels.dequantize_rows(blocks, qtype, ids, torch.float32)
    assert got.shape == (2, 3, n_in) and torch.equal(got, weight[ids])
    assert torch.equal(cpu_kernels.dequantize_rows(blocks, qtype, ids, torch.bfloat16), weight[ids].bfloat16())
    with pytest.raises(IndexError, match=r"\[0, 40\)"):
        cpu_kernels.dequantize_rows(blocks, qtype, torch.tensor([40]), torch.float32)


def test_quantize_linears_puts_a_heads_products_in_q4_0():
    """quantize_linears (a head beside a quantized target): each linear whose inputs are whole
    blocks of 32 becomes a Q4_0 QuantizedLinear over quantize_q4_0's blocks of its weight, its bias
    kept; one whose inputs are not is packed as pack_linears packs it, and computes as before."""
    from torch import nn
    from outpace.kernels.cpu_linear import QuantizedLinear, quantize_linears
    if not cpu_kernels.has_library():
        pytest.skip("no C compiler for the CPU kernels")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(320, 37, bias=True), nn.Sequential(nn.Linear(64, 48, bias=False)),
                          nn.Linear(40, 8, bias=False))
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.weight.data.mul_(0.05)
    x = {320: torch.randn(3, 320), 64: torch.randn(3, 64), 40: torch.randn(3, 40)}
    odd = model[2](x[40])
    weights = {320: model[0].weight.detach().clone(), 64: model[1][0].weight.detach().clone()}
    biases = {320: model[0].bias.detach().clone(), 64: torch.zeros(48)}
    quantize_linears(model)
    for n, layer in ((320, model[0]), (64, model[1][0])):
        assert isinstance(layer, QuantizedLinear) and layer.qtype == "Q4_0"
        blocks = QuantizedLinear(cpu_kernels.quantize_q4_0(weights[n]), "Q4_0", n, len(weights[n]), False)
        torch.testing.assert_close(layer(x[n]), blocks(x[n]) + biases[n])
        torch.testing.assert_close(layer(x[n]), x[n] @ weights[n].T + biases[n], rtol=0.1, atol=0.1)
    assert not isinstance(model[2], QuantizedLinear)
    torch.testing.assert_close(model[2](x[40]), odd)


def test_quantize_q4_0_writes_ggufs_blocks():
    """quantize_q4_0 (a draft model's matrices requantized): the bytes of gguf-py's Q4_0 quantizer
    at scales whose float16 d is normal, subnormal, zero and infinite, with a block of zeros, ties
    for the largest magnitude (the first one's sign sets d's) and a block whose largest is
    positive."""
    from gguf.quants import quantize as gguf_quantize
    torch.manual_seed(0)
    for scale in (1.0, 0.02, 1e-6, 1e-9, 1e6):
        weight = torch.randn(37, 320) * scale
        weight[0, :32] = 0.0
        weight[1, :32] = weight[1, :32].abs()
        weight[2, 3], weight[2, 9] = 4 * scale, -4 * scale
        weight[3, 3], weight[3, 9] = -4 * scale, 4 * scale
        with np.errstate(over="ignore"):                # gguf's float16 cast of an infinite d
            want = torch.from_numpy(gguf_quantize(weight.numpy(), GGMLQuantizationType.Q4_0))
        assert torch.equal(cpu_kernels.quantize_q4_0(weight), want), scale
    with pytest.raises(ValueError, match="whole blocks of 32"):
        cpu_kernels.quantize_q4_0(torch.randn(2, 48))
