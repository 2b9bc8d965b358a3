"""ShortConv: LFM2's gated short convolution. One projection gives b, c, x per token; b * x runs
through a causal depthwise convolution of a few taps (its state: the inputs before a row's first
token), and c gates the result before the out projection. On the CPU in float32 or bfloat16 the
three steps are one call of kernels/recurrent_kernels for the whole forward, on CUDA (short rows,
with Triton) one launch of kernels/triton_recurrent."""
from __future__ import annotations

import torch
from torch import nn

from outpace.kernels import recurrent_kernels
from outpace.kernels.fused import linear
from outpace.model.causal_conv import CausalConv
from outpace.model.config import ModelConfig
from outpace.model.recurrent_rows import RowGroups
from outpace.runner.state_cache import RecurrentShape, StateCache


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.hidden_size
        self.in_proj = nn.Linear(H, 3 * H, bias=cfg.conv_bias)          # [b | c | x]
        self.conv = CausalConv(H, cfg.conv_kernel, bias=cfg.conv_bias, silu=False)
        self.out = nn.Linear(H, H, bias=cfg.conv_bias)

    def state_shape(self) -> RecurrentShape:
        return RecurrentShape(self.out.in_features, self.conv.weight.shape[-1])

    def forward(self, x: torch.Tensor, rows: RowGroups, cache: StateCache, layer: int) -> torch.Tensor:
        """x [B, S, H] or [T, H] (the stream's tokens) -> the same shape."""
        shape = x.shape
        proj = linear(x.reshape(-1, shape[-1]), self.in_proj)
        on_gpu = rows.on_gpu_kernels(proj)
        if on_gpu or recurrent_kernels.serves(proj, cache.conv[layer]):
            weight, bias = recurrent_kernels.kernel_weights(self, (self.conv.weight, self.conv.bias),
                                                            lambda w, b: (w[:, 0].t(), b))
            if on_gpu:
                from outpace.kernels import triton_recurrent
                out = triton_recurrent.short_conv(proj, weight, bias, cache.conv[layer], rows.table, rows.max_width)
            else:
                out = recurrent_kernels.short_conv(proj, weight, bias, cache.conv[layer], rows.table)
            return linear(out, self.out).view(shape)
        b, c, x = proj.chunk(3, dim=-1)
        gated = b * x
        out = torch.empty_like(gated)
        for group in rows.groups:
            out[group.start:group.stop] = group.tokens(self.conv(group.lay_out(gated), group, cache, layer))
        return linear(c * out, self.out).view(shape)
