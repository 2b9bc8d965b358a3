"""The HTTP listener: uvicorn over h11, with deadlines for idle and slow connections.

uvicorn closes a kept-alive connection that sends nothing for keep_alive_s after a response, but
waits forever for the headers of a request that trickles in (or of a connection that opened and
never spoke). HeaderDeadline closes a connection whose next request's headers are not complete
read_timeout_s after it opened or after its last response; the app times the body itself.
"""
from __future__ import annotations

import functools

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from outpace.server.config import ServerConfig


class HeaderDeadline(H11Protocol):
    def __init__(self, *args, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.deadline = None        # the timer; armed while the connection waits for a request's headers

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        # a new request replaces self.cycle: the deadline then finds another cycle and leaves it be
        self.deadline = self.loop.call_later(self.header_timeout_s, self._expire, self.cycle)

    def _expire(self, waiting_after) -> None:
        self.deadline = None
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, config: ServerConfig, **options) -> uvicorn.Config:
    """uvicorn's config for `app` with this server's deadlines; options go to uvicorn.Config
    (host, port, log_level, ...)."""
    protocol = functools.partial(HeaderDeadline, header_timeout_s=config.read_timeout_s)
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=config.keep_alive_s, **options)
