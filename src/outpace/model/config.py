"""ModelConfig: the fields of a Hugging Face config.json that the runtime needs, checked once."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from outpace.errors import CorruptModelError, OutpaceError, UnsupportedModelError
from outpace.model.hybrid_config import HYBRID_FAMILIES, hybrid_fields

# architecture name in config.json -> model family implemented in outpace.model
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",     # its text model; the vision tower is not loaded
    "Qwen3NextForCausalLM": "qwen3_next",
    "Lfm2ForCausalLM": "lfm2",
}


@dataclass
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # hybrid families (model/hybrid_config.py); empty for the dense ones: each layer's token
    # mixer, "attention", "deltanet" (Gated DeltaNet) or "short_conv" (gated short convolution)
    layer_types: list[str] = field(default_factory=list)
    rotary_dim: int | None = None       # head dims that rotate (None: all of them)
    conv_kernel: int = 0                # taps of the recurrent layers' causal convolution
    conv_bias: bool = False
    delta_num_key_heads: int = 0        # Gated DeltaNet: query/key heads and value heads, their sizes
    delta_num_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"outpace supports {', '.join(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        if isinstance(cfg.get("text_config"), dict):     # a vision-language checkpoint: its text model's fields
            cfg = {**cfg, **cfg["text_config"]}
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            # transformers 5 moves rope settings into rope_parameters; older configs keep them flat
            rope = dict(cfg.get("rope_parameters") or {})
            scaling = cfg.get("rope_scaling") or None
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = rope
            theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            fields = dict(
                architecture=arch,
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
                attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            if family in HYBRID_FAMILIES:
                fields.update(hybrid_fields(family, cfg, fields))
            return cls(**fields)
        except OutpaceError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptModelError(f"config.json is missing or has a bad field: {e}") from None

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise CorruptModelError(f"{path} is not valid JSON: {e}") from None
