"""outpace: a speculative-decoding LLM inference engine."""
from outpace.config import EngineConfig, SamplingParams, SpecConfig
from outpace.llm import LLM, RequestOutput

__all__ = ["LLM", "SamplingParams", "SpecConfig", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"
