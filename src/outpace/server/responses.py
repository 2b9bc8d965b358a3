"""Response bodies in OpenAI's shapes: whole responses and server-sent event streams of chunks.
A request for n choices runs as n requests in the engine, choice i streamed with index i."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from outpace.engine.sequence import SpecStats
from outpace.sampling.logprobs import Logprob
from outpace.server.async_engine import SPEC_COUNTS, EngineFailure, RequestStream, Update, spec_figures, usage_body
from outpace.server.protocol import ApiError
from outpace.weights.tokenizer import Tokenizer

# JSON has no infinities: a token the model rules out entirely reports this, as vLLM's server does
LOWEST_LOGPROB = -9999.0


class CompletionShape:
    """Response bodies of /v1/completions. A request that asks for logprobs (num_top: the
    alternatives each token reports) gets them in the legacy completions' layout: tokens,
    token_logprobs, top_logprobs and text_offset, each a list with one entry a token. With echo
    the text, and the logprobs, begin with the prompt's (its first token's logprob null)."""

    object = "text_completion"
    prefix = "cmpl-"

    def __init__(self, model: str, tokenizer: Tokenizer):
        self.id = self.prefix + uuid.uuid4().hex
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.num_top: int | None = None         # set once the request is parsed
        self.n = 1                              # choices a prompt: choice i is prompt i // n's
        self.text_offsets: dict[int, int] = {}  # per choice, where its next token's text starts
        # where the request echoes its prompts: each one's text and ids
        self.echoes: list[tuple[str, list[int]]] | None = None

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def response(self, finals: list[Update]) -> dict:
        choices = [{"index": i, "text": self.echo(i) + final.text,
                    "logprobs": self.logprobs(i, self.echoed(i, final, final.token_logprobs)),
                    "finish_reason": final.finish_reason} for i, final in enumerate(finals)]
        return {**self._head(self.object), "choices": choices, "usage": usage_of(finals, self.n)}

    def echo(self, index: int) -> str:
        """The text choice `index` opens with: its prompt's where the request echoes them."""
        return "" if self.echoes is None else self.echoes[index // self.n][0]

    def echoed(self, index: int, update: Update, entries: list | None) -> list | None:
        """entries after the prompt's where the request echoes it: {first token: None}, then the
        prompt's logprobs (None where logprobs are not asked)."""
        if self.echoes is None or entries is None:
            return entries
        return [{self.echoes[index // self.n][1][0]: None}] + update.prompt_logprobs[1:] + entries

    def first_chunk(self, index: int) -> dict | None:
        return None

    def chunk(self, index: int, delta: str, finish_reason: str | None, usage: dict | None,
              logprobs: list[dict[int, Logprob]] | None = None) -> dict:
        choice = {"index": index, "text": delta, "logprobs": self.logprobs(index, logprobs),
                  "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def logprobs(self, index: int, entries: list[dict[int, Logprob]] | None) -> dict | None:
        """Choice `index`'s entries of the tokens since the last call in the legacy layout (None:
        not asked): each token's top_logprobs holds it and its alternatives, as vLLM's server
        gives them."""
        if entries is None:
            return None
        text = self.tokenizer.token_text
        tokens, values, tops, offsets = [], [], [], []
        for entry in entries:
            token = next(iter(entry))
            tokens.append(text(token))
            scored = entry[token] is not None      # an echoed prompt's first token has no logprob
            values.append(_finite(entry[token].logprob) if scored else None)
            tops.append({text(t): _finite(lp.logprob) for t, lp in entry.items()} if scored else None)
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.object), "choices": [], "usage": usage}


class ChatShape(CompletionShape):
    """Response bodies of /v1/chat/completions."""

    object = "chat.completion.chunk"
    prefix = "chatcmpl-"

    def response(self, finals: list[Update]) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": final.text},
                    "logprobs": self.logprobs(i, final.token_logprobs), "finish_reason": final.finish_reason}
                   for i, final in enumerate(finals)]
        return {**self._head("chat.completion"), "choices": choices, "usage": usage_of(finals, self.n)}

    def first_chunk(self, index: int) -> dict:
        # OpenAI opens a chat stream with the role; sent at once, it also flushes the headers
        return self._chat_chunk(index, {"role": "assistant", "content": ""}, None, None, None)

    def chunk(self, index: int, delta: str, finish_reason: str | None, usage: dict | None,
              logprobs: list[dict[int, Logprob]] | None = None) -> dict:
        return self._chat_chunk(index, {"content": delta} if delta else {}, finish_reason, usage,
                                self.logprobs(index, logprobs))

    def _chat_chunk(self, index: int, delta: dict, finish_reason: str | None, usage: dict | None,
                    logprobs: dict | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def logprobs(self, index: int, entries: list[dict[int, Logprob]] | None) -> dict | None:
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


def usage_of(finals: list[Update], n: int) -> dict:
    """A response's usage: its choices' output tokens and speculation summed, each prompt counted
    once (n choices a prompt; with the prompt tokens every choice of it found cached)."""
    if len(finals) == 1:
        return finals[0].usage
    prompt, output = sum(f.num_prompt_tokens for f in finals[::n]), sum(f.num_output_tokens for f in finals)
    cached = sum(min(f.num_cached_tokens for f in finals[i:i + n]) for i in range(0, len(finals), n))
    specs = [f.spec for f in finals if f.spec is not None]
    total = SpecStats(**{k: sum(s[k] for s in specs) for k in SPEC_COUNTS})
    return usage_body(prompt, output, cached, spec_figures(total) if specs else None)


def _by_rank(entry: dict[int, Logprob], num_top: int | None) -> list[tuple[int, Logprob]]:
    """An entry's num_top likeliest tokens, likeliest first (the emitted token among them where
    it is one of them)."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:num_top or 0]


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


async def sse(streams: list[RequestStream], shape: CompletionShape, include_usage: bool):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`: each choice's
    chunks as its updates come, after all of them its usage where include_usage asks (else each
    choice's last chunk carries its own). If the client disconnects, Starlette cancels this
    generator at its await and `finally` aborts the requests."""
    chunks: asyncio.Queue = asyncio.Queue()
    pumps = []
    try:
        for index in range(len(streams)):
            first = shape.first_chunk(index)
            if first is not None:
                yield _event(first)
        pumps = [asyncio.create_task(_pump(i, stream, shape, include_usage, chunks)) for i, stream in enumerate(streams)]
        finals, failed = [], False
        while len(finals) < len(streams) and not failed:
            kind, item = await chunks.get()
            if kind == "final":
                finals.append(item)
            else:
                yield _event(item)
                failed = kind == "error"
        if include_usage and not failed:
            yield _event(shape.usage_chunk(usage_of([f for _, f in sorted(finals, key=lambda item: item[0])],
                                                    shape.n)))
        yield "data: [DONE]\n\n"
    finally:
        for pump in pumps:
            pump.cancel()
        for stream in streams:
            stream.cancel()


async def _pump(index: int, stream: RequestStream, shape: CompletionShape, include_usage: bool,
                chunks: asyncio.Queue) -> None:
    """Choice `index`'s chunks onto `chunks` as ("chunk", body), then ("final", (index, its last
    update)), or ("error", body) where the engine failed it, or where building a chunk did (the
    stream then ends with that error rather than waiting for a choice that will not come)."""
    try:
        await _choice_chunks(index, stream, shape, include_usage, chunks)
    except Exception as error:
        chunks.put_nowait(("error", ApiError(500, f"internal server error: {error!r}", type="server_error").body()))


async def _choice_chunks(index: int, stream: RequestStream, shape: CompletionShape, include_usage: bool,
                         chunks: asyncio.Queue) -> None:
    sent = sent_tokens = 0
    echo = shape.echo(index) if shape.echoes is not None else None
    while True:
        try:
            update = await stream.next()
        except EngineFailure as error:
            chunks.put_nowait(("error", ApiError(500, str(error), type="server_error").body()))
            return
        delta, sent = update.text[sent:], len(update.text)
        is_last = update.finish_reason is not None
        # the logprobs of the tokens since the last chunk (the text of a token may come later: a
        # stop string's first characters, or part of a character, are held back)
        logprobs = None if update.logprobs is None else update.token_logprobs[sent_tokens:]
        if echo is not None:                # the first chunk opens with the prompt
            delta, logprobs, echo = echo + delta, shape.echoed(index, update, logprobs), None
        if delta or is_last or logprobs:
            sent_tokens = update.num_output_tokens
            chunks.put_nowait(("chunk", shape.chunk(index, delta, update.finish_reason,
                                                    update.usage if is_last and not include_usage else None,
                                                    logprobs)))
        if is_last:
            chunks.put_nowait(("final", (index, update)))
            return


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
