"""How much one core of the client sustains: streamed tokens/s and concurrent streams with timing error under 1 ms.

For each level (concurrent streams), the scripted server, alone on its CPU, streams ``num_tokens`` tokens per request
``gap_s`` apart after ``ttft_s``; the client, one or more worker processes (:mod:`loadgen.workers`) each alone on its
CPU where the machine has enough (:class:`Placement`), sends Poisson arrivals at the rate that keeps that many streams
open. Timing error is what the client recorded for each token minus the server's stamp after writing it (same
monotonic clock). Both run at timing priority where allowed (:func:`loadgen.scripted_server.prioritize_timing`). A
level counts as sustained when the error's p99 is under 1 ms and no request failed. Each row also shows the server's
lateness against its own script: when that is large, the server (or a neighbour on its CPU), not the client, set the
limit. Linux only (CPU pinning, /proc).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.analysis import peak_in_flight
from loadgen.records import Outcome
from loadgen.results import RunConfig
from loadgen.runner import RunStart, run_event_loop
from loadgen.scripted_server import prioritize_timing, scripted_server_process
from loadgen.workers import run_in_workers

ERROR_LIMIT_MS = 1.0


@dataclass(frozen=True)
class Placement:
    """Where a level's processes run: each worker on its CPUs, the scripted server on its own."""

    worker_cpus: list[tuple[int, ...]]
    server_cpu: int

    @classmethod
    def for_workers(cls, num_workers: int) -> Placement:
        """A CPU per worker and one for the server where there are enough; else every worker on the first CPU,
        the server on the second (the streams per client core are still measured, not the scaling)."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise ValueError("the capacity benchmark needs two CPUs: one for the client, one for the scripted server")
        if len(cpus) > num_workers:
            return cls([(cpu,) for cpu in cpus[:num_workers]], cpus[num_workers])
        return cls([(cpus[0],)] * num_workers, cpus[1])

    @property
    def client_cores(self) -> int:
        return len(set(self.worker_cpus))

    def describe(self) -> str:
        workers, first_cpu = len(self.worker_cpus), self.worker_cpus[0][0]
        if workers == 1:
            clients = f"client on CPU {first_cpu}"
        elif self.client_cores == 1:
            clients = f"{workers} client processes sharing CPU {first_cpu}"
        else:
            clients = f"{workers} client processes on CPUs {', '.join(str(cpu) for (cpu,) in self.worker_cpus)}"
        return f"{clients}, scripted server on CPU {self.server_cpu}"


@dataclass(frozen=True)
class CapacityRow:
    target_streams: int
    peak_streams: int
    tokens_per_s: float
    # CPU time of the client's processes over the steady window, in cores (summed over workers).
    client_cpu: float
    server_cpu: float
    error_p50_ms: float
    error_p99_ms: float
    error_max_ms: float
    server_late_p99_ms: float
    num_failed: int
    client_cores: int = 1

    @property
    def sustained(self) -> bool:
        return self.error_p99_ms < ERROR_LIMIT_MS and self.num_failed == 0

    @property
    def streams_per_core(self) -> float:
        return self.peak_streams / self.client_cores


def measure_level(
    streams: int,
    *,
    ttft_s: float,
    gap_s: float,
    num_tokens: int,
    steady_s: float,
    workers: int = 1,
    env: dict | None = None,
) -> CapacityRow:
    """One level, sent from ``workers`` processes (:mod:`loadgen.workers`) placed by :meth:`Placement.for_workers`,
    each at timing priority."""
    placement = Placement.for_workers(workers)
    stream_s = ttft_s + (num_tokens - 1) * gap_s
    rate = streams / stream_s
    server_args = ("--ttft-ms", f"{ttft_s * 1e3:g}", "--gap-ms", f"{gap_s * 1e3:g}")
    with scripted_server_process(*server_args, cpu=placement.server_cpu, env=env) as server:
        config = _level_config(server.base_url, rate, int(rate * (steady_s + stream_s)), num_tokens)
        with pinned_for_timing(placement.worker_cpus[0][0]):  # workers inherit the priority
            records, timing, client_cpu_s, server_cpu_s = run_event_loop(
                _run(config, placement, server.process.pid, (stream_s, stream_s + steady_s))
            )
        log = server.script_log()
    ok = [r for r in records if r.outcome is Outcome.OK]
    errors_ms, late_ms, token_offsets = [], [], []
    for record in ok:
        entry = log[record.request_id]
        sent = np.asarray(entry["token_send_ts"])
        received = timing.start_ts + record.sent_s + record.ttft_s + np.concatenate([[0.0], np.cumsum(record.itl_s)])
        errors_ms.append((received - sent) * 1e3)
        token_offsets.append(received - timing.start_ts)
        scripted = entry["received_ts"] + entry["ttft_s"] + np.arange(len(sent)) * entry["gap_s"]
        late_ms.append((sent - scripted) * 1e3)
    errors, late, offsets = np.abs(np.concatenate(errors_ms)), np.concatenate(late_ms), np.concatenate(token_offsets)
    steady_tokens = np.count_nonzero((offsets >= stream_s) & (offsets < stream_s + steady_s))
    return CapacityRow(
        target_streams=streams,
        peak_streams=peak_in_flight(records),
        tokens_per_s=steady_tokens / steady_s,
        client_cpu=client_cpu_s / steady_s,
        server_cpu=server_cpu_s / steady_s,
        error_p50_ms=float(np.percentile(errors, 50)),
        error_p99_ms=float(np.percentile(errors, 99)),
        error_max_ms=float(errors.max()),
        server_late_p99_ms=float(np.percentile(late, 99)),
        num_failed=len(records) - len(ok),
        client_cores=placement.client_cores,
    )


def _level_config(base_url: str, rate: float, num_requests: int, num_tokens: int) -> RunConfig:
    # Poisson, not constant: evenly spaced starts would put the streams' ticks in a few phase clusters of the gap
    # (every stream writing at the same instants), a worst case that real traffic does not have.
    return RunConfig(
        base_url=base_url,
        model="m",
        arrival=f"poisson:rate={rate:.6f}",
        workload="random",
        input_len="fixed:16",
        output_len=f"fixed:{num_tokens}",
        num_requests=num_requests,
        duration_s=None,
        max_concurrency=None,
        request_timeout_s=120,
        stall_timeout_s=30,
        exact_output=True,
        seed=1,
        slo=None,
    )


async def _run(config: RunConfig, placement: Placement, server_pid: int, window: tuple[float, float]):
    """Run one level; CPU seconds of the client's processes and of the server are taken over ``window`` (offsets
    from the start), the steady part between the ramp-up (the first streams still opening) and the drain."""
    cpu_seconds: asyncio.Task | None = None

    def started(worker_pids: list[int], start: RunStart) -> None:
        nonlocal cpu_seconds
        cpu_seconds = asyncio.create_task(_cpu_seconds_in(window, start.start_ts, worker_pids, server_pid))

    records, timing, _ = await run_in_workers(
        config, len(placement.worker_cpus), cpus_per_worker=placement.worker_cpus, on_start=started
    )
    client_cpu_s, server_cpu_s = await cpu_seconds
    return records, timing, client_cpu_s, server_cpu_s


async def _cpu_seconds_in(
    window: tuple[float, float], start_ts: float, client_pids: list[int], server_pid: int
) -> tuple[float, float]:
    readings = []
    for offset_s in window:
        await asyncio.sleep(max(0.0, start_ts + offset_s - time.perf_counter()))
        readings.append((sum(process_cpu_s(pid) for pid in client_pids), process_cpu_s(server_pid)))
    (client_before, server_before), (client_after, server_after) = readings
    return client_after - client_before, server_after - server_before


def own_cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int, thread_id: int | None = None) -> float:
    """User + system CPU seconds of another process so far, or of one of its threads (Linux)."""
    stat = Path(f"/proc/{pid}/stat" if thread_id is None else f"/proc/{pid}/task/{thread_id}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@contextlib.contextmanager
def pinned_for_timing(cpu: int):
    """This process on one CPU at timing priority, restored afterwards."""
    affinity, policy, param = os.sched_getaffinity(0), os.sched_getscheduler(0), os.sched_getparam(0)
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    prioritize_timing(cpu)
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, param)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
        os.sched_setaffinity(0, affinity)


def measure_capacity(levels: list[int], **level_options) -> list[CapacityRow]:
    rows = []
    for streams in levels:
        rows.append(measure_level(streams, **level_options))
        time.sleep(0.5)  # let the previous server's sockets close
    return rows
