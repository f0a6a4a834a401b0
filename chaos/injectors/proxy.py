"""A TCP proxy between clients and any server, with network faults per direction, switchable while it runs.

    client ──upstream──▶ proxy ──▶ server
    client ◀─downstream─ proxy ◀── server

Each direction of each connection is a delay line: what is read is stamped, and written once its latency has passed,
so latency delays every chunk without throttling the stream (as netem does), while a bandwidth limit does throttle
it. Faults per direction (``DirectionFaults``): latency and jitter, a bandwidth limit, slicing (writes of at most N
bytes), a stall (nothing forwarded, the sockets stay open), and a reset after N bytes of a connection. On top,
``reset_connections`` resets every open connection at once, as a crashing load balancer would, mid-stream.

The proxy runs its own event loop in a thread, so a synchronous caller (a Chaos Toolkit action) drives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from dataclasses import dataclass, fields, replace

DIRECTIONS = ("upstream", "downstream")
CHUNK_BYTES = 65536


@dataclass(frozen=True)
class DirectionFaults:
    latency_s: float = 0.0
    jitter_s: float = 0.0  # added latency, uniform in [0, jitter_s]
    bandwidth_bytes_per_s: float | None = None
    slice_bytes: int | None = None
    stall: bool = False
    reset_after_bytes: int | None = None  # per connection

    def __post_init__(self) -> None:
        for name in ("latency_s", "jitter_s"):
            if not 0 <= getattr(self, name) <= 600:
                raise ValueError(f"{name} must be in [0, 600] seconds, got {getattr(self, name)}")
        for name in ("bandwidth_bytes_per_s", "slice_bytes", "reset_after_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or null, got {value}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @property
    def is_active(self) -> bool:
        return self != DirectionFaults()


class _Connection:
    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.writers = (client, server)
        self.last_downstream_ts = float("-inf")  # the proxy loop's clock

    def reset(self) -> None:
        """Close both sockets with an RST, the way a peer that crashed does."""
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


class FaultProxy:
    """``start()`` listens (a free port unless ``listen_port``) and returns the port; ``stop()`` closes everything."""

    def __init__(self, upstream_host: str, upstream_port: int, listen_host: str = "127.0.0.1", listen_port: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.listen = (listen_host, listen_port)
        self._faults = dict.fromkeys(DIRECTIONS, DirectionFaults())
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    # ---- control (any thread) ------------------------------------------------------------------

    def start(self) -> int:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, *self.listen))
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def stop(self) -> None:
        if self._server is None:
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._server = None

    def faults(self, direction: str) -> DirectionFaults:
        return self._faults[_checked(direction)]

    def set_faults(self, direction: str, **changes: object) -> DirectionFaults:
        """Change some faults of one direction (``ValueError`` for an unknown or bad one); returns them all."""
        unknown = set(changes) - set(DirectionFaults.names())
        if unknown:
            raise ValueError(f"unknown proxy faults {sorted(unknown)}; faults: {', '.join(DirectionFaults.names())}")
        faults = replace(self._faults[_checked(direction)], **changes)
        self._faults[direction] = faults
        return faults

    def clear_faults(self) -> None:
        self._faults = dict.fromkeys(DIRECTIONS, DirectionFaults())

    def reset_connections(self) -> int:
        """Reset every open connection now; returns how many there were."""

        async def reset_all() -> int:
            connections = list(self._connections)
            for connection in connections:
                connection.reset()
            return len(connections)

        return self._call(reset_all())

    def num_streaming(self, within_s: float = 1.0) -> int:
        """Open connections that forwarded a response byte within the last ``within_s`` seconds."""

        async def count() -> int:
            now = asyncio.get_running_loop().time()
            return sum(now - c.last_downstream_ts <= within_s for c in self._connections)

        return self._call(count())

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    # ---- the proxy's event loop ----------------------------------------------------------------

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    async def _close(self) -> None:
        self._server.close()
        for connection in list(self._connections):
            for writer in connection.writers:
                writer.transport.abort()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        await self._server.wait_closed()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.transport.abort()
            return
        connection = _Connection(client_writer, server_writer)
        self._connections.add(connection)
        try:
            await asyncio.gather(
                self._pipe(client_reader, server_writer, "upstream", connection),
                self._pipe(server_reader, client_writer, "downstream", connection),
                return_exceptions=True,
            )
        finally:
            self._connections.discard(connection)
            for writer in connection.writers:
                writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str, connection: _Connection
    ) -> None:
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await reader.read(CHUNK_BYTES):
                    line.put_nowait((loop.time(), data))
            finally:
                line.put_nowait(None)

        reading = asyncio.create_task(read())
        num_sent = 0
        bandwidth_free_at = 0.0
        try:
            while (item := await line.get()) is not None:
                arrived, data = item
                while self._faults[direction].stall:
                    await asyncio.sleep(0.02)
                faults = self._faults[direction]
                await _sleep_until(loop, arrived + faults.latency_s + random.uniform(0, faults.jitter_s))
                step = faults.slice_bytes or len(data)
                for start in range(0, len(data), step):
                    piece = data[start : start + step]
                    limit = faults.reset_after_bytes
                    if limit is not None and num_sent + len(piece) > limit:
                        writer.write(piece[: limit - num_sent])
                        await writer.drain()
                        connection.reset()
                        return
                    if faults.bandwidth_bytes_per_s:
                        bandwidth_free_at = (
                            max(loop.time(), bandwidth_free_at) + len(piece) / faults.bandwidth_bytes_per_s
                        )
                        await _sleep_until(loop, bandwidth_free_at)
                    writer.write(piece)
                    await writer.drain()
                    num_sent += len(piece)
                    if direction == "downstream":
                        connection.last_downstream_ts = loop.time()
            if writer.can_write_eof():
                writer.write_eof()
        finally:
            reading.cancel()


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    delay = deadline - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


def _checked(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return direction
