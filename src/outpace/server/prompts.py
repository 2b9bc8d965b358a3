"""PromptBuilder: a request body into what the engine takes, in worker threads.

JSON parsing, checking, the chat template and tokenization run in a thread pool, never on the
event loop, so one large request cannot stall other clients' streams or /health. Tokenization
runs without holding the GIL (Tokenizer.encode), which the engine thread needs too. A prompt far
beyond the context is refused by its length in characters before it is tokenized: no token stands
for more than `max_token_chars` characters, so a longer text holds more tokens than fit.
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from outpace.config import SamplingParams
from outpace.errors import OutpaceError
from outpace.server.protocol import ApiError, GenerateRequest, bad_request, parse_chat, parse_completion, parse_json
from outpace.weights.tokenizer import Tokenizer


@dataclass
class Prompt:
    """A request's prompts (a chat's one, a completions batch's several), tokenized, with the
    sampling parameters of each."""

    request: GenerateRequest
    token_ids: list[list[int]]
    params: list[SamplingParams]


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 special_tokens_in_content: bool = False):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.special_tokens_in_content = special_tokens_in_content
        self.max_chars = max_model_len * tokenizer.max_token_chars    # more characters: too many tokens
        self.pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="outpace-prompt")

    async def build(self, raw: bytes, is_chat: bool) -> Prompt:
        """The body of a /v1/completions (or, is_chat, /v1/chat/completions) request, checked
        and tokenized; raises ApiError."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._build, raw, is_chat)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, raw: bytes, is_chat: bool) -> Prompt:
        body = parse_json(raw)
        request = parse_chat(body) if is_chat else parse_completion(body)
        if request.model is not None and request.model != self.model_name:
            raise ApiError(404, f"model {request.model[:100]!r} is not served here; this server serves "
                                f"{self.model_name!r} (see GET /v1/models)", "model", code="model_not_found")
        texts = [request.messages] if request.messages is not None else request.prompts
        for text in texts:
            self._check_length(request, text)
        token_ids = [self._tokenize(request, text) for text in texts]
        return Prompt(request, token_ids, [request.sampling_params(len(ids), self.max_model_len) for ids in token_ids])

    def _check_length(self, request: GenerateRequest, prompt) -> None:
        if request.messages is not None:
            num_chars = sum(_num_chars(message) for message in prompt)
        elif isinstance(prompt, str):
            num_chars = len(prompt)
        else:
            return                      # token ids: sampling_params checks their count
        if num_chars > self.max_chars:
            raise ApiError(400, f"{request.prompt_param} has {num_chars} characters, more than "
                                f"{self.max_model_len} tokens can hold (at most {self.tokenizer.max_token_chars} "
                                f"characters a token), and the context holds {self.max_model_len}: shorten it",
                           request.prompt_param, code="context_length_exceeded")

    def _tokenize(self, request: GenerateRequest, prompt) -> list[int]:
        """A chat's messages, or one of a completions request's prompts, as token ids."""
        try:
            if request.messages is not None:
                return self.tokenizer.encode_chat(prompt, add_generation_prompt=True,
                                                  special_tokens_in_content=self.special_tokens_in_content)
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            return list(prompt)
        except OutpaceError as error:
            raise bad_request(error, request.prompt_param) from None


def _num_chars(value) -> int:
    """Characters in the strings of a message (its content, role and any other field)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_num_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_num_chars(v) for v in value)
    return 0
