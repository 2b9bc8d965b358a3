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
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}


def make_tiny(family: str, folder: Path, vocab_size: int = 256, tokenizer_from: Path | None = None,
              seed: int = 0, dtype=torch.float32):
    """Write a random-weight model of `family` to `folder`; returns the transformers model."""
    import transformers
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(vocab_size=vocab_size, **COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    # random init leaves logits nearly flat; widen them so greedy decoding has clear winners
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0) if not config.tie_word_embeddings else model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(tokenizer_from) / name).exists():
                shutil.copy(Path(tokenizer_from) / name, Path(folder) / name)
    return model
