"""Response bodies in OpenAI's shapes: whole responses and server-sent event streams of chunks."""
from __future__ import annotations

import json
import time
import uuid

from outpace.server.async_engine import EngineFailure, RequestStream, Update
from outpace.server.protocol import ApiError


class CompletionShape:
    """Response bodies of /v1/completions."""

    object = "text_completion"
    prefix = "cmpl-"

    def __init__(self, model: str):
        self.id = self.prefix + uuid.uuid4().hex
        self.model = model
        self.created = int(time.time())

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def response(self, final: Update) -> dict:
        choice = {"index": 0, "text": final.text, "logprobs": None, "finish_reason": final.finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": final.usage}

    def first_chunk(self) -> dict | None:
        return None

    def chunk(self, delta: str, finish_reason: str | None, usage: dict | None) -> dict:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.object), "choices": [], "usage": usage}


class ChatShape(CompletionShape):
    """Response bodies of /v1/chat/completions."""

    object = "chat.completion.chunk"
    prefix = "chatcmpl-"

    def response(self, final: Update) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": final.text}, "logprobs": None,
                  "finish_reason": final.finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": final.usage}

    def first_chunk(self) -> dict:
        # OpenAI opens a chat stream with the role; sent at once, it also flushes the headers
        return self._chat_chunk({"role": "assistant", "content": ""}, None, None)

    def chunk(self, delta: str, finish_reason: str | None, usage: dict | None) -> dict:
        return self._chat_chunk({"content": delta} if delta else {}, finish_reason, usage)

    def _chat_chunk(self, delta: dict, finish_reason: str | None, usage: dict | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage}


async def sse(stream: RequestStream, shape: CompletionShape, include_usage: bool):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. If the client
    disconnects, Starlette cancels this generator at its await and `finally` aborts the request."""
    try:
        first = shape.first_chunk()
        if first is not None:
            yield _event(first)
        sent = 0
        while True:
            try:
                update = await stream.next()
            except EngineFailure as error:
                yield _event(ApiError(500, str(error), type="server_error").body())
                break
            delta, sent = update.text[sent:], len(update.text)
            is_last = update.finish_reason is not None
            if delta or is_last:
                yield _event(shape.chunk(delta, update.finish_reason,
                                         update.usage if is_last and not include_usage else None))
            if is_last:
                if include_usage:
                    yield _event(shape.usage_chunk(update.usage))
                break
        yield "data: [DONE]\n\n"
    finally:
        stream.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
