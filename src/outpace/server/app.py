"""The HTTP server: OpenAI-compatible routes over one AsyncEngine.

  GET  /v1/models             the one served model
  POST /v1/completions        prompt (text or token ids) -> text, streamed (SSE) or not
  POST /v1/chat/completions   messages, formatted with the model's chat template
  GET  /health                200 while the engine loop runs, with running/waiting counts; else 503
  GET  /metrics               Prometheus text

Every response carries usage, with the request's speculation figures in usage.speculation (a
streamed response carries it on its last choice chunk, or in a separate final chunk with no choices
when stream_options.include_usage asks for OpenAI's layout). A client that disconnects cancels its
request: the stream's generator is cancelled, and its `finally` aborts the request in the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from outpace.engine.llm_engine import LLMEngine
from outpace.errors import OutpaceError
from outpace.server.async_engine import AsyncEngine, EngineFailure, RequestStream, Update
from outpace.server.metrics import Metrics
from outpace.server.protocol import ApiError, GenerateRequest, bad_request, parse_chat, parse_completion, parse_json

DISCONNECT_POLL_S = 0.5      # how often a non-streaming request checks that its client is still there


def build_app(engine: LLMEngine, model_name: str, log_interval_s: float = 10.0,
              engine_thread: bool = True) -> FastAPI:
    """The HTTP API over `engine`. engine_thread: the app runs the engine loop in a thread of its
    own; False: the caller runs it (app.state.engine.run()), and the app's shutdown ends it."""
    metrics = Metrics(model_name)
    runner = AsyncEngine(engine, metrics, log_interval_s)
    max_model_len = engine.config.max_model_len
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            runner.start()
        yield
        runner.stop()

    app = FastAPI(title="outpace", lifespan=lifespan)
    app.state.engine = runner

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        if error.status < 500:
            metrics.on_rejected()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                                     type=kind).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        return JSONResponse(ApiError(500, f"internal server error: {error!r}", type="server_error").body(),
                            status_code=500)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "outpace", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if runner.is_alive else "dead", "model": model_name,
                "num_running": runner.num_running, "num_waiting": runner.num_waiting}
        return JSONResponse(body, status_code=200 if runner.is_alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(runner.num_running, runner.num_waiting),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion(parse_json(await request.body()))
        return await generate(request, parsed, CompletionShape(model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parsed = parse_chat(parse_json(await request.body()))
        return await generate(request, parsed, ChatShape(model_name))

    async def generate(request: Request, parsed: GenerateRequest, shape: "CompletionShape"):
        if parsed.model != model_name:
            raise ApiError(404, f"model {parsed.model!r} is not served here; this server serves {model_name!r} "
                                "(see GET /v1/models)", "model", code="model_not_found")
        prompt_ids = tokenize(engine.tokenizer, parsed)
        params = parsed.sampling_params(len(prompt_ids), max_model_len)
        try:
            stream = await runner.add(shape.id, prompt_ids, params, parsed.speculate)
        except OutpaceError as error:
            raise bad_request(error, parsed.prompt_param) from None
        except EngineFailure as error:
            raise ApiError(503, str(error), type="server_error") from None
        if parsed.stream:
            return StreamingResponse(sse(stream, shape, parsed.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        final = await wait_final(stream, request)
        if final is None:
            return Response(status_code=499)     # nobody reads it: the client closed the connection
        return JSONResponse(shape.response(final))

    return app


def tokenize(tokenizer, parsed: GenerateRequest) -> list[int]:
    try:
        if parsed.messages is not None:
            text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        if isinstance(parsed.prompt, str):
            return tokenizer.encode(parsed.prompt)
        return list(parsed.prompt)
    except OutpaceError as error:
        raise bad_request(error, parsed.prompt_param) from None


async def wait_final(stream: RequestStream, request: Request) -> Update | None:
    """The last update of a non-streamed request, or None (and the request aborted) if the client
    went away meanwhile."""
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                update = await asyncio.wait_for(stream.next(), DISCONNECT_POLL_S)
                if update.finish_reason is not None:
                    return update
            except asyncio.TimeoutError:
                pass
            # updates may come faster than the poll interval: check by the clock, not on timeouts
            if loop.time() - checked >= DISCONNECT_POLL_S:
                checked = loop.time()
                if await request.is_disconnected():
                    return None
    except EngineFailure as error:
        raise ApiError(500, str(error), type="server_error") from None
    finally:
        stream.cancel()


async def sse(stream: RequestStream, shape: "CompletionShape", include_usage: bool):
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
