"""The open-loop runner: every request leaves at its scheduled time, whatever earlier requests are doing.

The dispatcher sleeps until each request's scheduled time and starts it as its own task; it never waits for a
response, so a slow server cannot slow the schedule down (no coordinated omission). ``max_concurrency`` is the only
exception, and an explicit one: a request over the cap waits client-side for a free slot, its ``sent_s`` records
when it really left, and ``sent_s - scheduled_s`` (the send lag) shows the cost in the results.
"""

from __future__ import annotations

import asyncio
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


async def run_open_loop(
    plan: list[PlannedRequest], client: StreamingClient, *, max_concurrency: int | None = None
) -> tuple[list[RequestRecord], RunTiming]:
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    run_id = uuid.uuid4().hex[:8]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    client.counters.total = len(plan)
    start_ts = time.perf_counter() + START_DELAY_S
    start_unix = time.time() + START_DELAY_S

    async def one(planned: PlannedRequest) -> RequestRecord:
        # Sent as X-Request-Id, so UUID-shaped (the run, then the request's index in hex): some servers refuse
        # any other shape with a 400 (llama-cpp-python's, through starlette-context).
        request_id = f"{run_id}-0000-4000-8000-{planned.index:012x}"
        if slots is None:
            return await client.send(planned, request_id=request_id, run_start_ts=start_ts)
        async with slots:
            return await client.send(planned, request_id=request_id, run_start_ts=start_ts)

    # Objects alive now (a test session, numpy, pydantic...) go to the permanent generation: a full collection would
    # otherwise scan them all and pause the loop for tens of milliseconds in the middle of a stream.
    gc.freeze()
    try:
        records = await _dispatch(plan, one, start_ts)
    finally:
        gc.unfreeze()
    duration_s = time.perf_counter() - start_ts
    return records, RunTiming(run_id, start_ts, start_unix, duration_s)


async def _dispatch(
    plan: list[PlannedRequest], one: Callable[[PlannedRequest], Awaitable[RequestRecord]], start_ts: float
) -> list[RequestRecord]:
    tasks = []
    for planned in plan:
        delay_s = start_ts + planned.offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(planned)))
    return list(await asyncio.gather(*tasks))
