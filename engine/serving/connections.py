"""Who gets in: the drain, the cap on requests in progress and the cap on one address's connections.

- ``--max-connections`` counts connections with a request in progress (probes aside). An idle keep-alive connection,
  or one that has not sent a whole request yet, holds no handler and no engine work, and the keep-alive timeout
  closes it; counted, such sockets locked everyone out (60 that sent nothing, against a cap of 50, made every real
  request a 503 until they timed out).
- ``--max-connections-per-peer`` counts every open connection of one address, idle ones included: past it a new
  connection is answered 503 at once and closed, so one host cannot hold the server's sockets.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from engine.serving.protocol import ApiError

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # answered even when draining or at the connection cap
DRAINING = "the server is shutting down: it finishes the streams in flight and takes no new request"


@dataclass
class Lifecycle:
    """What the app knows of its listener: whether it drains (``drain``), how many connections are open
    (``start_server`` tells it how to count them) and how many requests are in progress, of ``max_connections``."""

    max_connections: int
    is_draining: bool = False
    count_connections: Callable[[], int] = field(default=lambda: 0)
    num_requests_in_progress: int = 0


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)


@web.middleware
async def gate_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Before a request is read: none but probes while draining or past the cap on requests in progress."""
    if request.path in PROBE_PATHS:
        return await handler(request)
    lifecycle = request.app[LIFECYCLE]
    if lifecycle.is_draining:
        raise ApiError(503, DRAINING, error_type="server_error", headers={"Retry-After": "5"}, reason="draining")
    lifecycle.num_requests_in_progress += 1
    try:
        if lifecycle.num_requests_in_progress > lifecycle.max_connections:
            message = (
                f"{lifecycle.num_requests_in_progress} requests are in progress, more than this server takes at once "
                f"({lifecycle.max_connections}; --max-connections)"
            )
            raise ApiError(503, message, error_type="server_error",
                           headers={"Retry-After": "1", "Connection": "close"}, reason="connection_cap")  # fmt: skip
        return await handler(request)
    finally:
        lifecycle.num_requests_in_progress -= 1


class PeerConnections:
    """Open connections per peer address. A connection that would be its address's ``max_per_peer + 1``-th is
    answered a 503 as soon as it opens (before it sends anything: it may never) and closed; ``on_refused`` counts it.

    ``install`` wraps the connection callbacks of aiohttp's ``web.Server`` (the protocol factory of the listener),
    the one place every connection passes through before it sends a byte."""

    def __init__(self, max_per_peer: int, on_refused: Callable[[], None]) -> None:
        self.max_per_peer = max_per_peer
        self._on_refused = on_refused
        self._num_open: Counter[str] = Counter()
        self._peer_of: dict[object, str] = {}  # handler -> address, for the connections counted

    def install(self, server: web.Server) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            self._opened(handler, transport)

        def connection_lost(handler, exc: BaseException | None = None) -> None:
            lost(handler, exc)
            peer = self._peer_of.pop(handler, None)
            if peer is not None:
                self._num_open[peer] -= 1
                if not self._num_open[peer]:
                    del self._num_open[peer]

        server.connection_made, server.connection_lost = connection_made, connection_lost

    def _opened(self, handler, transport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) else str(peername)
        if self._num_open[peer] >= self.max_per_peer:
            self._on_refused()
            transport.write(self._refusal(peer))
            transport.close()  # after the refusal is written; aiohttp's handler ends with the connection
            return
        self._num_open[peer] += 1
        self._peer_of[handler] = peer

    def _refusal(self, peer: str) -> bytes:
        message = (
            f"{self._num_open[peer]} connections from {peer} are open, as many as this server takes from one address "
            f"({self.max_per_peer}; --max-connections-per-peer): close one (an idle keep-alive one) and retry"
        )
        body = json.dumps(ApiError(503, message, error_type="server_error").body()).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + body
