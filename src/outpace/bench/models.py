"""Model files for the benchmarks: the GGUF behind a model name, and random-weight models of
Llama-3-8B's, Llama-3-70B's and Qwen3.5-0.8B's shapes, and a dense twin of the latter (speed
depends on shapes, not on weight values), saved as folders or built on the device."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from outpace.model.config import ModelConfig
from outpace.model.decoder import DecoderLM
from outpace.model.tensor_parallel import Shard
from outpace.paths import outpace_home
from outpace.weights.loader import empty_model, ready
from outpace.weights.hub import REGISTRY, resolve_model

# Llama-3-8B's config.json, its dimensions exactly
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu")
# Llama-3-70B's config.json, its dimensions exactly (about 141 GB in bfloat16: more than one H100 holds)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
# Qwen3.5-0.8B's text model (a hybrid: 18 Gated DeltaNet layers, 6 gated attention layers), its
# dimensions exactly, from the text_config of its published config.json as quoted in public code
# (mlx-community/Qwen3.5-0.8B-OptiQ-4bit's, "trimmed"; Qwen/Qwen3.5-0.8B's model card and spec pages
# agree: 24 layers of hidden size 1024, 3 DeltaNet to 1 attention, 8 query / 2 KV heads of 256,
# DeltaNet 16 heads of 128 for q, k and v, ffn 3584, vocabulary 248320, tied embeddings, rope
# theta 1e7 over a quarter of each head)
QWEN35_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                  linear_num_value_heads=16, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, hidden_act="silu",
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
# Qwen3.5-0.8B's dimensions as a dense Qwen3 model: every layer full attention (with per-head q/k
# norms, no output gate), the same widths, heads, vocabulary and rotation base; the baseline that
# shows what recurrent state costs
QWEN35_08B_DENSE = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=256, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", rope_theta=10000000.0)
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
    return random_llama(LLAMA3_8B, folder or outpace_home() / "models" / "random-llama3-8b", device, seed,
                        tokenizer_from)


def random_llama(shape: dict, folder: str | Path, device: str = "cpu", seed: int = 0,
                 tokenizer_from: str | Path | None = None) -> Path:
    """As random_llama3_8b, for a Llama of `shape` (a config.json's fields, as LLAMA3_8B)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return _random_model(LlamaForCausalLM, config, folder, device, seed, tokenizer_from)


def random_qwen35_08b(folder: str | Path | None = None, device: str = "cpu", seed: int = 0,
                      tokenizer_from: str | Path | None = None, **fields) -> Path:
    """As random_llama3_8b, for Qwen3.5-0.8B's text model (about 1.5 GB): a Qwen3_5ForCausalLM
    folder, which outpace loads as a published Qwen3.5 checkpoint's text model. fields replace
    config fields (a smaller shape: give its own folder)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    config = Qwen3_5TextConfig(**QWEN35_08B | fields, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return _random_model(Qwen3_5ForCausalLM, config, folder or outpace_home() / "models" / "random-qwen3.5-0.8b",
                         device, seed, tokenizer_from)


def random_qwen35_08b_dense(folder: str | Path | None = None, device: str = "cpu", seed: int = 0,
                            tokenizer_from: str | Path | None = None, **fields) -> Path:
    """As random_qwen35_08b, for its dense twin QWEN35_08B_DENSE (a Qwen3ForCausalLM folder)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(**QWEN35_08B_DENSE | fields, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return _random_model(Qwen3ForCausalLM, config, folder or outpace_home() / "models" / "random-qwen3.5-0.8b-dense",
                         device, seed, tokenizer_from)


def _random_model(model_cls, config, folder: str | Path, device: str, seed: int,
                  tokenizer_from: str | Path | None) -> Path:
    """`model_cls(config)` with random bfloat16 weights saved to `folder` once, with the tokenizer
    of `tokenizer_from` (default: the default model's)."""
    folder = Path(folder)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    tokenizer_from = Path(tokenizer_from) if tokenizer_from else resolve_model("smollm2-135m")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)     # never materialise the float32 weights
    try:
        with torch.device(device):
            model = model_cls(config)
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


def random_model(shape: dict, dtype: torch.dtype, max_len: int, device: str = "cpu", shard: Shard | None = None,
                 seed: int = 0) -> DecoderLM:
    """A Llama model of `shape` (a config.json's fields, as LLAMA3_8B) with random weights built on
    the device, never written to disk (shard: a tensor-parallel rank's part). Speed depends on
    shapes, not on weight values."""
    cfg = ModelConfig.from_dict(dict(shape, architectures=["LlamaForCausalLM"]))
    model = empty_model(cfg, dtype, device, max_len, shard)
    gen = torch.Generator(device=device).manual_seed(seed + (shard.rank if shard else 0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    return ready(model, device)
