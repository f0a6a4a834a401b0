"""One open-loop run sent from N worker processes: past what one client core sustains.

Each worker is a process of its own (spawned, so it shares nothing with the caller's event loop), with its own
event loop and connection pool. It plans the whole run from the configuration (:func:`loadgen.plan.plan_run`, a
pure function of the seed) and sends its shard (:meth:`loadgen.plan.RunPlan.shard`) at the planned instants. The
caller waits until every worker has planned its shard, then hands all of them one zero on CLOCK_MONOTONIC
(perf_counter on Linux, one clock for every process of a host): a request's scheduled instant, its send time and
every token time are on the same clock whichever worker sent it, so the merged records are one run.

Live counts come back through shared memory, one row per worker written only by that worker; records come back in
batches as requests end (every :data:`RECORDS_PERIOD_S`), so a worker that dies loses at most its last batch. A
worker that fails or dies does not stop the others: they send their shards to the end, and the run then raises
:class:`loadgen.runner.RunCutShort` with every record that came back. Interrupted (Ctrl-C, a caller's cancel), the
caller stops every worker (SIGTERM: each cuts its requests in flight and sends what it has; workers ignore the
terminal's SIGINT so that only the caller decides) and raises the same. Every worker is stopped before this returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadgen.client import StreamingClient
from loadgen.counters import RunCounters
from loadgen.plan import RunPlan, plan_run
from loadgen.records import RequestRecord
from loadgen.results import RunConfig
from loadgen.runner import RunCutShort, RunStart, RunTiming, run_event_loop

logger = logging.getLogger(__name__)
# Spawning a worker imports numpy, pydantic and aiohttp: seconds on a busy machine.
WORKER_READY_TIMEOUT_S = 120.0
# How often a worker publishes its live counts, and the caller copies their sums into its own.
COUNTS_PERIOD_S = 0.05
# How often a worker sends the records of the requests that ended since.
RECORDS_PERIOD_S = 0.5
# How long stopped workers have to send what they have before they are killed.
STOP_GRACE_S = 10.0
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
    it is sent to them (for a caller that reads their CPU time during the run). Raises :class:`RunCutShort` when a
    worker failed or the run was interrupted."""
    if num_workers < 1:
        raise ValueError(f"workers={num_workers} must be >= 1")
    if config.max_concurrency is not None and num_workers > 1:
        raise ValueError("--max-concurrency caps one process's requests: it cannot be combined with --workers > 1")
    if counters is not None and counters.on_record is not None:
        raise ValueError("records from worker processes arrive in batches, not one by one")
    if cpus_per_worker is not None and len(cpus_per_worker) != num_workers:
        raise ValueError(f"{len(cpus_per_worker)} CPU sets for {num_workers} workers")
    counters = counters or RunCounters()
    context = multiprocessing.get_context("spawn")
    counts = context.Array("q", len(COUNT_FIELDS) * num_workers, lock=False)
    results = context.Queue()
    starts = [context.Pipe(duplex=False) for _ in range(num_workers)]
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
    collector = _ShardCollector(results, processes)
    copier = None
    interrupted = False
    try:
        shard_sizes = await asyncio.to_thread(collector.ready, WORKER_READY_TIMEOUT_S)
        counters.total = sum(shard_sizes.values())
        start = RunStart.soon()
        for _, writer in starts:
            writer.send(start)
        if on_start is not None:
            on_start([process.pid for process in processes], start)
        copier = asyncio.create_task(_copy_counts(counts, num_workers, counters))
        collecting = asyncio.ensure_future(asyncio.to_thread(collector.until_finished))
        try:
            await asyncio.shield(collecting)
        except asyncio.CancelledError:
            interrupted = True
            collector.stop()
            await collecting
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
    records = sorted((RequestRecord.model_validate(r) for r in collector.records), key=lambda r: r.index)
    # Until the last request ended (not until the workers were joined), as in a run from one process.
    duration_s = max((record.end_s for record in records), default=time.perf_counter() - start.start_ts)
    timing = RunTiming(start.run_id, start.start_ts, start.start_unix, duration_s, tuple(collector.notes))
    pids = [p.pid for p in processes]
    cut_reasons = collector.cut_reasons(interrupted)
    if cut_reasons:
        reason = "; ".join(cut_reasons) + f"; {len(records)} of {counters.total} planned requests are recorded"
        raise RunCutShort(reason, records, timing)
    return records, timing, pids


