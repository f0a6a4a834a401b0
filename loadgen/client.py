"""Streams one request to an OpenAI-compatible server and measures it (see :mod:`loadgen.tracker`).

Timing: every read is stamped with ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux) as the event loop hands it to
the transport (:mod:`loadgen.http_stream`), before it is parsed; events that arrive in one read share its stamp.
Connections are not capped: a cap would silently queue requests and hide the server's latency (coordinated
omission).

Retries (``retries``, 0 by default): a request refused with 429 or 503 is sent again, the same body, after the
refusal's Retry-After (seconds; without one, 0.5 s doubling to at most 8 s, as OpenAI's Python SDK backs off), as
long as the request timeout, counted from the first send, allows. Its record counts the sends, and its times run
from the first: the wait is its user's. A Retry-After is used only as RFC 9110 writes it, a short run of ASCII digits
or an HTTP date; anything else is ignored with a note in the record, and the back-off applies.

Every byte a server sends is input: whatever a response holds, its request ends as one record (a stream that breaks
a bound is cut, see :mod:`loadgen.tracker`; an error status's body is read up to :data:`MAX_ERROR_BODY_BYTES`), and a
failure of the client itself on one request is that request's record, never the run's end.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loadgen.counters import RunCounters
from loadgen.http_stream import ConnectionPool, DeadlineExceeded, TransportError
from loadgen.records import Outcome, RequestRecord
from loadgen.tracker import StreamTracker
from loadgen.workloads import PlannedRequest, request_body

if TYPE_CHECKING:
    from loadgen.results import RunConfig


# A refusal without a usable Retry-After: wait 0.5 s, then twice as long each time, at most 8 s (OpenAI's Python SDK).
INITIAL_BACK_OFF_S, MAX_BACK_OFF_S = 0.5, 8.0
# A Retry-After longer than this is not waited for as such (the SDK's bound too): the back-off applies.
MAX_RETRY_AFTER_S = 60
# delay-seconds longer than this many digits is no delay a client would wait for (and int() of thousands of digits
# is refused by Python itself); an HTTP date (IMF-fixdate) is 29 characters.
MAX_RETRY_AFTER_CHARS = 40
# An error status's body is read this far at most, then its connection is cut (the record keeps its first bytes).
MAX_ERROR_BODY_BYTES = 64 << 10

logger = logging.getLogger(__name__)


def retry_wait_s(retries: int, status: int, retry_after: str, attempts: int, time_left_s: float) -> float | None:
    """How long a client waits before it sends a refused request again, after ``attempts`` sends of at most
    ``1 + retries``; None when it does not: another status than 429 or 503, no retry left, or a wait past the
    ``time_left_s`` its request timeout leaves. The rule of every kvstorm client: ``StreamingClient``, Locust's
    users and the simulator's."""
    if status not in (429, 503) or attempts > retries:
        return None
    delay_s = _retry_delay_s(retry_after, attempts)
    return delay_s if delay_s < time_left_s else None


def _retry_delay_s(retry_after: str, attempts: int) -> float:
    """How long a client waits before it sends a refused request again, after ``attempts`` sends: the refusal's
    Retry-After if it gives a usable one, else the back-off."""
    delay_s = parse_retry_after(retry_after)
    if delay_s is not None and delay_s <= MAX_RETRY_AFTER_S:
        return delay_s
    return min(INITIAL_BACK_OFF_S * 2 ** (attempts - 1), MAX_BACK_OFF_S)


def parse_retry_after(value: str, now_unix: float | None = None) -> float | None:
    """The seconds a Retry-After asks for (RFC 9110, 10.2.3): delay-seconds (ASCII digits only: ``str.isdigit``
    also takes ``²``) or an HTTP date, counted from ``now_unix`` (default now) and never negative; None for anything
    else, an empty value included."""
    value = value.strip()
    if not value or len(value) > MAX_RETRY_AFTER_CHARS or not value.isascii():
        return None
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, as HTTP dates are
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now_unix is None else now_unix))


def retry_after_note(value: str) -> str | None:
    """What a record notes of a Retry-After the client could not use (None: absent or usable)."""
    if not value or parse_retry_after(value) is not None:
        return None
    shown = value if len(value) <= MAX_RETRY_AFTER_CHARS else value[:MAX_RETRY_AFTER_CHARS] + "..."
    return f"Retry-After {shown!r} is neither delay-seconds nor an HTTP date: ignored, the back-off applied"


