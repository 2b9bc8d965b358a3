"""The HTTP server: OpenAI-compatible routes over one AsyncEngine.

  GET  /v1/models             the one served model
  POST /v1/completions        prompt (text or token ids, or a batch of either) -> text, streamed (SSE) or not
  POST /v1/chat/completions   messages, formatted with the model's chat template
  GET  /health                200 while the engine loop runs, with running/waiting counts; else 503
  GET  /metrics               Prometheus text

A request may leave out `model` (the one served is meant). A request for n choices runs as n
requests in the engine (choices, below). Where it asks for logprobs (completions:
`logprobs` N; chat: `logprobs` true, `top_logprobs` N) each token comes with the target's
log-probability of it and of its N likeliest alternatives (sampling/logprobs.py), in the layout of
each route, streamed with the chunk that follows the token.

Every response carries usage, with the prompt tokens found cached from an earlier or a running
request in usage.prompt_tokens_details.cached_tokens (prefix caching and sharing; n choices count
their prompt once, as cached as far as every choice found it so; the extension field `cache_salt` keeps a
request to prefixes of its own salt) and the request's speculation figures in usage.speculation (a
streamed response carries it on its last choice chunk, or in a separate final chunk with no choices
when stream_options.include_usage asks for OpenAI's layout). A client that disconnects cancels its
request: the stream's generator is cancelled, and its `finally` aborts the request in the engine.

A request passes the Guard (host, API key, content type, declared size: server/guard.py), then its
body is read within the size limit and the read timeout on the event loop, and parsed, checked and
tokenized in worker threads (server/prompts.py) before it reaches the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from outpace.config import SamplingParams
from outpace.engine.llm_engine import LLMEngine
from outpace.errors import OutpaceError
from outpace.server.async_engine import AsyncEngine, EngineFailure, RequestStream, Update
from outpace.server.config import ServerConfig
from outpace.server.guard import Guard
from outpace.server.metrics import CONTENT_TYPE, Metrics
from outpace.server.prompts import PromptBuilder
from outpace.server.protocol import ApiError, bad_request
from outpace.server.responses import ChatShape, CompletionShape, sse

log = logging.getLogger("outpace.server")

DISCONNECT_POLL_S = 0.5      # how often a non-streaming request checks that its client is still there
GONE = 499                   # the status logged for a request whose client left (nobody reads it)


def build_app(engine: LLMEngine, model_name: str, config: ServerConfig | None = None,
              engine_thread: bool = True) -> FastAPI:
    """The HTTP API over `engine`. engine_thread: the app runs the engine loop in a thread of its
    own; False: the caller runs it (app.state.engine.run()), and the app's shutdown ends it."""
    config = config or ServerConfig()
    metrics = Metrics(model_name)
    runner = AsyncEngine(engine, metrics, config.log_interval_s)
    tokenizer = engine.tokenizer
    max_model_len = engine.config.max_model_len
    max_body_bytes = config.body_limit(max_model_len)
    prompts = PromptBuilder(tokenizer, model_name, max_model_len, config.special_tokens_in_content)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            runner.start()
        yield
        runner.stop()
        prompts.close()

    app = FastAPI(title="outpace", lifespan=lifespan)
    app.state.engine = runner
    app.state.metrics = metrics
    app.add_middleware(Guard, config=config, max_body_bytes=max_body_bytes, on_rejected=metrics.on_rejected)
    if config.allowed_origins:      # added last, so outermost: preflight requests never meet the Guard
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])

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
        return Response(metrics.render(runner.num_running, runner.num_waiting), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionShape(model_name, tokenizer))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatShape(model_name, tokenizer))

    async def generate(request: Request, shape: CompletionShape):
        try:
            raw = await asyncio.wait_for(read_body(request, max_body_bytes), config.read_timeout_s)
        except ClientDisconnect:
            log.info("%s %s: the client disconnected while sending its request", request.method, request.url.path)
            return Response(status_code=GONE)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {config.read_timeout_s:g} s") from None
        prompt = await prompts.build(raw, is_chat=isinstance(shape, ChatShape))
        parsed = prompt.request
        shape.num_top, shape.n = prompt.params[0].logprobs, parsed.n
        if parsed.echo:         # each prompt's text as sent (token ids decoded) and its ids
            shape.echoes = [(p if isinstance(p, str) else tokenizer.decode(ids), ids)
                            for p, ids in zip(parsed.prompts, prompt.token_ids)]
        streams = []
        try:
            # the choices of the first prompt, then of the next: choice index = prompt * n + its own
            for ids, params in zip(prompt.token_ids, prompt.params):
                for choice in choices(params, parsed.n):
                    streams.append(await runner.add(shape.id, ids, choice, parsed.speculate, parsed.cache_salt))
        except (OutpaceError, EngineFailure) as error:
            for stream in streams:
                stream.cancel()
            if isinstance(error, EngineFailure):
                raise ApiError(503, str(error), type="server_error") from None
            raise bad_request(error, parsed.prompt_param) from None
        if parsed.stream:
            return StreamingResponse(sse(streams, shape, parsed.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        finals = await asyncio.gather(*(wait_final(stream, request) for stream in streams), return_exceptions=True)
        for final in finals:
            if isinstance(final, BaseException):
                raise final
        if any(final is None for final in finals):
            return Response(status_code=GONE)
        return JSONResponse(shape.response(finals))

    return app


def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling parameters of a request's n choices: each samples apart, a seed s giving choice
    i the seed s + i (mod 2^63; without one each draws its own)."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % 2**63) for i in range(n)]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes `limit` bytes (a body sent without a
    Content-Length, which the Guard checks before reading, is counted as it arrives)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body passed {limit} bytes, the most this server takes (--max-body-bytes)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


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