@dataclass
class _ShardCollector:
    """Reads the workers' messages (on a thread of its own: the queue blocks) until every worker has finished its
    shard, was cut, failed or died. One reader at a time: :meth:`ready`, then :meth:`until_finished`."""

    results: Any
    processes: list[Any]
    records: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # shard -> None (its shard sent to the end) or what cut it short
    finished: dict[int, str | None] = field(default_factory=dict)
    _kill_at: float | None = None

    def ready(self, timeout_s: float) -> dict[int, int]:
        """Every worker's shard size, once each has planned; a worker's error or death raises."""
        sizes: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s
        while len(sizes) < len(self.processes):
            try:
                kind, shard, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for shard, p in enumerate(self.processes) if shard not in sizes and not p.is_alive()]
                if dead:
                    raise RuntimeError(f"load worker {dead[0].name} ended with exit code {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"load workers not ready within {timeout_s:g} s") from None
                continue
            if kind == "error":
                raise RuntimeError(f"load worker {shard} failed:\n{payload}")
            if kind != "ready":
                raise RuntimeError(f"load worker {shard} sent {kind!r} before it was ready")
            sizes[shard] = payload
        return sizes

    def until_finished(self) -> None:
        while len(self.finished) < len(self.processes):
            try:
                kind, shard, payload = self.results.get(timeout=0.2)
            except queue.Empty:
                self._look_after_workers()
                continue
            if kind == "records":
                self.records.extend(payload)
            elif kind == "done":
                self.notes.extend(payload)
                self.finished.setdefault(shard, None)
            elif kind == "cut":
                self.finished.setdefault(shard, f"load worker {shard} was stopped: {payload}")
            elif kind == "error":
                logger.error("load worker %d failed:\n%s", shard, payload)
                last_line = payload.strip().splitlines()[-1] if payload.strip() else "no traceback"
                self.finished.setdefault(shard, f"load worker {shard} failed: {last_line}")

    def _look_after_workers(self) -> None:
        for shard, process in enumerate(self.processes):
            if shard not in self.finished and not process.is_alive():
                self.finished[shard] = f"load worker {shard} ended with exit code {process.exitcode}"
        if self._kill_at is not None and time.monotonic() > self._kill_at:
            for process in self.processes:
                if process.is_alive():
                    process.kill()

    def stop(self) -> None:
        """Ask every worker to stop (SIGTERM): each cuts its requests in flight and sends what has ended; those that
        do not within :data:`STOP_GRACE_S` are killed."""
        self._kill_at = time.monotonic() + STOP_GRACE_S
        for process in self.processes:
            if process.is_alive():
                process.terminate()

    def cut_reasons(self, interrupted: bool) -> list[str]:
        reasons = ["the run was interrupted"] if interrupted else []
        return reasons + [reason for _, reason in sorted(self.finished.items()) if reason is not None]


async def _copy_counts(counts, num_workers: int, counters: RunCounters) -> None:
    while True:
        _sum_counts(counts, num_workers, counters)
        await asyncio.sleep(COUNTS_PERIOD_S)


def _sum_counts(counts, num_workers: int, counters: RunCounters) -> None:
    width = len(COUNT_FIELDS)
    for column, name in enumerate(COUNT_FIELDS):
        setattr(counters, name, sum(counts[row * width + column] for row in range(num_workers)))


def _worker_main(task: WorkerTask, counts, results, start_reader) -> None:
    # Ctrl-C reaches every process of the terminal's group: the caller alone decides, and stops workers by SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if task.cpus is not None:
            os.sched_setaffinity(0, task.cpus)
        plan = plan_run(task.config).shard(task.shard, task.num_workers)
        results.put(("ready", task.shard, plan.num_requests))
        start: RunStart = start_reader.recv()
        results.put(run_event_loop(_run_shard(task, plan, start, counts, results)))
    except BaseException:  # whatever it is, the caller must hear of it; this process then ends
        results.put(("error", task.shard, traceback.format_exc()))


async def _run_shard(task: WorkerTask, plan: RunPlan, start: RunStart, counts, results) -> tuple[str, int, Any]:
    """The shard sent; its records go to ``results`` as they end. Returns the last message: ("done", shard, the
    run's notes) or, stopped by SIGTERM, ("cut", shard, why)."""
    ended: list[dict] = []
    counters = RunCounters(on_record=lambda record: ended.append(record.model_dump(exclude={"tpot_s"})))
    client = StreamingClient.for_run(task.config, extra_body=task.extra_body, api_key=task.api_key, counters=counters)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    publisher = asyncio.create_task(_publish(counters, counts, task.shard, ended, results))
    try:
        async with client:
            _, timing = await plan.run(client, None, start)
        message: tuple[str, int, Any] = ("done", task.shard, list(timing.notes))
    except RunCutShort as cut:
        message = ("cut", task.shard, cut.reason)
    except asyncio.CancelledError:  # stopped before its run began
        message = ("cut", task.shard, "stopped before it sent anything")
    finally:
        publisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publisher
        _write_counts(counters, counts, task.shard)
        _send_records(ended, results, task.shard)
    return message


async def _publish(counters: RunCounters, counts, shard: int, ended: list[dict], results) -> None:
    last_records_ts = time.perf_counter()
    while True:
        _write_counts(counters, counts, shard)
        if time.perf_counter() - last_records_ts >= RECORDS_PERIOD_S:
            _send_records(ended, results, shard)
            last_records_ts = time.perf_counter()
        await asyncio.sleep(COUNTS_PERIOD_S)


def _send_records(ended: list[dict], results, shard: int) -> None:
    if ended:
        results.put(("records", shard, ended[:]))
        ended.clear()


def _write_counts(counters: RunCounters, counts, shard: int) -> None:
    for column, name in enumerate(COUNT_FIELDS):
        counts[shard * len(COUNT_FIELDS) + column] = getattr(counters, name)
