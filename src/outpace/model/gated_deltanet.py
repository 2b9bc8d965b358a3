"""GatedDeltaNet: the linear-attention token mixer of Qwen3.5 and Qwen3-Next.

Per token: one projection gives q, k, v (through a causal convolution and silu), the output gate
z, and b, a for the write strength b = sigmoid(b) and the decay g = -exp(A_log) * softplus(a +
dt_bias); q and k are l2-normalised per head, each key head serving value heads / key heads
consecutive value heads. The gated delta rule (model/delta_rule.py) runs per value head from the
slot's state; each head's output is normed, gated by silu(z) and projected back. The rule and
the norms compute in the state cache's dtype (float32, or float64 for a float64 model).

On the CPU in float32 or bfloat16 everything between the two projections is one call of
kernels/recurrent_kernels for the whole forward; on CUDA with Triton, forwards of short rows
(decode, verify, short prompt chunks) run kernels/triton_recurrent up to the gated norm;
elsewhere (float64 on the CPU, long prompt chunks on CUDA) PyTorch ops run group by group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outpace.kernels import recurrent_kernels
from outpace.kernels.fused import linear
from outpace.model import delta_rule
from outpace.model.causal_conv import CausalConv
from outpace.model.config import ModelConfig
from outpace.model.norms import GatedRMSNorm
from outpace.model.recurrent_rows import RowGroup, RowGroups
from outpace.runner.state_cache import RecurrentShape, StateCache

# prompt chunks of at most this many tokens run the delta rule token by token, longer ones in blocks
STEP_TOKENS = 8


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.delta_num_key_heads, cfg.delta_num_value_heads
        self.key_dim, self.value_dim = cfg.delta_key_dim, cfg.delta_value_dim
        keys, values = self.num_k_heads * self.key_dim, self.num_v_heads * self.value_dim
        self.split = (keys, keys, values)
        # one matrix for the checkpoint's four: [q k v | z | b | a]
        self.in_proj_sizes = [2 * keys + values, values, self.num_v_heads, self.num_v_heads]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.in_proj_sizes), bias=False)
        self.conv = CausalConv(2 * keys + values, cfg.conv_kernel, bias=False, silu=True)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps)
        self.out = nn.Linear(values, cfg.hidden_size, bias=False)

    def state_shape(self) -> RecurrentShape:
        return RecurrentShape(sum(self.split), self.conv.weight.shape[-1],
                              (self.num_k_heads, self.key_dim, self.num_v_heads, self.value_dim))

    def forward(self, x: torch.Tensor, rows: RowGroups, cache: StateCache, layer: int) -> torch.Tensor:
        """x [B, S, H] or [T, H] (the stream's tokens) -> the same shape."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        proj = linear(x, self.in_proj)
        if recurrent_kernels.serves(proj, cache.conv[layer]):
            log = None if cache.snapshots else cache.log[layer]
            out = recurrent_kernels.gated_deltanet(
                proj, *self._kernel_weights(), self.norm.eps, cache.conv[layer], cache.state[layer], log, rows.table,
                (self.num_k_heads, self.key_dim, self.num_v_heads, self.value_dim))
            return linear(out, self.out).view(*shape[:-1], -1)
        qkv, z, b, a = proj.split(self.in_proj_sizes, dim=-1)
        if rows.on_gpu_kernels(proj):
            from outpace.kernels import triton_recurrent
            log = None if cache.snapshots else cache.log[layer]
            out = triton_recurrent.gated_deltanet(
                proj, *self._kernel_weights()[:3], cache.conv[layer], cache.state[layer], log, rows.table, rows.max_width,
                (self.num_k_heads, self.key_dim, self.num_v_heads, self.value_dim))
            out = out.view(x.shape[0], self.num_v_heads, self.value_dim)
        else:
            out = x.new_empty(x.shape[0], self.num_v_heads, self.value_dim)
            for group in rows.groups:
                out[group.start:group.stop] = group.tokens(self._rows(group, qkv, b, a, cache, layer))
        out = self.norm(out, z.reshape(out.shape)).flatten(1)
        return linear(out, self.out).view(*shape[:-1], -1)

    def _kernel_weights(self) -> tuple[torch.Tensor, ...]:
        """conv [K, C], -exp(A_log), dt_bias and the norm's weight, float32."""
        return recurrent_kernels.kernel_weights(self, (self.conv.weight, self.A_log, self.dt_bias, self.norm.weight),
                                                lambda conv, a_log, dt_bias, norm: (conv[:, 0].t(), -a_log.exp(), dt_bias, norm))

    def _rows(self, group: RowGroup, qkv, b, a, cache: StateCache, layer: int) -> torch.Tensor:
        """The delta rule over one group's rows: [B, S, value heads, dv] in qkv's dtype."""
        rows, wide = group.state, cache.state_dtype
        mixed = self.conv(group.lay_out(qkv), group, cache, layer).to(wide)
        B, S = mixed.shape[:2]
        q, k, v = mixed.split(self.split, dim=-1)
        q = l2_normalized(q.view(B, S, self.num_k_heads, -1)) * self.key_dim ** -0.5
        k = l2_normalized(k.view(B, S, self.num_k_heads, -1))
        v = v.view(B, S, self.num_v_heads, -1)
        # padding after a row's tokens: no decay, no write, so the state passes through unchanged
        padding = (torch.arange(S, device=mixed.device) >= rows.lengths[:, None])[..., None]      # [B, S, 1]
        strength = group.lay_out(b).sigmoid().to(wide).masked_fill(padding, 0)                    # [B, S, H]
        decay = -self.A_log.to(wide).exp() * F.softplus(group.lay_out(a).to(wide) + self.dt_bias.to(wide))
        decay = decay.masked_fill(padding, 0)
        repeat = self.num_v_heads // self.num_k_heads
        q_heads, k_heads = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        start = cache.state_before(layer, rows)
        if rows.snapshots is not None:
            out, states = delta_rule.steps(q_heads, k_heads, v, decay, strength, start, keep_states=True)
            cache.save_states(layer, rows, states)
        elif rows.verify or S <= STEP_TOKENS:
            out, state = delta_rule.steps(q_heads, k_heads, v, decay, strength, start)
            cache.save_final(layer, rows, state)
            if rows.verify:
                cache.save_log(layer, rows, k, v, decay, strength)
        else:
            out, state = delta_rule.chunks(q_heads, k_heads, v, decay, strength, start)
            cache.save_final(layer, rows, state)
        return out.to(qkv.dtype)
