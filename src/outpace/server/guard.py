"""Guard: the checks every request passes before a route sees it, as ASGI middleware.

In order: the Host header (against DNS rebinding), the API key (every route but /health), a JSON
content type on POST (a web page cannot send one without CORS allowing it), and the declared body
size. Each refusal is an OpenAI-shaped error; the body is never read.
"""
from __future__ import annotations

import hmac
from typing import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from outpace.server.config import ServerConfig
from outpace.server.protocol import ApiError

OPEN_PATHS = ("/health",)       # served without the API key


class Guard:
    def __init__(self, app, config: ServerConfig, max_body_bytes: int, on_rejected: Callable[[], None]):
        self.app = app
        self.api_key = config.api_key.encode() if config.api_key is not None else None
        self.allowed_hosts = None if config.allowed_hosts is None else [h.lower() for h in config.allowed_hosts]
        self.max_body_bytes = max_body_bytes
        self.on_rejected = on_rejected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.check(scope["method"], scope["path"], Headers(scope=scope))
        if error is None:
            await self.app(scope, receive, send)
            return
        self.on_rejected()
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        await JSONResponse(error.body(), error.status, headers=headers)(scope, receive, send)

    def check(self, method: str, path: str, headers: Headers) -> ApiError | None:
        host = headers.get("host", "")
        if self.allowed_hosts is not None and not self._is_allowed(host):
            return ApiError(400, f"the Host header {host[:100]!r} is not served here; serve it with --allowed-hosts",
                            code="invalid_host")
        if self.api_key is not None and path not in OPEN_PATHS and not self._has_key(headers):
            return ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        if method == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return ApiError(415, f"the body must be JSON sent as 'Content-Type: application/json', got "
                                     f"{media_type[:100]!r}", code="unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and not length.isdigit():
                return ApiError(400, f"Content-Length {length[:100]!r} is not a number of bytes")
            if length is not None and int(length) > self.max_body_bytes:
                return ApiError(413, f"the body has {length} bytes; this server takes at most {self.max_body_bytes} "
                                     "(--max-body-bytes)", code="request_too_large")
        return None

    def _is_allowed(self, host: str) -> bool:
        # "name:port", "[v6 address]:port" or either without a port
        if host.startswith("["):
            name = host[1:host.find("]")]
        else:
            name = host.split(":")[0] if host.count(":") == 1 else host
        name = name.lower()
        return any(a == "*" or a == name or (a.startswith("*.") and name.endswith(a[1:])) for a in self.allowed_hosts)

    def _has_key(self, headers: Headers) -> bool:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key)