class StreamCut(Exception):
    """The client cut a response: a stream that stalled or broke a bound, an error body past its cap."""


class StallTimeout(StreamCut):
    """Raised into a stream's reader when no token arrived for longer than the stall timeout."""


class StreamingClient:
    """One connection pool for a whole run; :meth:`send` streams one planned request and returns its record.

    ``exact_output``: see :func:`loadgen.workloads.request_body`. ``request_timeout_s`` bounds a whole request
    (client_timeout); ``stall_timeout_s`` bounds each gap between tokens once the first token arrived
    (broken_stream). The time to the first token is bounded only by the request timeout, because queueing before
    it is the server's legitimate choice.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        request_timeout_s: float,
        stall_timeout_s: float,
        exact_output: bool = True,
        extra_body: dict[str, Any] | None = None,
        api_key: str | None = None,
        counters: RunCounters | None = None,
        retries: int = 0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.model = model
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.exact_output = exact_output
        self.extra_body = extra_body or {}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.counters = counters or RunCounters()
        self._pool: ConnectionPool | None = None

    @classmethod
    def for_run(
        cls,
        config: RunConfig,
        *,
        extra_body: dict[str, Any] | None = None,
        api_key: str | None = None,
        counters: RunCounters | None = None,
    ) -> StreamingClient:
        """The client that sends ``config``'s run."""
        return cls(
            config.base_url,
            config.model,
            request_timeout_s=config.request_timeout_s,
            stall_timeout_s=config.stall_timeout_s,
            exact_output=config.exact_output,
            extra_body=extra_body,
            api_key=api_key,
            counters=counters,
            retries=config.retries,
        )

    async def __aenter__(self) -> StreamingClient:
        self._pool = ConnectionPool(self.base_url, self.headers)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.close()

    async def send(self, planned: PlannedRequest, *, request_id: str, run_start_ts: float) -> RequestRecord:
        return (await self.send_for_text(planned, request_id=request_id, run_start_ts=run_start_ts, keep_text=False))[0]

    async def send_for_text(
        self,
        planned: PlannedRequest,
        *,
        request_id: str,
        run_start_ts: float,
        keep_text: bool = True,
        session: int | None = None,
        turn: int | None = None,
    ) -> tuple[RequestRecord, str]:
        """The record and (``keep_text``) the streamed text: what a conversation sends back in its next turn.
        ``session`` and ``turn`` place a multi-turn workload's request in its conversation."""
        if self._pool is None:
            raise RuntimeError("use StreamingClient as an async context manager")
        body = request_body(planned, self.model, exact_output=self.exact_output, extra_body=self.extra_body)
        self.counters.num_sent += 1
        sent_ts = time.perf_counter()
        tracker = StreamTracker(
            index=planned.index,
            request_id=request_id,
            scheduled_s=planned.offset_s,
            sent_ts=sent_ts,
            run_start_ts=run_start_ts,
            requested_output_tokens=planned.max_tokens,
            stall_timeout_s=self.stall_timeout_s,
            collect_text=keep_text,
        )
        try:
            record = await self._stream(planned.path, body, request_id, tracker)
        except Exception as error:  # a bug on this side: this request's record says so, and the run goes on
            logger.exception("the client failed on request %s", request_id)
            outcome = Outcome.BROKEN_STREAM if tracker.http_status == 200 else Outcome.REJECTED
            message = f"the client failed on this request: {type(error).__name__}: {error}"
            record = tracker.finish(time.perf_counter(), outcome, message)
        record.shared_prefix_tokens = planned.shared_prefix_tokens
        record.session, record.turn = session, turn
        self.counters.finished(record)
        return record, tracker.text

    async def _stream(self, path: str, body: dict, request_id: str, tracker: StreamTracker) -> RequestRecord:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        body_bytes = json.dumps(body).encode()
        deadline_ts = tracker.sent_ts + self.request_timeout_s
        while True:
            reception = _Reception(tracker, self.counters, self.stall_timeout_s)
            try:
                await self._pool.post(path, body_bytes, headers, reception, deadline_ts)
            except DeadlineExceeded:
                message = f"no complete answer within the request timeout ({self.request_timeout_s:g} s)"
                return tracker.finish(time.perf_counter(), Outcome.CLIENT_TIMEOUT, message)
            except StreamCut as cut:
                outcome = Outcome.BROKEN_STREAM if tracker.http_status == 200 else Outcome.REJECTED
                return tracker.finish(time.perf_counter(), outcome, reception.cut_message(cut))
            except TransportError as error:
                outcome = Outcome.BROKEN_STREAM if tracker.http_status == 200 else Outcome.REJECTED
                return tracker.finish(time.perf_counter(), outcome, f"{type(error).__name__}: {error}")
            finally:
                reception.stop_watchdog()
            if tracker.http_status == 200:
                return tracker.finish(time.perf_counter())
            time_left_s = deadline_ts - time.perf_counter()
            note = retry_after_note(reception.retry_after) if self.retries else None
            if note is not None and note not in tracker.notes:
                tracker.notes.append(note)
            delay_s = retry_wait_s(
                self.retries, tracker.http_status, reception.retry_after, tracker.attempts, time_left_s
            )
            if delay_s is None:
                detail = reception.error_text()
                return tracker.finish(time.perf_counter(), Outcome.REJECTED, f"HTTP {tracker.http_status}: {detail}")
            await asyncio.sleep(delay_s)
            tracker.attempts += 1


