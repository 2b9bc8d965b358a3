"""Qwen3.5 (text): Gated DeltaNet layers and, every few layers, gated attention (gated_attention.py);
norms that scale by 1 + w. Vision-language checkpoints keep the text model under
model.language_model.; their vision tower and multi-token-prediction weights are not loaded."""
from __future__ import annotations

import torch
from torch import nn

from outpace.model.gated_attention import GatedAttention, rotary_order
from outpace.model.gated_deltanet import GatedDeltaNet
from outpace.model.hybrid import HybridLM
from outpace.model.norms import OffsetRMSNorm

TEXT_PREFIX = "model.language_model."


class Qwen35LM(HybridLM):
    NORM = OffsetRMSNorm
    LAYER_WEIGHTS = {
        "self_attn.q_proj": ("mixer.qkv", 0),           # its query rows; convert_weight splits off the gate's
        "self_attn.gate_proj": ("mixer.gate", None),    # (not a checkpoint name: q_proj's gate rows)
        "self_attn.k_proj": ("mixer.qkv", 1),
        "self_attn.v_proj": ("mixer.qkv", 2),
        "self_attn.o_proj": ("mixer.o", None),
        "self_attn.q_norm": ("mixer.q_norm", None),
        "self_attn.k_norm": ("mixer.k_norm", None),
        "linear_attn": ("mixer", None),                 # A_log, dt_bias
        "linear_attn.in_proj_qkv": ("mixer.in_proj", 0),
        "linear_attn.in_proj_z": ("mixer.in_proj", 1),
        "linear_attn.in_proj_b": ("mixer.in_proj", 2),
        "linear_attn.in_proj_a": ("mixer.in_proj", 3),
        "linear_attn.conv1d": ("mixer.conv", None),
        "linear_attn.norm": ("mixer.norm", None),
        "linear_attn.out_proj": ("mixer.out", None),
        "mlp.gate_proj": ("mlp.gate_up", 0),
        "mlp.up_proj": ("mlp.gate_up", 1),
        "mlp.down_proj": ("mlp.down", None),
        "input_layernorm": ("input_norm", None),
        "post_attention_layernorm": ("post_norm", None),
    }

    def make_mixer(self, i: int, kind: str) -> nn.Module:
        return GatedAttention(self.cfg, i) if kind == "attention" else GatedDeltaNet(self.cfg)

    def map_weight(self, hf_name: str):
        if hf_name.startswith(TEXT_PREFIX):
            hf_name = "model." + hf_name[len(TEXT_PREFIX):]
        return super().map_weight(hf_name)

    def convert_weight(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """q_proj: each head's query rows, then its gate rows, split apart; the query, key and their
        norms' dims put in rotary_order."""
        module, _, kind = hf_name.rpartition(".")
        D = self.cfg.head_dim
        order = rotary_order(D, self.cfg.rotary_dim or D)
        if module.endswith("self_attn.q_proj"):
            heads = tensor.view(self.cfg.num_heads, 2, D, *tensor.shape[1:])
            query, gate = heads[:, 0][:, order], heads[:, 1]
            return [(hf_name, query.reshape(-1, *tensor.shape[1:])),
                    (f"{module.removesuffix('q_proj')}gate_proj.{kind}", gate.reshape(-1, *tensor.shape[1:]))]
        if module.endswith(("self_attn.k_proj", "self_attn.q_norm", "self_attn.k_norm")):
            return [(hf_name, tensor.view(-1, D, *tensor.shape[1:])[:, order].reshape(tensor.shape))]
        return [(hf_name, tensor)]
