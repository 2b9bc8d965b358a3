"""Random draft heads written in their published checkpoint layouts, for the head tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def target_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def write_eagle3_head(folder: Path, target: dict, draft_vocab: int = 2048, seed: int = 0,
                      layer_ids=(1, 2, 3), dtype=torch.float64, **config) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head for `target` (its config.json as a dict) in the published layout:
    config.json plus model.safetensors with fc, midlayer.*, norm, lm_head, d2t and t2d. layer_ids
    are in vLLM's numbering (id j: the input of target layer j). Returns the tensors written."""
    g = torch.Generator().manual_seed(seed)
    H, V = target["hidden_size"], target["vocab_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    D, I = H // heads, target["intermediate_size"]

    def rand(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rand(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": rand(heads * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(kv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(kv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, heads * D),
        "midlayer.mlp.gate_proj.weight": rand(I, H),
        "midlayer.mlp.up_proj.weight": rand(I, H),
        "midlayer.mlp.down_proj.weight": rand(H, I),
        "midlayer.input_layernorm.weight": 1 + rand(H),
        "midlayer.hidden_norm.weight": 1 + rand(H),
        "midlayer.post_attention_layernorm.weight": 1 + rand(H),
        "norm.weight": 1 + rand(H),
        "lm_head.weight": rand(draft_vocab, H, scale=2.0),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": heads, "num_key_value_heads": kv,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": V,
           "draft_vocab_size": draft_vocab, "target_hidden_size": H,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}} | config
    (folder / "config.json").write_text(json.dumps(cfg))
    return tensors


def write_mtp(folder: Path, target: dict, layout: str = "qwen3_next", seed: int = 0, dtype=torch.float64,
              extra: dict | None = None) -> dict[str, torch.Tensor]:
    """A random MTP module for `target` (its config.json as a dict) in the Qwen3-Next layout
    (mtp.*) or DeepSeek-V3's (model.layers.{L}.*), written to folder/mtp.safetensors."""
    g = torch.Generator().manual_seed(seed)
    H, I, L = target["hidden_size"], target["intermediate_size"], target["num_hidden_layers"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    D = H // heads

    def rand(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    layer = {
        "input_layernorm.weight": 1 + rand(H), "post_attention_layernorm.weight": 1 + rand(H),
        "self_attn.q_proj.weight": rand(heads * D, H), "self_attn.k_proj.weight": rand(kv * D, H),
        "self_attn.v_proj.weight": rand(kv * D, H), "self_attn.o_proj.weight": rand(H, heads * D),
        "mlp.gate_proj.weight": rand(I, H), "mlp.up_proj.weight": rand(I, H), "mlp.down_proj.weight": rand(H, I),
    }
    if layout == "qwen3_next":
        own = {"mtp.pre_fc_norm_embedding.weight": 1 + rand(H), "mtp.pre_fc_norm_hidden.weight": 1 + rand(H),
               "mtp.fc.weight": rand(H, 2 * H), "mtp.norm.weight": 1 + rand(H)}
        prefix = "mtp.layers.0."
    else:
        prefix = f"model.layers.{L}."
        own = {prefix + "enorm.weight": 1 + rand(H), prefix + "hnorm.weight": 1 + rand(H),
               prefix + "eh_proj.weight": rand(H, 2 * H), prefix + "shared_head.norm.weight": 1 + rand(H)}
    tensors = own | {prefix + k: v for k, v in layer.items()} | (extra or {})
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(folder) / "mtp.safetensors"))
    return tensors
