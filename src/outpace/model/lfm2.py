"""LFM2: gated short convolutions (short_conv.py) beside attention with per-head q/k norms; plain
RMSNorm; the final norm is named embedding_norm in its checkpoints."""
from __future__ import annotations

from torch import nn

from outpace.model.hybrid import HybridLM
from outpace.model.layers import Attention
from outpace.model.short_conv import ShortConv


class Lfm2LM(HybridLM):
    TOP_WEIGHTS = {"model.embed_tokens": "embed", "model.embedding_norm": "norm", "lm_head": "lm_head"}
    LAYER_WEIGHTS = {
        "self_attn.q_proj": ("mixer.qkv", 0),
        "self_attn.k_proj": ("mixer.qkv", 1),
        "self_attn.v_proj": ("mixer.qkv", 2),
        "self_attn.out_proj": ("mixer.o", None),
        "self_attn.q_layernorm": ("mixer.q_norm", None),
        "self_attn.k_layernorm": ("mixer.k_norm", None),
        "conv.in_proj": ("mixer.in_proj", None),
        "conv.conv": ("mixer.conv", None),
        "conv.out_proj": ("mixer.out", None),
        "feed_forward.w1": ("mlp.gate_up", 0),
        "feed_forward.w3": ("mlp.gate_up", 1),
        "feed_forward.w2": ("mlp.down", None),
        "operator_norm": ("input_norm", None),
        "ffn_norm": ("post_norm", None),
    }

    def make_mixer(self, i: int, kind: str) -> nn.Module:
        return Attention(self.cfg, i) if kind == "attention" else ShortConv(self.cfg)
