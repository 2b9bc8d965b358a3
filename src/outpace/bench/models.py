"""Model files for the benchmarks: the GGUF behind a model name, and a random-weight model of
Llama-3-8B's shape (speed depends on shapes, not on weight values)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from outpace.paths import outpace_home
from outpace.weights.hub import REGISTRY, resolve_model

# Llama-3-8B's config.json, its dimensions exactly
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def gguf_file(model: str) -> Path | None:
    """The .gguf that `model` (a known name or a .gguf path) is loaded from; None for a folder."""
    if model in REGISTRY:
        resolve_model(model)                    # fetches and converts when missing
        return outpace_home() / "downloads" / REGISTRY[model].filename
    path = Path(model).expanduser()
    return path if path.suffix.lower() == ".gguf" else None


def random_llama3_8b(folder: str | Path | None = None, device: str = "cpu", seed: int = 0,
                     tokenizer_from: str | Path | None = None) -> Path:
    """A Hugging Face folder with Llama-3-8B's config and random bfloat16 weights (about 16 GB),
    built by transformers and saved once. The tokenizer is the default model's (or the one in the
    folder `tokenizer_from`): its ids are all inside the 8B vocabulary, so the same prompts run on both."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = Path(folder) if folder else outpace_home() / "models" / "random-llama3-8b"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    tokenizer_from = Path(tokenizer_from) if tokenizer_from else resolve_model("smollm2-135m")
    config = LlamaConfig(**LLAMA3_8B, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)     # never materialise 32 GB of float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size="5GB")
    del model
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)                      # whole or absent
    return folder
