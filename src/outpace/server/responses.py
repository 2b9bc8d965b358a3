"""Response bodies in OpenAI's shapes: whole responses and server-sent event streams of chunks."""
from __future__ import annotations

import json
import time
import uuid
from outpace.sampling.logprobs import Logprob
from outpace.server.async_engine import EngineFailure, RequestStream, Update
from outpace.server.protocol import ApiError
from outpace.weights.tokenizer import Tokenizer

# JSON has no infinities: a token the model rules out entirely reports this, as vLLM's server does
LOWEST_LOGPROB = -9999.0


class CompletionShape:
    """Response bodies of /v1/completions. A request that asks for logprobs (num_top: the
    alternatives each token reports) gets them in the legacy completions' layout: tokens,
    token_logprobs, top_logprobs and text_offset, each a list with one entry a token."""

    object = "text_completion"
    prefix = "cmpl-"

    def __init__(self, model: str, tokenizer: Tokenizer):
        self.id = self.prefix + uuid.uuid4().hex
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.num_top: int | None = None         # set once the request is parsed
        self.text_offset = 0                    # where the next token's text starts in the output

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def response(self, final: Update) -> dict:
        choice = {"index": 0, "text": final.text, "logprobs": self.logprobs(final.token_logprobs),
                  "finish_reason": final.finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": final.usage}

    def first_chunk(self) -> dict | None:
        return None

    def chunk(self, delta: str, finish_reason: str | None, usage: dict | None,
              logprobs: list[dict[int, Logprob]] | None = None) -> dict:
        choice = {"index": 0, "text": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def logprobs(self, entries: list[dict[int, Logprob]] | None) -> dict | None:
        """The entries of the tokens since the last call in the legacy layout (None: not asked):
        each token's top_logprobs holds it and its alternatives, as vLLM's server gives them."""
        if entries is None:
            return None
        text = self.tokenizer.token_text
        tokens, values, tops, offsets = [], [], [], []
        for entry in entries:
            token = next(iter(entry))
            tokens.append(text(token))
            values.append(_finite(entry[token].logprob))
            tops.append({text(t): _finite(lp.logprob) for t, lp in entry.items()})
            offsets.append(self.text_offset)
            self.text_offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.object), "choices": [], "usage": usage}


class ChatShape(CompletionShape):
    """Response bodies of /v1/chat/completions."""

    object = "chat.completion.chunk"
    prefix = "chatcmpl-"

    def response(self, final: Update) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                  "logprobs": self.logprobs(final.token_logprobs), "finish_reason": final.finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": final.usage}

    def first_chunk(self) -> dict:
        # OpenAI opens a chat stream with the role; sent at once, it also flushes the headers
        return self._chat_chunk({"role": "assistant", "content": ""}, None, None, None)

    def chunk(self, delta: str, finish_reason: str | None, usage: dict | None,
              logprobs: list[dict[int, Logprob]] | None = None) -> dict:
        return self._chat_chunk({"content": delta} if delta else {}, finish_reason, usage, self.logprobs(logprobs))

    def _chat_chunk(self, delta: dict, finish_reason: str | None, usage: dict | None, logprobs: dict | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def logprobs(self, entries: list[dict[int, Logprob]] | None) -> dict | None:
        """Chat's layout: {"content": one {token, logprob, bytes, top_logprobs} a token}."""
        if entries is None:
            return None
        content = []
        for entry in entries:
            token = next(iter(entry))
            content.append({**self._token(token, entry[token]),
                            "top_logprobs": [self._token(t, lp) for t, lp in _by_rank(entry, self.num_top)]})
        return {"content": content}

    def _token(self, token: int, logprob: Logprob) -> dict:
        return {"token": self.tokenizer.token_text(token), "logprob": _finite(logprob.logprob),
                "bytes": list(self.tokenizer.token_bytes(token))}


def _by_rank(entry: dict[int, Logprob], num_top: int | None) -> list[tuple[int, Logprob]]:
    """An entry's num_top likeliest tokens, likeliest first (the emitted token among them where
    it is one of them)."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:num_top or 0]


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


async def sse(stream: RequestStream, shape: CompletionShape, include_usage: bool):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. If the client
    disconnects, Starlette cancels this generator at its await and `finally` aborts the request."""
    try:
        first = shape.first_chunk()
        if first is not None:
            yield _event(first)
        sent = sent_tokens = 0
        while True:
            try:
                update = await stream.next()
            except EngineFailure as error:
                yield _event(ApiError(500, str(error), type="server_error").body())
                break
            delta, sent = update.text[sent:], len(update.text)
            is_last = update.finish_reason is not None
            # the logprobs of the tokens since the last chunk (the text of a token may come later:
            # a stop string's first characters, or part of a character, are held back)
            logprobs = None if update.logprobs is None else update.token_logprobs[sent_tokens:]
            if delta or is_last or logprobs:
                sent_tokens = update.num_output_tokens
                yield _event(shape.chunk(delta, update.finish_reason,
                                         update.usage if is_last and not include_usage else None, logprobs))
            if is_last:
                if include_usage:
                    yield _event(shape.usage_chunk(update.usage))
                break
        yield "data: [DONE]\n\n"
    finally:
        stream.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
