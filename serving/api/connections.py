"""Connection hygiene below the ASGI app: a header read timeout, a cap on connections that have not yet
presented a valid API key, and OpenAI-shaped errors for requests h11 cannot parse.

uvicorn has a keep-alive timeout but none for a request whose headers arrive a byte at a time (any data
cancels the keep-alive timer), so a slow client could hold a connection forever. The body read timeout
and the body limits (chunked bodies included) are the middleware's (serving/api/middleware.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.api.errors import error_body
from serving.config import ServiceSection


@dataclass
class ConnectionGuard:
    """Which open connections (by peer address) have authenticated; shared by the protocol and the app.

    At the cap a new connection evicts the oldest unauthenticated one that is idle between requests or
    still sending headers (a slow client holds its slot only until someone needs it); if every one is
    mid-request the new connection gets a 503. The limits are the server config's (service.header_timeout_s,
    service.keep_alive_s, service.max_unauthenticated_connections; service.body_timeout_s is the middleware's)."""

    limits: ServiceSection
    unauthenticated: dict[tuple[str, int], Any] = field(default_factory=dict)  # peer -> protocol, oldest first
    authenticated_peers: set[tuple[str, int]] = field(default_factory=set)
    refused_total: int = 0
    evicted_total: int = 0

    def opened(self, peer: tuple[str, int], protocol: Any) -> bool:
        if len(self.unauthenticated) >= self.limits.max_unauthenticated_connections:
            victim = next((p for p in self.unauthenticated.values() if p.evictable()), None)
            if victim is None:
                self.refused_total += 1
                return False
            self.evicted_total += 1
            victim.evict()
        self.unauthenticated[peer] = protocol
        return True

    def authenticated(self, peer: Any) -> None:
        key = tuple(peer) if peer else None
        if key in self.unauthenticated:
            del self.unauthenticated[key]  # type: ignore[arg-type]
            self.authenticated_peers.add(key)  # type: ignore[arg-type]

    def closed(self, peer: tuple[str, int]) -> None:
        self.unauthenticated.pop(peer, None)
        self.authenticated_peers.discard(peer)


def _json_response(status: int, reason: bytes, body: dict[str, Any]) -> list[Any]:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
               (b"content-length", str(len(payload)).encode())]
    return [h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=payload),
            h11.EndOfMessage()]


def protocol_class(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the guard's limits (pass as ``uvicorn.Config(http=...)``)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _peer: tuple[str, int] | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._peer = tuple(self.client) if self.client else ("?", id(self))  # type: ignore[assignment]
            assert self._peer is not None
            if not guard.opened(self._peer, self):
                self._peer = None
                payload = json.dumps(error_body(503, "too many connections without an authenticated request",
                                                code="too_many_connections")).encode()
                # no request has been read, so h11 will not frame a response: write it as bytes
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
                transport.close()
                return
            self._arm_header_timer()

        def evictable(self) -> bool:
            """Between requests or still sending headers: nothing of ours runs on this connection."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def evict(self) -> None:
            if self._peer is not None:
                guard.closed(self._peer)
                self._peer = None
            self._disarm_header_timer()
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            if self._peer is not None:
                guard.closed(self._peer)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request's headers are complete
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                # idle for up to keep_alive_s (uvicorn closes it then), then header_timeout_s for the headers
                self._arm_header_timer(guard.limits.keep_alive_s)

        def send_400_response(self, msg: str) -> None:
            """h11 could not parse the request (bad Content-Length, bad header): an OpenAI error, not text."""
            events = _json_response(400, b"Bad Request", error_body(
                400, f"malformed HTTP request: {msg}", code="invalid_http_request"))
            try:
                self._send_raw(events)
            except h11.LocalProtocolError:
                self.transport.close()

        def _send_raw(self, events: list[Any]) -> None:
            for event in events:
                self.transport.write(self.conn.send(event) or b"")
            self.transport.close()

        def _arm_header_timer(self, idle_allowance_s: float = 0.0) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(idle_allowance_s + guard.limits.header_timeout_s,
                                                      self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

    return GuardedH11Protocol
