"""Qwen3-Next: Qwen3.5's text layout (qwen3_5.py) with the DeltaNet projections fused and grouped
by key head in its checkpoints. Its mixture-of-experts MLP is not implemented: configs that use it
are refused (hybrid_config.py)."""
from __future__ import annotations

import torch

from outpace.model.qwen3_5 import Qwen35LM


class Qwen3NextLM(Qwen35LM):
    LAYER_WEIGHTS = Qwen35LM.LAYER_WEIGHTS | {
        "linear_attn.in_proj_qkvz": ("mixer.in_proj", 0),    # split by convert_weight into in_proj's parts
        "linear_attn.in_proj_ba": ("mixer.in_proj", 2),
    }

    def convert_weight(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """in_proj_qkvz holds per key head g [q_g, k_g, v_g, z_g] (v_g, z_g: its value heads'), and
        in_proj_ba [b_g, a_g]: regrouped as Qwen3.5's in_proj_qkv ([q; k; v]), in_proj_z, _b, _a."""
        module, _, kind = hf_name.rpartition(".")
        c = self.cfg
        groups, per_group = c.delta_num_key_heads, c.delta_num_value_heads // c.delta_num_key_heads
        prefix = module.removesuffix("in_proj_qkvz").removesuffix("in_proj_ba")
        if module.endswith("linear_attn.in_proj_qkvz"):
            values = per_group * c.delta_value_dim
            q, k, v, z = tensor.view(groups, -1, tensor.shape[-1]).split(
                [c.delta_key_dim, c.delta_key_dim, values, values], dim=1)
            flat = [x.reshape(-1, tensor.shape[-1]) for x in (q, k, v, z)]
            return [(f"{prefix}in_proj_qkv.{kind}", torch.cat(flat[:3])), (f"{prefix}in_proj_z.{kind}", flat[3])]
        if module.endswith("linear_attn.in_proj_ba"):
            b, a = tensor.view(groups, 2, per_group, tensor.shape[-1]).unbind(1)
            return [(f"{prefix}in_proj_b.{kind}", b.reshape(-1, tensor.shape[-1])),
                    (f"{prefix}in_proj_a.{kind}", a.reshape(-1, tensor.shape[-1]))]
        return super().convert_weight(hf_name, tensor)
