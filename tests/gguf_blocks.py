"""GGUF blocks of float weights for tests, in every type the CPU kernels take: gguf.quants.quantize
where gguf's Python has a quantizer, and for the k-quants (Q4_K, Q6_K), which it only dequantizes,
a plain round-to-nearest one that writes llama.cpp's block layout (gguf.quants.dequantize reads
them back; the tests compare against that, never against the float weights)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize


def quantize(weight: np.ndarray, qtype: str) -> np.ndarray:
    """weight [..., K] float32 -> its blocks [..., K / block inputs * block bytes] uint8."""
    if qtype == "Q4_K":
        return _q4_k(weight.astype(np.float32))
    if qtype == "Q6_K":
        return _q6_k(weight.astype(np.float32))
    return gguf_quantize(weight, GGMLQuantizationType[qtype])


def _steps(amax: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block a float16 d and per sub-block an integer scale in [0, levels]: d * scale
    covers amax (d = 0 where the whole super-block is 0)."""
    d = (amax.max(-1, keepdims=True) / levels).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(d > 0, np.round(amax / d.astype(np.float32)), 0)
    return d, np.clip(scale, 0, levels).astype(np.uint8)


def _q4_k(weight: np.ndarray) -> np.ndarray:
    """w = d * sc * q - dmin * m, per 32 inputs 6-bit sc and m, q in [0, 15]."""
    x = weight.reshape(-1, 8, 32)                                   # [super-blocks, 8 sub-blocks, 32]
    low = np.maximum(-x.min(-1), 0)                                 # dmin * m covers -min
    dmin, m = _steps(low, 63)
    d, sc = _steps((x.max(-1) + low) / 15, 63)
    step = d.astype(np.float32) * sc
    offset = dmin.astype(np.float32) * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.round((x + offset[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)   # inputs 64g + 32h + i
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=-1)
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=-1)
    return blocks.reshape(*weight.shape[:-1], -1)


def _q6_k(weight: np.ndarray) -> np.ndarray:
    """w = d * scale * (q - 32), per 16 inputs an int8 scale, q in [0, 63]."""
    x = weight.reshape(-1, 16, 16)                                  # [super-blocks, 16 sub-blocks, 16]
    d, scale = _steps(np.abs(x).max(-1) / 31, 127)
    step = d.astype(np.float32) * scale
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.round(x / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)     # inputs 128h + r
    low, high = (q & 15).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | low[:, :, 1] << 4).reshape(-1, 128)
    qh = (high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, scale.view(np.int8).view(np.uint8), d.view(np.uint8)], axis=-1)
    return blocks.reshape(*weight.shape[:-1], -1)
