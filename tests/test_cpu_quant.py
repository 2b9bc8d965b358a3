"""cpu_kernels.linear over GGUF's quantized blocks (Q8_0, Q4_1), kept as the file holds them.

A quantized weight is dequantized in registers as gguf.quants.dequantize rounds it, so each
product equals the float32 kernel's over the dequantized weight bit for bit, at every
instruction-set level (the cpu_level fixture), and each row computes alike whatever rows share
the call (exact mode and speculative greedy output rest on it)."""
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from outpace.kernels import cpu_kernels

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the kernels cannot build here"),
              pytest.mark.usefixtures("cpu_level")]

QTYPES = sorted(cpu_kernels.QUANT_FORMATS)


def quantized(qtype: str, n_out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight's GGUF blocks [n_out, bytes] uint8 and their dequantized float32 [n_out, n_in]."""
    weight = np.random.default_rng(seed).standard_normal((n_out, n_in)).astype(np.float32)
    weight[0, :32] = 0.0                        # a block of zeros: scale 0
    blocks = quantize(weight, GGMLQuantizationType[qtype])
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n_in, n_out", [(32, 1), (64, 37), (96, 160), (576, 1000), (1536, 17)])
def test_quantized_products_equal_the_dequantized_weights(qtype, n_in, n_out):
    """Rows 1..16 (one tile, several, and a partial one), float32 and bfloat16 inputs, partial last
    blocks of 16 columns, a bias: the float32 kernel's result over gguf's dequantized weight, bit for
    bit, and that within float32 rounding of the float64 product."""
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
                torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", QTYPES)
def test_each_row_computes_alike_in_any_call(qtype):
    """A row's product is the same bits alone, first, last or in the middle of 1..16 rows."""
    blocks, _ = quantized(qtype, 200, 576, seed=3)
    packed, fmt = cpu_kernels.pack_quantized(blocks, qtype), cpu_kernels.QUANT_FORMATS[qtype]
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([cpu_kernels.linear(x[i:i + 1], packed, fmt, None, 200) for i in range(16)])
    for rows in range(1, 17):
        for start in (0, 16 - rows):
            got = cpu_kernels.linear(x[start:start + rows], packed, fmt, None, 200)
            assert torch.equal(got, alone[start:start + rows])


def test_inputs_not_whole_blocks_are_refused():
    blocks, _ = quantized("Q8_0", 16, 64, seed=0)
    packed = cpu_kernels.pack_quantized(blocks, "Q8_0")
    with pytest.raises(ValueError, match="cannot take"):
        cpu_kernels.linear(torch.randn(1, 48), packed, cpu_kernels.QUANT_FORMATS["Q8_0"], None, 16)
