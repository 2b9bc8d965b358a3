"""Which network builds each model family. The dense families differ only in config fields (query
and key biases, per-head query/key norms, a sliding window), which DecoderLM reads from the config,
so they share it; the hybrid families (recurrent layers beside attention) are HybridLMs."""
from __future__ import annotations

from outpace.model.decoder import DecoderLM
from outpace.model.lfm2 import Lfm2LM
from outpace.model.qwen3_5 import Qwen35LM
from outpace.model.qwen3_next import Qwen3NextLM

FAMILIES: dict[str, type[DecoderLM]] = {
    "llama": DecoderLM,     # Llama 2/3, SmolLM2, Mistral (its window is a config field)
    "qwen2": DecoderLM,     # biases on q, k and v
    "qwen3": DecoderLM,     # per-head RMSNorm on q and k
    "qwen3_5": Qwen35LM,    # Gated DeltaNet + gated attention
    "qwen3_next": Qwen3NextLM,
    "lfm2": Lfm2LM,         # gated short convolutions + attention
}
