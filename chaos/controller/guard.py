"""The controller's gate, in front of FastAPI: the token, then the body's size, before any route reads a byte.

FastAPI reads and parses a route's JSON body before it solves the route's dependencies, so a token checked in a
dependency comes after the parsing: anyone could make the controller parse a body of any size. This ASGI middleware
answers 401 to a request without the token (compared in constant time) and 413 to a body over ``max_body_bytes``,
by its Content-Length or, for a chunked body, as soon as the bytes read pass the limit.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json"})
MAX_BODY_BYTES = 64 * 1024


class Guard:
    """Every path but ``PUBLIC_PATHS`` needs ``Authorization: Bearer <token>``; every body is at most
    ``max_body_bytes``. A refusal is a JSON ``{"detail": ...}`` like FastAPI's own."""

    def __init__(self, app: ASGIApp, token: str, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        if not token:
            raise ValueError("the guard needs a token")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.token = token.encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.lower(): value for key, value in scope.get("headers", [])}
        if scope["path"] not in PUBLIC_PATHS and not self._authorized(headers.get(b"authorization", b"")):
            await _refuse(send, 401, "needs 'Authorization: Bearer <controller token>'", {"www-authenticate": "Bearer"})
            return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            await _refuse(send, 413, f"the body is limited to {self.max_body_bytes} bytes")
            return
        await self._bounded(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, given = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, with a receive that stops a chunked body past the limit: the app sees the client gone, and the
        client gets the 413 instead of whatever the app would have answered."""
        num_bytes, refused, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal num_bytes, refused
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes and not refused:
                    refused = True
                    if not started:
                        await _refuse(send, 413, f"the body is limited to {self.max_body_bytes} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)


async def _refuse(send: Send, status: int, detail: str, extra_headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(key.encode(), value.encode()) for key, value in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
