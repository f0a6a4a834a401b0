"""Incremental Server-Sent Events parser (the framing of every OpenAI-compatible stream).

Bytes go in as they arrive, in any split; complete events come out. Follows the SSE rules that matter here: lines end
with LF, CRLF or CR; a blank line ends an event; ``data:`` lines of one event are joined with LF; lines starting
with ``:`` are comments (servers send them as keep-alives); other fields (``event``, ``id``, ``retry``) are read or
ignored; an event without data is not dispatched. Pure Python, no I/O: the asyncio client and the Locust user share it.
"""

from __future__ import annotations

from typing import NamedTuple


class SseEvent(NamedTuple):
    # A tuple, not a frozen dataclass: one is made per streamed token, and a frozen dataclass costs a microsecond.
    data: str
    event: str = "message"


class SseParser:
    """Feed bytes with :meth:`feed`; it returns the events completed by them. :attr:`num_comments` counts comment
    lines (keep-alives); :attr:`has_partial_event` says whether bytes of an unfinished event are buffered, which at
    end of stream means the server stopped mid-event."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []
        self._event = "message"
        self._has_field = False
        self.num_comments = 0

    @property
    def has_partial_event(self) -> bool:
        return bool(self._buffer.strip()) or self._has_field

    def feed(self, chunk: bytes) -> list[SseEvent]:
        # The usual read while a client keeps up: exactly one event of one data line, LF-framed, nothing pending.
        if (
            chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and not self._buffer
            and not self._has_field
            and b"\r" not in chunk
        ):
            return [SseEvent(chunk[6:-2].decode("utf-8", errors="replace"))]
        buffer = self._buffer + chunk
        if b"\r" in buffer:
            # A CR at the very end may be the first half of a CRLF split across reads: keep it for the next feed.
            held = buffer.endswith(b"\r")
            if held:
                buffer = buffer[:-1]
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if held:
                buffer += b"\r"
        *lines, self._buffer = buffer.split(b"\n")
        events = []
        for raw_line in lines:
            event = self._line(raw_line.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            self.num_comments += 1
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        self._has_field = True
        if name == "data":
            self._data_lines.append(value)
        elif name == "event":
            self._event = value
        return None

    def _dispatch(self) -> SseEvent | None:
        event = SseEvent("\n".join(self._data_lines), self._event) if self._data_lines else None
        self._data_lines, self._event, self._has_field = [], "message", False
        return event
