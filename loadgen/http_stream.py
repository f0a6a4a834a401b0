"""The load client's HTTP/1.1 transport: one ``asyncio.Protocol`` per connection, responses parsed by httptools
(llhttp, the parser uvicorn uses), and every read handed to its stream's sink from the protocol's own callback.

Why not aiohttp's client, which the load client used before: there every read went through a stream reader, woke
the stream's task and resumed an async iterator, and that, not kvstorm's SSE parsing, was most of the 22-28 µs of
client CPU a streamed token cost (``kvstorm bench client-capacity``). Here a read costs one callback and no task
switch; a request costs one future.

What the timing rests on is unchanged: each read is stamped with ``time.perf_counter()`` as the event loop hands it
over (before it is parsed), and everything in one read shares that stamp.

Scope, what OpenAI-compatible servers need: POST with a body, http and https, keep-alive connections reused per pool,
chunked, Content-Length and close-delimited bodies. No proxies, no redirects, no compression (no Accept-Encoding is
sent, so servers answer uncompressed).

Every byte a server sends is input, so a response is bounded as servers bound requests: at most
:data:`MAX_HEADER_LINES` header lines, and at most :data:`MAX_BYTES_WITHOUT_BODY` bytes in a row that carry no body
data (the status line and headers, or after them chunk framing and trailers). Past either the exchange fails with a
:class:`TransportError` that names the bound. The body itself is the sink's to bound.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.parse
from collections.abc import Callable
from typing import Protocol

import httptools

# A response's head, and any run of bytes that brings no body data, at most (nginx and Node.js cap a request's head
# at 8-16 KiB, Go's net/http at 1 MiB; no OpenAI-compatible server sends more than a few hundred bytes).
MAX_BYTES_WITHOUT_BODY = 64 << 10
# Header lines (trailers included) one response may have: http.client's and urllib3's limit.
MAX_HEADER_LINES = 100
# Bytes parsed in one turn of the event loop, at most; the rest waits for the next turn. libuv reads a ready socket
# up to 32 times in a turn, so one flooding server could otherwise hand over megabytes at once, and every timer of the
# run (the schedule's sends, the deadlines) would wait behind their parsing: 64 KiB of the worst case (keep-alive
# comments, a line each) parse in about 10 ms.
MAX_BYTES_PER_TURN = 64 << 10
# A connection stops reading while this much of what it read waits to be parsed (asyncio's flow control): a server
# that sends faster than the client parses is slowed to the client's pace, never buffered without bound.
MAX_PENDING_BYTES = 128 << 10


class _ResponseTooLarge(Exception):
    """Raised from a parser callback when a response passes a bound; the exchange fails with its message."""


class TransportError(Exception):
    """The connection could not be made, or failed or was cut before the response ended."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its response ended."""


class ResponseSink(Protocol):
    """Where one response goes. ``abort`` fails the exchange with the given exception and cuts its connection (the
    stall watchdog's way out); ``body`` gets each piece of the body with the stamp of the read that brought it."""

    def response_started(
        self, status: int, headers: dict[str, str], abort: Callable[[BaseException], None]
    ) -> None: ...

    def body(self, data: bytes, read_ts: float) -> None: ...


