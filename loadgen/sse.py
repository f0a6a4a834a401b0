"""Incremental Server-Sent Events parser (the framing of every OpenAI-compatible stream).

Bytes go in as they arrive, in any split; complete events come out. Follows the SSE rules that matter here: lines end
with LF, CRLF or CR; a blank line ends an event; ``data:`` lines of one event are joined with LF; lines starting
with ``:`` are comments (servers send them as keep-alives); other fields (``event``, ``id``, ``retry``) are read or
ignored; an event without data is not dispatched. Pure Python, no I/O: the asyncio client and the Locust user share it.

Every byte a server sends is input, so the parser is bounded: a line or an event longer than
:data:`MAX_EVENT_BYTES` raises :class:`SseLimitExceeded` (nothing an OpenAI-compatible server streams comes near it:
a token's chunk with twenty top log-probs is a few KB), and its cost is linear in the bytes fed, however they are
split (an unfinished line is kept in pieces, never joined and searched again on every read).
"""

from __future__ import annotations

from typing import NamedTuple

# The longest line, and the most data one event may carry.
MAX_EVENT_BYTES = 1 << 20


class SseLimitExceeded(Exception):
    """A line or an event passed :data:`MAX_EVENT_BYTES`."""


class SseEvent(NamedTuple):
    # A tuple, not a frozen dataclass: one is made per streamed token, and a frozen dataclass costs a microsecond.
    data: str
    event: str = "message"


class SseParser:
    """Feed bytes with :meth:`feed`; it returns the events completed by them. :attr:`num_comments` counts comment
    lines (keep-alives); :attr:`has_partial_event` says whether bytes of an unfinished event are buffered, which at
    end of stream means the server stopped mid-event."""

    def __init__(self) -> None:
        # The unfinished line, in the pieces it arrived in, and their length.
        self._pieces: list[bytes] = []
        self._num_pending = 0
        # The previous read ended with CR: an LF that starts this one completes that CRLF and ends no line.
        self._after_cr = False
        self._data_lines: list[str] = []
        self._num_data_chars = 0
        self._event = "message"
        self._has_field = False
        self.num_comments = 0

    @property
    def has_partial_event(self) -> bool:
        return any(piece.strip() for piece in self._pieces) or self._has_field

    def feed(self, chunk: bytes) -> list[SseEvent]:
        # The usual read while a client keeps up: exactly one event of one data line, LF-framed, nothing pending.
        if (
            chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and not self._pieces
            and not self._has_field
            and not self._after_cr
            and b"\r" not in chunk
            and len(chunk) <= MAX_EVENT_BYTES
        ):
            return [SseEvent(chunk[6:-2].decode("utf-8", errors="replace"))]
        if not chunk:
            return []
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = chunk.split(b"\n")
        if lines and self._pieces:
            lines[0] = b"".join((*self._pieces, lines[0]))
            self._pieces, self._num_pending = [], 0
        events = []
        for raw_line in lines:
            if not raw_line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
            elif raw_line.startswith(b":"):  # a comment (a keep-alive): counted, not decoded
                self.num_comments += 1
            else:
                self._field(self._bounded(raw_line))
        if rest:
            self._num_pending += len(rest)
            self._pieces.append(rest)
            if self._num_pending > MAX_EVENT_BYTES:
                raise SseLimitExceeded(f"an SSE line passed {MAX_EVENT_BYTES} bytes without ending")
        return events

    @staticmethod
    def _bounded(raw_line: bytes) -> str:
        if len(raw_line) > MAX_EVENT_BYTES:
            raise SseLimitExceeded(f"an SSE line of {len(raw_line)} bytes, more than {MAX_EVENT_BYTES}")
        return raw_line.decode("utf-8", errors="replace")

    def _field(self, line: str) -> None:
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        self._has_field = True
        if name == "data":
            self._num_data_chars += len(value) + 1
            if self._num_data_chars > MAX_EVENT_BYTES:
                raise SseLimitExceeded(f"an SSE event's data passed {MAX_EVENT_BYTES} characters")
            self._data_lines.append(value)
        elif name == "event":
            self._event = value

    def _dispatch(self) -> SseEvent | None:
        event = SseEvent("\n".join(self._data_lines), self._event) if self._data_lines else None
        self._data_lines, self._num_data_chars, self._event, self._has_field = [], 0, "message", False
        return event
