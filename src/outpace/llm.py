"""LLM: the Python API, in the style of vLLM's offline `LLM` class."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

from tqdm import tqdm

from outpace.config import EngineConfig, SamplingParams, SpecConfig
from outpace.engine.llm_engine import LLMEngine
from outpace.engine.sequence import Sequence
from outpace.errors import InvalidParameterError
from outpace.sampling.logprobs import Logprob
from outpace.speculative.drafter import Drafter


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    timing: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    num_cached_tokens: int = 0      # prompt tokens found cached from an earlier or a running request (prefix caching)
    # where SamplingParams.logprobs asks: per output token {token id: Logprob}, the token first
    logprobs: list[dict[int, Logprob]] | None = None
    # where SamplingParams.prompt_logprobs asks: per prompt token the same, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


def _timing(seq: Sequence, load_s: float, started: float) -> dict:
    first = seq.first_token_time or seq.finish_time
    prefill_s = first - started
    decode_s = seq.finish_time - first
    n = seq.num_output_tokens
    return {
        "load_s": load_s,
        "prefill_s": prefill_s,      # until the first output token
        "decode_s": decode_s,        # from the first output token to the last
        "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
    }


class LLM:
    """LLM(model="smollm2-135m", spec=SpecConfig(...) | "ngram" | "none", dtype=..., device=...,
    tensor_parallel_size=N, ...): EngineConfig's fields as keywords."""

    def __init__(self, model: str = "smollm2-135m", *, spec: SpecConfig | str | None = None,
                 drafter: Drafter | None = None, **engine_options):
        if isinstance(spec, str):
            spec = SpecConfig(method=spec)
        config = EngineConfig(model=model, spec=spec or SpecConfig(), **engine_options)
        self.engine = LLMEngine(config, drafter=drafter)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done at exit); nothing to do on one device."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *, use_tqdm: bool = False,
                 on_tokens=None, speculate: bool = True, cache_salt: str = "") -> list[RequestOutput]:
        """prompts: text, token ids, or a list of either. sampling_params: one for every prompt, or a
        list of one per prompt. on_tokens(seq) is called after each step that gave a sequence new
        tokens (streaming). speculate=False decodes plainly (a baseline). cache_salt: the prompts
        reuse only cached prefixes of requests given the same salt (EngineConfig.prefix_caching)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(list(prompts), ids, params, use_tqdm, on_tokens, speculate, cache_salt)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             *, use_tqdm: bool = False, on_tokens=None, speculate: bool = True,
             cache_salt: str = "") -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of conversations.
        Special-token text inside a message stays text, as the server treats it (Tokenizer.encode_chat)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        texts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in conversations]
        ids = [self.tokenizer.encode_chat(m, add_generation_prompt=True) for m in conversations]
        return self._run(texts, ids, sampling_params or SamplingParams(), use_tqdm, on_tokens, speculate, cache_salt)

    def _run(self, prompts, ids, params, use_tqdm, on_tokens, speculate, cache_salt) -> list[RequestOutput]:
        engine = self.engine
        started = time.perf_counter()
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        elif len(params) != len(ids):
            raise InvalidParameterError(f"got {len(params)} SamplingParams for {len(ids)} prompts: give one, or one "
                                        "per prompt")
        seqs = [engine.add_request(i, p, speculate, cache_salt) for i, p in zip(ids, params)]
        bar = tqdm(total=len(seqs), desc="generating", disable=not use_tqdm)
        try:
            while engine.has_unfinished():
                for seq in engine.step():
                    if on_tokens is not None:
                        on_tokens(seq)
                    if seq.is_finished:
                        bar.update(1)
        finally:
            bar.close()
            for seq in seqs:
                engine.abort(seq.seq_id)     # frees slots if interrupted; no-op when finished
        return [RequestOutput(p if isinstance(p, str) else None, s.prompt_ids, s.text, s.output_ids,
                              s.finish_reason, _timing(s, engine.load_s, started),
                              s.stats.as_dict(s.finish_time - started), s.num_reused, self._decoded(s.logprobs),
                              self._decoded(s.prompt_logprobs))
                for p, s in zip(prompts, seqs)]

    def _decoded(self, logprobs: list[dict[int, Logprob] | None] | None) -> list[dict[int, Logprob] | None] | None:
        """The logprobs with each token's text (Tokenizer.token_text)."""
        if logprobs is None:
            return None
        text = self.tokenizer.token_text
        return [None if entry is None else {t: dataclasses.replace(lp, decoded_token=text(t)) for t, lp in entry.items()}
                for entry in logprobs]
