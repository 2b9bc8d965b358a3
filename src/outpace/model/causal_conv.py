"""CausalConv: the depthwise causal convolution over time of the recurrent layers, its state (the
inputs before each row's first token) in the StateCache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outpace.model.recurrent_rows import RowGroup


class CausalConv(nn.Module):
    """out_t = sum_i w[:, i] * x_{t-K+1+i} (+ bias) per channel, optionally through silu."""

    def __init__(self, channels: int, kernel: int, bias: bool, silu: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))     # the checkpoints' Conv1d layout
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.silu = silu

    def forward(self, x: torch.Tensor, group: RowGroup, cache, layer: int) -> torch.Tensor:
        """x [B, S, C] the group's rows -> [B, S, C]; saves what the rows leave in the cache."""
        S, K = x.shape[1], self.weight.shape[-1]
        seq = torch.cat([cache.conv_window(layer, group.state).to(x.dtype), x], dim=1)     # [B, K-1+S, C]
        cache.save_conv(layer, group.state, seq)
        w = self.weight[:, 0].to(x.dtype)                                                   # [C, K]
        out = seq[:, :S] * w[:, 0]
        for i in range(1, K):
            out = out + seq[:, i:i + S] * w[:, i]
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return F.silu(out) if self.silu else out
