"""Tiny random-weight models of every supported family, saved as Hugging Face folders by
transformers itself (the reference implementation), for tests that must run in seconds."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-4-layers": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=4)),    # heads read 3 layers
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}

# Hybrid families: recurrent layers beside attention (4 layers, so both kinds appear). Qwen3.5 as
# its text model and as the vision-language model its checkpoints are published as; Qwen3-Next
# with its dense MLP (num_experts 0). Their 1-D weights (norms, decays) are perturbed at random:
# left at their initial ones and zeros they would hide a misplaced or misordered norm weight.
_DELTANET = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
HYBRID_FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _DELTANET),
    "qwen3_5-vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
        text_config=_DELTANET | dict(tie_word_embeddings=True), tie_word_embeddings=True,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=1, num_position_embeddings=16))),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _DELTANET | dict(num_experts=0)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(num_hidden_layers=4, full_attn_idxs=[1, 3])),
}


def make_tiny(family: str, folder: Path, vocab_size: int = 256, tokenizer_from: Path | None = None,
              seed: int = 0, dtype=torch.float32, **fields):
    """Write a random-weight model of `family` to `folder` (fields: config fields to change);
    returns the transformers model."""
    import transformers
    config_cls, model_cls, extra = FAMILIES.get(family) or HYBRID_FAMILIES[family]
    extra = extra | fields
    if "text_config" in extra:
        text = dict(vocab_size=vocab_size, **COMMON) | extra["text_config"]
        config = getattr(transformers, config_cls)(**extra | dict(text_config=text))
    else:
        config = getattr(transformers, config_cls)(**dict(vocab_size=vocab_size, **COMMON) | extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    # random init leaves logits nearly flat; widen them so greedy decoding has clear winners
    with torch.no_grad():
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        model.get_input_embeddings().weight.mul_(8.0) if tied else model.get_output_embeddings().weight.mul_(20.0)
        if family in HYBRID_FAMILIES:
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(tokenizer_from) / name).exists():
                shutil.copy(Path(tokenizer_from) / name, Path(folder) / name)
    return model


def slot_state(cache, slot: int) -> list[torch.Tensor]:
    """A hybrid's slot in a StateCache (runner.cache.state): each recurrent layer's convolution
    window and its live delta-rule state, copied."""
    out = []
    for layer, history in enumerate(cache.conv):
        start = int(cache.conv_start[slot])
        out.append(history[slot, start:start + history.shape[1] - cache.max_row_tokens].clone())
        if cache.state[layer] is not None:
            out.append(cache.state[layer][slot, int(cache.live[slot])].clone())
    return out