class ConnectionPool:
    """Connections to one server (``base_url``: scheme, host, port and an optional path prefix), kept alive between
    requests as the server allows. Not thread-safe: one event loop."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._path_prefix = parts.path.rstrip("/")
        fixed = {"Host": parts.netloc.rpartition("@")[2], "Accept": "*/*", **(headers or {})}
        self._fixed_headers = _header_lines(fixed)
        self._idle: list[_Connection] = []
        self._backlog = _ReadBacklog()

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], sink: ResponseSink, deadline_ts: float
    ) -> None:
        """Send one POST and feed its response to ``sink`` until the response ends, by ``deadline_ts`` (perf_counter).
        Raises :class:`TransportError`, :class:`DeadlineExceeded` or what the sink's ``abort`` was given; cancelled,
        it cuts the connection. The deadline is a timer on the connection, not ``asyncio.wait_for``: that keeps every
        exception it raised in a reference cycle (its frame holds the task that holds the exception)."""
        head = (
            f"POST {self._path_prefix}{path} HTTP/1.1\r\n{self._fixed_headers}{_header_lines(headers)}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        request = head.encode("latin-1") + body
        loop = asyncio.get_running_loop()
        while True:
            connection, reused = await self._connection(deadline_ts)
            deadline = loop.call_at(
                loop.time() + deadline_ts - time.perf_counter(), connection.abort, DeadlineExceeded()
            )
            try:
                # Not kept in a local: this frame, in the traceback of the exception the future may hold, would
                # hold the future and make a reference cycle.
                await connection.start(request, sink)
            except TransportError:
                # A kept-alive connection the server closed while it sat idle fails before any byte of an answer:
                # the request never reached a handler, so it goes out once more on a new connection.
                if reused and not connection.answered:
                    continue
                raise
            finally:
                deadline.cancel()
                connection.end_exchange()
            if connection.reusable:
                self._idle.append(connection)
            return

    async def _connection(self, deadline_ts: float) -> tuple[_Connection, bool]:
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable:
                return connection, True
        loop = asyncio.get_running_loop()
        connecting = loop.create_connection(
            lambda: _Connection(self._backlog),
            self.host,
            self.port,
            ssl=self._ssl,
            server_hostname=self.host if self._ssl else None,
        )
        try:
            _, connection = await asyncio.wait_for(connecting, max(deadline_ts - time.perf_counter(), 0.0))
        except asyncio.TimeoutError:
            raise DeadlineExceeded() from None
        except OSError as error:
            raise TransportError(f"cannot connect to {self.host}:{self.port}: {error}") from error
        return connection, False

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


def _header_lines(headers: dict[str, str]) -> str:
    """The headers as they go on the wire; a line break in one (an API key pasted with its newline) would end the
    header early or smuggle another, so it is refused."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
        raise ValueError(f"a header name or value holds a line break: {sorted(headers)}")
    return lines


