"""One open-loop run sent from N worker processes: past what one client core sustains.

Each worker is a process of its own (spawned, so it shares nothing with the caller's event loop), with its own
event loop and aiohttp session. It plans the whole run from the configuration (:func:`loadgen.plan.plan_run`, a
pure function of the seed) and sends its shard (:meth:`loadgen.plan.RunPlan.shard`) at the planned instants. The
caller waits until every worker has planned its shard, then hands all of them one zero on CLOCK_MONOTONIC
(perf_counter on Linux, one clock for every process of a host): a request's scheduled instant, its send time and
every token time are on the same clock whichever worker sent it, so the merged records are one run.

Live counts come back through shared memory, one row per worker written only by that worker; each worker's records
come back once, when its shard has ended. A worker that fails ends the run with its error, and every worker is
stopped before this returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadgen.client import StreamingClient
from loadgen.counters import RunCounters
from loadgen.plan import RunPlan, plan_run
from loadgen.records import RequestRecord
from loadgen.results import RunConfig
from loadgen.runner import RunStart, RunTiming, run_event_loop

# Spawning a worker imports numpy, pydantic and aiohttp: seconds on a busy machine.
WORKER_READY_TIMEOUT_S = 120.0
# How often a worker publishes its live counts, and the caller copies their sums into its own.
COUNTS_PERIOD_S = 0.05
COUNT_FIELDS = ("num_sent", "num_finished", "num_failed", "num_tokens")


@dataclass(frozen=True)
class WorkerTask:
    """What one worker needs, all plain data (it crosses a process boundary)."""

    config: RunConfig
    shard: int
    num_workers: int
    extra_body: dict[str, Any] | None
    api_key: str | None
    # CPUs the worker is pinned to (None: wherever the OS puts it).
    cpus: tuple[int, ...] | None = None


async def run_in_workers(
    config: RunConfig,
    num_workers: int,
    *,
    extra_body: dict | None = None,
    api_key: str | None = None,
    counters: RunCounters | None = None,
    cpus_per_worker: list[tuple[int, ...]] | None = None,
    on_start: Callable[[list[int], RunStart], None] | None = None,
) -> tuple[list[RequestRecord], RunTiming, list[int]]:
    """The run's records from every worker in index order, its timing, and the workers' process ids. ``counters``
    gets the sums of the workers' live counts; ``on_start`` is told the workers' process ids and the run's zero as
    it is sent to them (for a caller that reads their CPU time during the run)."""
    if num_workers < 1:
        raise ValueError(f"workers={num_workers} must be >= 1")
    if config.max_concurrency is not None and num_workers > 1:
        raise ValueError("--max-concurrency caps one process's requests: it cannot be combined with --workers > 1")
    if counters is not None and counters.on_record is not None:
        raise ValueError("records from worker processes arrive at the end of their shards, not one by one")
    counters = counters or RunCounters()
    context = multiprocessing.get_context("spawn")
    counts = context.Array("q", len(COUNT_FIELDS) * num_workers, lock=False)
    results = context.Queue()
    starts = [context.Pipe(duplex=False) for _ in range(num_workers)]
    if cpus_per_worker is not None and len(cpus_per_worker) != num_workers:
        raise ValueError(f"{len(cpus_per_worker)} CPU sets for {num_workers} workers")
    processes = []
    for shard in range(num_workers):
        cpus = cpus_per_worker[shard] if cpus_per_worker else None
        task = WorkerTask(config, shard, num_workers, extra_body, api_key, cpus)
        processes.append(
            context.Process(
                target=_worker_main,
                args=(task, counts, results, starts[shard][0]),
                name=f"kvstorm-load-{shard}",
                daemon=True,
            )
        )
    for process in processes:
        process.start()
    copier = None
    try:
        shard_sizes = await asyncio.to_thread(_collect, results, processes, "ready", WORKER_READY_TIMEOUT_S)
        counters.total = sum(shard_sizes.values())
        start = RunStart.soon()
        for _, writer in starts:
            writer.send(start)
        if on_start is not None:
            on_start([process.pid for process in processes], start)
        copier = asyncio.create_task(_copy_counts(counts, num_workers, counters))
        shards = await asyncio.to_thread(_collect, results, processes, "records", None)
    finally:
        if copier is not None:
            copier.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await copier
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
    _sum_counts(counts, num_workers, counters)
    records = sorted(
        (RequestRecord.model_validate(r) for shard in shards.values() for r in shard), key=lambda r: r.index
    )
    # Until the last request ended (not until the workers were joined), as in a run from one process.
    duration_s = max((record.end_s for record in records), default=time.perf_counter() - start.start_ts)
    return records, RunTiming(start.run_id, start.start_ts, start.start_unix, duration_s), [p.pid for p in processes]


def _collect(results, processes, kind: str, timeout_s: float | None) -> dict[int, Any]:
    """One message of ``kind`` from every worker, by shard; a worker's error or death raises."""
    received: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(received) < len(processes):
        try:
            message_kind, shard, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [p for shard, p in enumerate(processes) if shard not in received and not p.is_alive()]
            if dead:
                raise RuntimeError(f"load worker {dead[0].name} ended with exit code {dead[0].exitcode}") from None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"load workers not {kind} within {timeout_s:g} s") from None
            continue
        if message_kind == "error":
            raise RuntimeError(f"load worker {shard} failed:\n{payload}")
        if message_kind != kind:
            raise RuntimeError(f"load worker {shard} sent {message_kind!r} where {kind!r} was expected")
        received[shard] = payload
    return received


async def _copy_counts(counts, num_workers: int, counters: RunCounters) -> None:
    while True:
        _sum_counts(counts, num_workers, counters)
        await asyncio.sleep(COUNTS_PERIOD_S)


def _sum_counts(counts, num_workers: int, counters: RunCounters) -> None:
    width = len(COUNT_FIELDS)
    for column, field in enumerate(COUNT_FIELDS):
        setattr(counters, field, sum(counts[row * width + column] for row in range(num_workers)))


def _worker_main(task: WorkerTask, counts, results, start_reader) -> None:
    try:
        if task.cpus is not None:
            os.sched_setaffinity(0, task.cpus)
        plan = plan_run(task.config).shard(task.shard, task.num_workers)
        results.put(("ready", task.shard, plan.num_requests))
        start: RunStart = start_reader.recv()
        records = run_event_loop(_run_shard(task, plan, start, counts))
        results.put(("records", task.shard, [record.model_dump(exclude={"tpot_s"}) for record in records]))
    except BaseException:  # whatever it is, the caller must hear of it; this process then ends
        results.put(("error", task.shard, traceback.format_exc()))


async def _run_shard(task: WorkerTask, plan: RunPlan, start: RunStart, counts) -> list[RequestRecord]:
    counters = RunCounters()
    client = StreamingClient.for_run(task.config, extra_body=task.extra_body, api_key=task.api_key, counters=counters)
    publisher = asyncio.create_task(_publish_counts(counters, counts, task.shard))
    try:
        async with client:
            records, _ = await plan.run(client, None, start)
    finally:
        publisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publisher
        _write_counts(counters, counts, task.shard)
    return records


async def _publish_counts(counters: RunCounters, counts, shard: int) -> None:
    while True:
        _write_counts(counters, counts, shard)
        await asyncio.sleep(COUNTS_PERIOD_S)


def _write_counts(counters: RunCounters, counts, shard: int) -> None:
    for column, field in enumerate(COUNT_FIELDS):
        counts[shard * len(COUNT_FIELDS) + column] = getattr(counters, field)