class _Reception:
    """One send's response as the transport delivers it: a 200's body goes to the stream tracker read by read, from
    the transport's callback; of any other status the first bytes are kept for the error message."""

    ERROR_TEXT_CHARS = 300

    def __init__(self, tracker: StreamTracker, counters: RunCounters, stall_timeout_s: float) -> None:
        self.tracker, self.counters, self.stall_timeout_s = tracker, counters, stall_timeout_s
        self.retry_after = ""
        self._error_body = bytearray()
        self._num_error_body_bytes = 0
        self._abort: Callable[[BaseException], None] | None = None
        self._watchdog: _StallWatchdog | None = None

    def response_started(self, status: int, headers: dict[str, str], abort: Callable[[BaseException], None]) -> None:
        self.tracker.http_status = status
        self.retry_after = headers.get("retry-after", "")
        self._abort = abort
        if status == 200:
            self._watchdog = _StallWatchdog(abort, self.tracker, self.stall_timeout_s)

    def body(self, data: bytes, read_ts: float) -> None:
        if self._watchdog is None:
            if len(self._error_body) < 4 * self.ERROR_TEXT_CHARS:
                self._error_body += data[: 4 * self.ERROR_TEXT_CHARS]
            self._num_error_body_bytes += len(data)
            if self._num_error_body_bytes > MAX_ERROR_BODY_BYTES:
                self._abort(StreamCut(f"its body passed {MAX_ERROR_BODY_BYTES} bytes and was cut"))
            return
        num_tokens = self.tracker.feed(data, read_ts)
        if num_tokens:
            self.counters.num_tokens += num_tokens
            self._watchdog.arm()
        if self.tracker.cut_reason is not None:
            self._abort(StreamCut(self.tracker.cut_reason))

    def error_text(self) -> str:
        return self._error_body.decode("utf-8", errors="replace")[: self.ERROR_TEXT_CHARS]

    def cut_message(self, cut: StreamCut) -> str:
        """A cut response's error: an error status's with the start of its body."""
        if self._watchdog is None and self.tracker.http_status is not None:
            return f"HTTP {self.tracker.http_status}: {self.error_text()} ({cut})"
        return str(cut)

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


class _StallWatchdog:
    """Wakes once per stall period, not once per token: a token only moves ``tracker.last_token_ts`` forward, and
    the timer re-arms itself for the new deadline when it fires early."""

    def __init__(self, abort: Callable[[BaseException], None], tracker: StreamTracker, stall_timeout_s: float) -> None:
        self._abort, self._tracker, self._stall_timeout_s = abort, tracker, stall_timeout_s
        self._handle: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    def arm(self) -> None:
        if self._handle is None:
            self._schedule()

    def _schedule(self) -> None:
        deadline = self._tracker.last_token_ts + self._stall_timeout_s
        # perf_counter and the loop clock are both CLOCK_MONOTONIC on Linux; converting keeps other platforms right.
        self._handle = self._loop.call_at(self._loop.time() + (deadline - time.perf_counter()), self._check)

    def _check(self) -> None:
        if self._tracker.done_ts is not None:
            return
        gap_s = time.perf_counter() - self._tracker.last_token_ts
        if gap_s < self._stall_timeout_s:
            self._schedule()
            return
        self._abort(StallTimeout(f"stalled: no token for {gap_s:.3f} s (stall timeout {self._stall_timeout_s:g} s)"))

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