class _ReadBacklog:
    """Reads stamped as they arrive and parsed after the event loop has handed over every socket that was ready.

    When many streams' tokens arrive together (a server's decode step, or its timer tick), parsing each read before
    taking the next one would stamp the last read of the batch late by the parsing of all the others; stamping first
    keeps that lateness down to the reads alone. A connection's end is queued behind its reads. At most
    :data:`MAX_BYTES_PER_TURN` are parsed in one turn of the event loop."""

    def __init__(self) -> None:
        # (connection, a read and its stamp) or (connection, None, the exception its loss came with)
        self._items: list[tuple[_Connection, bytes | None, float | Exception | None]] = []
        self._is_scheduled = False

    def add(self, connection: _Connection, data: bytes | None, stamp_or_loss: float | Exception | None) -> None:
        self._items.append((connection, data, stamp_or_loss))
        self._schedule()

    def _schedule(self) -> None:
        if not self._is_scheduled:
            self._is_scheduled = True
            asyncio.get_running_loop().call_soon(self._process)

    def _process(self) -> None:
        self._is_scheduled = False
        items, self._items = self._items, []
        budget = MAX_BYTES_PER_TURN
        for position, (connection, data, stamp_or_loss) in enumerate(items):
            if budget <= 0:
                self._items[:0] = items[position:]
                self._schedule()
                return
            try:
                if data is None:
                    connection.end(stamp_or_loss)
                else:
                    budget -= len(data)
                    connection.parse(data, stamp_or_loss)
            except Exception as error:  # a bug on this side: that stream fails, visibly, and the others go on
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "reading a response failed", "exception": error}
                )
                connection.abort(TransportError(f"the client failed reading the response: {error!r}"))


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: at most one exchange at a time (no pipelining)."""

    def __init__(self, backlog: _ReadBacklog) -> None:
        self._backlog = backlog
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._sink: ResponseSink | None = None
        self._exchange: asyncio.Future | None = None
        self._headers: dict[str, str] = {}
        self._num_header_lines = 0
        # Bytes read in a row with no body data among them, and whether the current read brought some.
        self._num_bytes_without_body = 0
        self._read_had_body = False
        # Read and not yet parsed; reading pauses past MAX_PENDING_BYTES.
        self._num_pending_bytes = 0
        self._is_reading_paused = False
        self._started = False
        self._read_ts = 0.0
        self._closed = self._aborted = False
        self._complete = False
        self._keep_alive = False
        self._close_delimited = False
        self.answered = False

    @property
    def reusable(self) -> bool:
        return self._keep_alive and not self._closed

    def start(self, request: bytes, sink: ResponseSink) -> asyncio.Future:
        self.answered = False
        if self._transport is None or self._transport.is_closing():  # closed since it was picked, not yet told
            raise TransportError("the connection closed before the request")
        self._sink, self._headers, self._started, self._complete, self._keep_alive = sink, {}, False, False, False
        self._num_header_lines = self._num_bytes_without_body = 0
        self._parser = httptools.HttpResponseParser(self)
        self._exchange = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._exchange

    def end_exchange(self) -> None:
        """After the exchange's future settled, or its waiter was cancelled: an unfinished exchange loses its
        connection, since the rest of its answer would arrive as the next one's."""
        if not self._complete:
            self.abort(TransportError("request abandoned"))
        self._sink = self._exchange = None

    def abort(self, error: BaseException) -> None:
        self._aborted = True
        self._settle(error)
        self.close(abort=True)

    def close(self, *, abort: bool = False) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.abort() if abort else self._transport.close()

    def _settle(self, error: BaseException | None) -> None:
        if self._exchange is not None and not self._exchange.done():
            if error is None:
                self._exchange.set_result(None)
            else:
                self._exchange.set_exception(error)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self.answered = True
        self._backlog.add(self, data, time.perf_counter())
        self._num_pending_bytes += len(data)
        if self._num_pending_bytes > MAX_PENDING_BYTES and not self._is_reading_paused:
            self._is_reading_paused = True
            self._transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._backlog.add(self, None, exc)

    # what the backlog hands on, in arrival order

    def parse(self, data: bytes, read_ts: float) -> None:
        self._num_pending_bytes -= len(data)
        if self._is_reading_paused and self._num_pending_bytes <= MAX_PENDING_BYTES // 2:
            self._is_reading_paused = False
            if self._transport is not None and not self._transport.is_closing():
                self._transport.resume_reading()
        if self._aborted:
            return  # what was still queued has no reader
        if self._sink is None or self._complete:
            self.abort(TransportError("the server sent bytes outside a response"))
            return
        self._read_ts = read_ts
        self._read_had_body = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            cause = error.__context__
            if isinstance(cause, _ResponseTooLarge):
                self.abort(TransportError(str(cause)))
            elif cause is not None:  # a callback of this side failed: a bug here, not the server's malformed answer
                raise cause from None
            else:
                self.abort(TransportError(f"malformed HTTP response: {error}"))
            return
        self._num_bytes_without_body = 0 if self._read_had_body else self._num_bytes_without_body + len(data)
        if self._num_bytes_without_body > MAX_BYTES_WITHOUT_BODY and not self._complete:
            what = "trailers or chunk framing" if self._started else "the status line and headers"
            self.abort(TransportError(f"{what}: more than {MAX_BYTES_WITHOUT_BODY} bytes with no body data"))

    def end(self, exc: Exception | None) -> None:
        if self._aborted:
            pass  # its exchange has settled already
        elif self._close_delimited and exc is None and not self._complete:
            self.on_message_complete()
        else:
            reason = f": {exc}" if exc else ""
            where = "in the middle of the response" if self._started else "before a response"
            self._settle(TransportError(f"the connection closed {where}{reason}"))
        # The parser and the transport each refer back to this protocol: cycles the collector would have to find.
        self._parser = self._transport = None

    # httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_header_lines += 1
        if self._num_header_lines > MAX_HEADER_LINES:
            raise _ResponseTooLarge(f"more than {MAX_HEADER_LINES} header lines")
        if not self._started:  # a trailer is not read
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._started = True
        chunked = "chunked" in self._headers.get("transfer-encoding", "").lower()
        self._close_delimited = not chunked and "content-length" not in self._headers
        self._sink.response_started(self._parser.get_status_code(), self._headers, self.abort)

    def on_body(self, body: bytes) -> None:
        self._read_had_body = True
        if not self._aborted:  # the sink may have cut the exchange earlier in this read
            self._sink.body(body, self._read_ts)

    def on_message_complete(self) -> None:
        self._complete = True
        # Asked now: once the message is complete, llhttp has reset and no longer knows.
        self._keep_alive = self._parser.should_keep_alive()
        self._settle(None)
