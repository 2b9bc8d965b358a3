"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k, v projections."""
from outpace.model.decoder import DecoderLM


class Qwen2ForCausalLM(DecoderLM):
    """ModelConfig sets attention_bias for this family, so the fused qkv linear carries a bias."""
