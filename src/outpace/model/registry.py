"""Which network builds each model family. The dense families differ only in config fields (query
and key biases, per-head query/key norms, a sliding window), which DecoderLM reads from the config,
so they share it; a family with other layers adds its own class here."""
from __future__ import annotations

from outpace.model.decoder import DecoderLM

FAMILIES: dict[str, type[DecoderLM]] = {
    "llama": DecoderLM,     # Llama 2/3, SmolLM2, Mistral (its window is a config field)
    "qwen2": DecoderLM,     # biases on q, k and v
    "qwen3": DecoderLM,     # per-head RMSNorm on q and k
}
