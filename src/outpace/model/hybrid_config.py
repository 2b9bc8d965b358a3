"""The config.json fields of the hybrid families (recurrent layers beside attention), read into
ModelConfig's: which mixer each layer has, the recurrent layers' sizes, and each family's defaults
(those transformers 5.24 assumes when a field is absent)."""
from __future__ import annotations

from outpace.errors import UnsupportedModelError

HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "lfm2")

# config.json's layer_types entries -> ours
MIXERS = {"full_attention": "attention", "linear_attention": "deltanet", "conv": "short_conv"}


def hybrid_fields(family: str, cfg: dict, dense: dict) -> dict:
    """ModelConfig fields of a hybrid family's config.json `cfg`, beside (or replacing) the dense
    ones already read into `dense`."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported; outpace runs silu MLPs")
    if family == "lfm2":
        return _lfm2(cfg, dense)
    return _qwen3_next(family, cfg, dense)


def _layer_types(cfg: dict, num_layers: int, default: list[str]) -> list[str]:
    given = cfg.get("layer_types") or default
    if len(given) != num_layers or any(t not in MIXERS for t in given):
        raise UnsupportedModelError(f"layer_types {given!r} must name one of {', '.join(MIXERS)} for each of the "
                                    f"{num_layers} layers")
    return [MIXERS[t] for t in given]


def _qwen3_next(family: str, cfg: dict, dense: dict) -> dict:
    """Qwen3.5 and Qwen3-Next: Gated DeltaNet layers and, every few layers, gated attention with
    per-head (1 + w) norms on q and k that rotates a share of each head's dims."""
    num_layers, head_dim = dense["num_layers"], dense["head_dim"]
    interval = int(cfg.get("full_attention_interval", 4))
    layer_types = _layer_types(cfg, num_layers, ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                                 for i in range(num_layers)])
    if cfg.get("attn_output_gate", True) is False:
        raise UnsupportedModelError("attn_output_gate false is not supported: outpace's Qwen3.5/Qwen3-Next "
                                    "attention always gates its output")
    if family == "qwen3_next":
        _reject_experts(cfg, num_layers)
    rope = cfg.get("rope_parameters") or {}
    # mrope_section / mrope_interleaved (Qwen3.5) only matter for image and video positions: a text
    # token's three position ids are equal, which makes the multimodal rotation the plain one
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(f"partial_rotary_factor {factor} rotates {rotary_dim} of {head_dim} head dims; "
                                    f"outpace needs an even number from 2 to head_dim")
    if rotary_dim < head_dim and dense["rope_scaling"] is not None:
        raise UnsupportedModelError("rope scaling with partial rotation is not supported; outpace supports "
                                    "the default rotation there")
    num_k_heads = int(cfg.get("linear_num_key_heads", 16))
    num_v_heads = int(cfg.get("linear_num_value_heads", 32))
    if num_v_heads % num_k_heads:
        raise UnsupportedModelError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                                    f"linear_num_key_heads ({num_k_heads})")
    return dict(layer_types=layer_types, rotary_dim=rotary_dim, qk_norm=True, sliding_window=None,
                conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                delta_num_key_heads=num_k_heads, delta_num_value_heads=num_v_heads,
                delta_key_dim=int(cfg.get("linear_key_head_dim", 128)),
                delta_value_dim=int(cfg.get("linear_value_head_dim", 128)))


def _reject_experts(cfg: dict, num_layers: int) -> None:
    """Qwen3-Next's mixture-of-experts MLP is not implemented: every layer must use the dense MLP."""
    num_experts = int(cfg.get("num_experts", 512))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_only = set(cfg.get("mlp_only_layers") or [])
    sparse = [i for i in range(num_layers) if num_experts > 0 and i not in dense_only and (i + 1) % step == 0]
    if sparse:
        raise UnsupportedModelError(
            f"Qwen3-Next's mixture-of-experts MLP (num_experts={num_experts}, layers {sparse[:4]}"
            f"{'...' if len(sparse) > 4 else ''}) is not supported; outpace runs its layout with a dense MLP "
            f"in every layer (num_experts 0, or every layer listed in mlp_only_layers)")


def _lfm2(cfg: dict, dense: dict) -> dict:
    """LFM2: gated short convolutions beside attention with per-head q/k norms. Its ffn size is
    adjusted from the config's as transformers' Lfm2MLP does."""
    num_layers = dense["num_layers"]
    attention = cfg.get("full_attn_idxs")
    attention = range(num_layers) if attention is None else attention
    layer_types = _layer_types(cfg, num_layers, ["full_attention" if i in attention else "conv"
                                                 for i in range(num_layers)])
    size = int(cfg.get("block_ff_dim", cfg.get("intermediate_size", 12288)))
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            size = int(multiplier * size)
            size = multiple * -(-size // multiple)
    rope = cfg.get("rope_parameters") or {}
    return dict(layer_types=layer_types, qk_norm=True, sliding_window=None, intermediate_size=size,
                rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
                rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 1e6))),
                tie_word_embeddings=bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))),
                conv_kernel=int(cfg.get("conv_L_cache", 3)), conv_bias=bool(cfg.get("conv_bias", False)))
