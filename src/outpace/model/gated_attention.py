"""GatedAttention: the attention of Qwen3.5 and Qwen3-Next, layers.Attention with three changes.

  - Its output is scaled by sigmoid(gate(x)) per channel before the o projection (the checkpoint
    interleaves each head's query rows and gate rows in q_proj; the gate gets its own matrix).
  - It rotates only the first rotary_dim dims of each head (pairing i with i + rotary_dim / 2).
    Attention's rotation pairs i with i + head_dim / 2, so q's and k's dims are laid out at load
    with the rotated pairs first in each half (rotary_order), and the rotary tables keep angle 0
    for the rest (rope.rope_tables): q . k is unchanged by permuting both alike, and every
    attention path (CPU kernels, packed rows, graphs) runs as it does for the dense families.
  - q and k are normed per head by OffsetRMSNorm (scale 1 + w).
"""
from __future__ import annotations

import torch
from torch import nn

from outpace.kernels.fused import linear
from outpace.model.config import ModelConfig
from outpace.model.layers import Attention
from outpace.model.norms import OffsetRMSNorm


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """ours[j] = the checkpoint's dim order[j] within a head: its rotated pairs (i, i + rotary_dim/2)
    become (i, i + head_dim/2), the dims that do not rotate fill the rest of each half."""
    rotated, kept = rotary_dim // 2, (head_dim - rotary_dim) // 2
    r = torch.arange
    return torch.cat([r(0, rotated), r(rotary_dim, rotary_dim + kept),
                      r(rotated, rotary_dim), r(rotary_dim + kept, head_dim)])


class GatedAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return linear(out * torch.sigmoid(linear(x, self.gate)), self.o)
