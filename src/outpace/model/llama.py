"""Llama 2/3, SmolLM2 and Mistral: the base decoder (RMSNorm, rotary, GQA, SwiGLU), no biases."""
from outpace.model.decoder import DecoderLM


class LlamaForCausalLM(DecoderLM):
    """Mistral differs only by a sliding attention window, which the attention mask applies."""
