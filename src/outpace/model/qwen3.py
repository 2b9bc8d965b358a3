"""Qwen3: the Llama decoder with RMSNorm on each head of q and k before the rotary embedding."""
from outpace.model.decoder import DecoderLM


class Qwen3ForCausalLM(DecoderLM):
    """ModelConfig sets qk_norm for this family, so Attention builds q_norm and k_norm."""
