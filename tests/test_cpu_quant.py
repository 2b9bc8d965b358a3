"""cpu_kernels.linear over GGUF's quantized blocks (Q8_0, Q4_1, Q4_0, Q5_0, Q4_K, Q6_K), kept as the
file holds them.

A quantized weight is dequantized in registers as gguf.quants.dequantize rounds it, so each
product equals the float32 kernel's over the dequantized weight bit for bit, at every
instruction-set level (the cpu_level fixture), and each row computes alike whatever rows share
the call (exact mode and speculative greedy output rest on it)."""
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from outpace.kernels import cpu_kernels
from gguf_blocks import quantize

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the kernels cannot build here"),
              pytest.mark.usefixtures("cpu_level")]

QTYPES = sorted(cpu_kernels.QUANT_FORMATS)
# the k-quants: the float16 scales of a block (Q4_K: d and dmin, Q6_K: d), bytes [start, end), and a
# spread for random ones that gives weights of about the normal weights' size
KQUANT_HALVES = {"Q4_K": (0, 4, 1e-3), "Q6_K": (208, 210, 2.5e-4)}
SHAPES = [(32, 1), (64, 37), (96, 160), (576, 1000), (1536, 17)]
KQUANT_SHAPES = [(256, 1), (256, 37), (512, 160), (1536, 1000), (2304, 17)]


def quantized(qtype: str, n_out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight's GGUF blocks [n_out, bytes] uint8 and their dequantized float32 [n_out, n_in].
    A k-quant's second half of blocks is random bits (every bit pattern of scales and weights is a
    block; its float16 scales random finite values of either sign)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n_out, n_in)).astype(np.float32)
    weight[0, :256 if qtype in KQUANT_HALVES else 32] = 0.0     # a block of zeros: scale 0
    blocks = quantize(weight, qtype)
    if qtype in KQUANT_HALVES:
        start, end, spread = KQUANT_HALVES[qtype]
        noise = rng.integers(0, 256, blocks.shape, dtype=np.uint8).reshape(n_out, -1, blocks.shape[1] * 256 // n_in)
        halves = spread * rng.standard_normal(noise.shape[:-1] + ((end - start) // 2,))
        noise[..., start:end] = halves.astype(np.float16).view(np.uint8)
        blocks[n_out // 2:] = noise.reshape(n_out, -1)[n_out // 2:]
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype, n_in, n_out", [(q, k, n) for q in QTYPES for k, n in (KQUANT_SHAPES if q in KQUANT_HALVES
                                                                                    else SHAPES)])
def test_quantized_products_equal_the_dequantized_weights(qtype, n_in, n_out):
    """Rows 1..16 (one tile, several, and a partial one), float32 and bfloat16 inputs, partial last
    blocks of 16 columns, a bias: the float32 kernel's result over gguf's dequantized weight, bit for
    bit, and that within float32 rounding of the float64 product (n float32 sums of products err by
    at most n * 2^-24 * sum |x * w|, the bias's sum once more)."""
    blocks, dequantized = quantized(qtype, n_out, n_in, seed=n_in + n_out)
    packed, fmt = cpu_kernels.pack_quantized(blocks, qtype), cpu_kernels.QUANT_FORMATS[qtype]
    assert packed.numel() == (n_out + 15) // 16 * 16 * blocks.shape[1]      # the file's bytes, padded
    dense = cpu_kernels.pack_weight(dequantized)
    bias = torch.randn(n_out)
    g = torch.Generator().manual_seed(n_out)
    for rows in range(1, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, n_in, generator=g).to(dtype)
            got = cpu_kernels.linear(x, packed, fmt, bias, n_out)
            assert got.dtype == dtype
            assert torch.equal(got, cpu_kernels.linear(x, dense, 0, bias, n_out))
            if dtype == torch.float32:
                expected = x.double() @ dequantized.double().T + bias.double()
                bound = (n_in + 1) * 2.0 ** -24 * (x.double().abs() @ dequantized.double().abs().T + bias.double().abs())
                assert ((got.double() - expected).abs() <= bound).all()


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


@pytest.mark.parametrize("qtype, n_in, bad_in", [("Q8_0", 64, 48), ("Q4_K", 256, 224), ("Q6_K", 512, 384)])
def test_inputs_not_whole_blocks_are_refused(qtype, n_in, bad_in):
    """Inputs that are not whole blocks (32 inputs, a k-quant's 256) are an error, not a product."""
    blocks, _ = quantized(qtype, 16, n_in, seed=0)
    packed = cpu_kernels.pack_quantized(blocks, qtype)
    with pytest.raises(ValueError, match="cannot take"):
        cpu_kernels.linear(torch.randn(1, bad_in), packed, cpu_kernels.QUANT_FORMATS[qtype], None, 16)
