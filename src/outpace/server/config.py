"""ServerConfig: how the HTTP server guards itself, validated on construction."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from outpace.errors import InvalidParameterError

MIB = 1 << 20
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass
class ServerConfig:
    """api_key: every route but /health wants "Authorization: Bearer <api_key>"; None: no key.
    allowed_origins: web origins whose pages may call the API (CORS); empty: none may.
    allowed_hosts: Host header names served ("*" any, "*.example.com" its subdomains); None: any.
        A server bound to loopback should serve loopback names only (`for_bind_host`): a web page
        whose name an attacker points at 127.0.0.1 (DNS rebinding) then gets 400, not the replies.
    max_body_bytes: larger bodies get 413 before they are read; None: 64 bytes per context token,
        at least 1 MiB (a whole context of token ids or escaped text fits several times over).
    read_timeout_s: a request's headers, and then its body, must arrive within this (408 or a
        closed connection otherwise); keep_alive_s: an idle kept-alive connection closes after it.
    special_tokens_in_content: parse special-token text inside chat messages as control tokens
        (unsafe: a user can forge a system turn); by default only the template's markup is.
    """

    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] | None = None
    max_body_bytes: int | None = None
    read_timeout_s: float = 30.0
    keep_alive_s: int = 5
    special_tokens_in_content: bool = False
    log_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidParameterError("the API key is empty: give a non-empty --api-key (or OUTPACE_API_KEY), "
                                        "or none to serve without one")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise InvalidParameterError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.read_timeout_s > 0:
            raise InvalidParameterError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if self.keep_alive_s < 1:
            raise InvalidParameterError(f"keep_alive_s must be >= 1, got {self.keep_alive_s}")
        if self.log_interval_s <= 0:
            raise InvalidParameterError(f"log_interval_s must be > 0, got {self.log_interval_s}")

    def body_limit(self, max_model_len: int) -> int:
        return self.max_body_bytes if self.max_body_bytes is not None else max(MIB, 64 * max_model_len)

    def for_bind_host(self, host: str) -> "ServerConfig":
        """This config, serving loopback names only when bound to loopback and no hosts were given."""
        if self.allowed_hosts is not None or not is_loopback(host):
            return self
        return ServerConfig(**{**self.__dict__, "allowed_hosts": list(LOOPBACK_HOSTS)})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:          # a name other than localhost, or "" (every address)
        return False
