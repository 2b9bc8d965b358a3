"""Rotary position embeddings and the scaling variants of the supported families."""
from __future__ import annotations

import math

import torch

from outpace.errors import UnsupportedModelError


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, s: dict, dim: int, base: float, max_pos: int):
    # YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between the dims whose
    # rotation count over the original context is beta_slow and beta_fast; scale attention by mscale.
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

    def dim_for(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, mscale


def rope_tables(head_dim: int, base: float, max_pos: int, scaling: dict | None, rotary_dim: int | None = None):
    """cos and signed-sin tables [max_pos, head_dim] in float32, for fused.rope's rotate-half
    layout: the first half of the signed sin is negated. rotary_dim < head_dim (partial rotation):
    the first rotary_dim / 2 dims of each half rotate at the frequencies of a rotary_dim rotation,
    the others keep angle 0 (cos 1, sin 0); a family that rotates the first rotary_dim dims of a
    head lays its q and k dims out this way at load (gated_attention.rotary_order)."""
    rotary = rotary_dim or head_dim
    # float32 throughout, the arithmetic of the reference implementations, so tables match bit for bit
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary, 2, dtype=torch.int64).float() / rotary))
    mscale = 1.0
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, mscale = _yarn_inv_freq(inv_freq, scaling, head_dim, base, max_pos)
    elif kind != "default":
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported; outpace supports default, linear, llama3, yarn")
    inv_freq = torch.cat([inv_freq, inv_freq.new_zeros((head_dim - rotary) // 2)])
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq.float())
    emb = torch.cat([angles, angles], dim=-1)
    sin = emb.sin() * mscale
    sin[:, :head_dim // 2].neg_()
    return emb.cos() * mscale, sin
