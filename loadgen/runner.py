"""The open-loop runner: every request leaves at its scheduled time, whatever earlier requests are doing.

The dispatcher sleeps until each request's scheduled time and starts it as its own task; it never waits for a
response, so a slow server cannot slow the schedule down (no coordinated omission). ``max_concurrency`` is the only
exception, and an explicit one: a request over the cap waits client-side for a free slot, its ``sent_s`` records
when it really left, and ``sent_s - scheduled_s`` (the send lag) shows the cost in the results.

Each request's record is kept the moment it ends, so a run that stops early (Ctrl-C, a caller's cancel) raises
:class:`RunCutShort` with every record it has; a failure of one task is logged and named in the run's notes, and
the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import uvloop

from loadgen.client import StreamingClient
from loadgen.records import RequestRecord
from loadgen.workloads import PlannedRequest

if TYPE_CHECKING:
    from loadgen.results import RunResult

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Scheduling starts a little after the call so the first requests are not late by the setup of the first tasks.
START_DELAY_S = 0.05


def run_event_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop: its event loop and transports are compiled (libuv), and a streamed token costs the
    client about two thirds of the CPU time it costs on asyncio's loop (``kvstorm bench client-capacity``). Its timers
    tick in whole milliseconds, so a request may leave up to a millisecond after its planned instant: ``sent_s``
    records when it really left, and every token is stamped with perf_counter as it is read, as on asyncio's loop."""
    return uvloop.run(coroutine)


@contextlib.contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """No cycle collection while a run streams: each one stops the event loop, and every token that arrives in the
    meantime is stamped late. Measured at 1,000 streams of 50 tokens/s, the collections of a 12 s run took 205 ms,
    the longest 37 ms; the p99 timing error was several milliseconds. A request leaves no reference cycles behind,
    whatever its outcome (a test checks), so memory is freed by reference counts all the same. Objects alive before
    the run (a test session, numpy, pydantic) are frozen, so the collection after it does not walk them again."""
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


async def sleep_until(deadline_ts: float) -> None:
    """Until ``deadline_ts`` (perf_counter), never before it: a millisecond timer may wake a fraction early."""
    while (delay_s := deadline_ts - time.perf_counter()) > 0:
        await asyncio.sleep(delay_s)


@dataclass(frozen=True)
class RunTiming:
    """``start_ts`` is the perf_counter time that offsets are measured from; ``start_unix`` the same instant in
    wall-clock time (to line up with Prometheus and fault timelines); ``duration_s`` until the last request ended."""

    run_id: str
    start_ts: float
    start_unix: float
    duration_s: float
    # What went wrong on the client's side without ending the run (a task that failed), for the results' notes.
    notes: tuple[str, ...] = ()


class RunCutShort(Exception):
    """The run stopped before its end (interrupted, cancelled, a load worker lost): ``records`` are the requests
    that ended before (those in flight were cut and have none), ``reason`` says what happened and what is missing.
    :func:`loadgen.benchmark.run_benchmark` sets ``result``, the results built from them, before it lets this on."""

    def __init__(self, reason: str, records: list[RequestRecord], timing: RunTiming) -> None:
        super().__init__(reason)
        self.reason, self.records, self.timing = reason, records, timing
        self.result: RunResult | None = None


@dataclass(frozen=True)
class RunStart:
    """A run's id and its zero: ``start_ts`` on the perf_counter clock, ``start_unix`` the same instant in wall-clock
    time. perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of a host, so the worker processes
    of one run (:mod:`loadgen.workers`) share one zero."""

    run_id: str
    start_ts: float
    start_unix: float

    @classmethod
    def soon(cls, delay_s: float = START_DELAY_S) -> RunStart:
        return cls(uuid.uuid4().hex[:8], time.perf_counter() + delay_s, time.time() + delay_s)


class RunContext:
    """What every request of one run shares: its id, its zero, the client-side concurrency cap, and the records of
    the requests that have ended (``records``, in the order they ended)."""

    def __init__(self, client: StreamingClient, max_concurrency: int | None, start: RunStart | None = None) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        self.client = client
        start = start or RunStart.soon()
        self.run_id, self.start_ts, self.start_unix = start.run_id, start.start_ts, start.start_unix
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.records: list[RequestRecord] = []
        self.failures: list[str] = []

    async def send(
        self, planned: PlannedRequest, keep_text: bool = False, *, session: int | None = None, turn: int | None = None
    ) -> tuple[RequestRecord, str]:
        """Send ``planned`` and keep its record (of ``session``'s ``turn``, for a multi-turn workload)."""
        # Sent as X-Request-Id, so UUID-shaped (the run, then the request's index in hex): some servers refuse
        # any other shape with a 400 (llama-cpp-python's, through starlette-context).
        request_id = f"{self.run_id}-0000-4000-8000-{planned.index:012x}"
        async with self._slots or contextlib.nullcontext():
            record, text = await self.client.send_for_text(
                planned,
                request_id=request_id,
                run_start_ts=self.start_ts,
                keep_text=keep_text,
                session=session,
                turn=turn,
            )
        self.records.append(record)
        return record, text

    async def run_task(self, start: Callable[[int, RunContext], Awaitable[None]], index: int) -> None:
        """``start(index, self)``; a failure of this side's code is logged and noted, and ends this task only."""
        try:
            await start(index, self)
        except Exception as error:
            logger.exception("load task %d failed", index)
            self.failures.append(f"load task {index} failed in the client: {type(error).__name__}: {error}")

    def timing(self) -> RunTiming:
        """Until now; with the failures noted so far."""
        duration_s = time.perf_counter() - self.start_ts
        return RunTiming(self.run_id, self.start_ts, self.start_unix, duration_s, tuple(self.failures))


async def run_open_loop(
    plan: list[PlannedRequest],
    client: StreamingClient,
    *,
    max_concurrency: int | None = None,
    start: RunStart | None = None,
) -> tuple[list[RequestRecord], RunTiming]:
    async def one(index: int, context: RunContext) -> None:
        await context.send(plan[index])

    return await run_at_offsets([p.offset_s for p in plan], one, client, len(plan), max_concurrency, start)


async def run_at_offsets(
    offsets_s: list[float],
    start: Callable[[int, RunContext], Awaitable[None]],
    client: StreamingClient,
    num_requests: int,
    max_concurrency: int | None,
    run_start: RunStart | None = None,
) -> tuple[list[RequestRecord], RunTiming]:
    """Start ``start(i, context)`` as its own task at offset ``offsets_s[i]`` from the run's start (``run_start``, by
    default a moment from now), never waiting for an earlier one; every record its requests (``context.send``) left,
    in index order. ``num_requests``: how many requests the run plans (what progress counts towards). Cancelled, it
    cuts the requests in flight and raises :class:`RunCutShort` with the records it has."""
    context = RunContext(client, max_concurrency, run_start)
    client.counters.total = num_requests
    tasks: list[asyncio.Task] = []
    with cycle_collector_paused():
        try:
            for index, offset_s in enumerate(offsets_s):
                await sleep_until(context.start_ts + offset_s)
                tasks.append(asyncio.create_task(context.run_task(start, index)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError as stop:
            num_in_flight = client.counters.num_in_flight
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            reason = (
                f"the run was stopped after {time.perf_counter() - context.start_ts:.1f} s: {len(context.records)} "
                f"of {num_requests} planned requests ended and are recorded, {num_in_flight} in flight were cut "
                "(no record)"
            )
            raise RunCutShort(reason, sorted(context.records, key=lambda r: r.index), context.timing()) from stop
    return sorted(context.records, key=lambda r: r.index), context.timing()
