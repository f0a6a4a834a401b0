"""The open-loop runner: every request leaves at its scheduled time, whatever earlier requests are doing.

The dispatcher sleeps until each request's scheduled time and starts it as its own task; it never waits for a
response, so a slow server cannot slow the schedule down (no coordinated omission). ``max_concurrency`` is the only
exception, and an explicit one: a request over the cap waits client-side for a free slot, its ``sent_s`` records
when it really left, and ``sent_s - scheduled_s`` (the send lag) shows the cost in the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loadgen.client import StreamingClient
from loadgen.records import RequestRecord
from loadgen.workloads import PlannedRequest

# Scheduling starts a little after the call so the first requests are not late by the setup of the first tasks.
START_DELAY_S = 0.05


@dataclass(frozen=True)
class RunTiming:
    """``start_ts`` is the perf_counter time that offsets are measured from; ``start_unix`` the same instant in
    wall-clock time (to line up with Prometheus and fault timelines); ``duration_s`` until the last request ended."""

    run_id: str
    start_ts: float
    start_unix: float
    duration_s: float


class RunContext:
    """What every request of one run shares: its id, its zero, and the client-side concurrency cap."""

    def __init__(self, client: StreamingClient, max_concurrency: int | None) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        self.client = client
        self.run_id = uuid.uuid4().hex[:8]
        self.start_ts = time.perf_counter() + START_DELAY_S
        self.start_unix = time.time() + START_DELAY_S
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(self, planned: PlannedRequest, keep_text: bool = False) -> tuple[RequestRecord, str]:
        # Sent as X-Request-Id, so UUID-shaped (the run, then the request's index in hex): some servers refuse
        # any other shape with a 400 (llama-cpp-python's, through starlette-context).
        request_id = f"{self.run_id}-0000-4000-8000-{planned.index:012x}"
        async with self._slots or contextlib.nullcontext():
            return await self.client.send_for_text(
                planned, request_id=request_id, run_start_ts=self.start_ts, keep_text=keep_text
            )


async def run_open_loop(
    plan: list[PlannedRequest], client: StreamingClient, *, max_concurrency: int | None = None
) -> tuple[list[RequestRecord], RunTiming]:
    async def one(index: int, context: RunContext) -> list[RequestRecord]:
        return [(await context.send(plan[index]))[0]]

    return await run_at_offsets([p.offset_s for p in plan], one, client, len(plan), max_concurrency)


async def run_at_offsets(
    offsets_s: list[float],
    start: Callable[[int, RunContext], Awaitable[list[RequestRecord]]],
    client: StreamingClient,
    num_requests: int,
    max_concurrency: int | None,
) -> tuple[list[RequestRecord], RunTiming]:
    """Start ``start(i, context)`` as its own task at offset ``offsets_s[i]`` from the run's start, never waiting
    for an earlier one; every record they return, in index order. ``num_requests``: how many requests the run
    plans (what progress counts towards)."""
    context = RunContext(client, max_concurrency)
    client.counters.total = num_requests
    # Objects alive now (a test session, numpy, pydantic...) go to the permanent generation: a full collection would
    # otherwise scan them all and pause the loop for tens of milliseconds in the middle of a stream.
    gc.freeze()
    try:
        tasks = []
        for index, offset_s in enumerate(offsets_s):
            delay_s = context.start_ts + offset_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.create_task(start(index, context)))
        records = sorted((r for batch in await asyncio.gather(*tasks) for r in batch), key=lambda r: r.index)
    finally:
        gc.unfreeze()
    duration_s = time.perf_counter() - context.start_ts
    return records, RunTiming(context.run_id, context.start_ts, context.start_unix, duration_s)
