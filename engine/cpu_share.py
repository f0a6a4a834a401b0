"""The engine's CPU threads follow the share of the CPU other processes leave it.

A parallel region (a matmul, the attention, a norm) ends when its slowest thread does. Beside a process that keeps
one core busy, the OS gives the engine's thread on that core part of it, in slices of milliseconds, and every one
of the step's hundreds of regions waits for that thread's next slice: one busy-looping process slowed
``kvstorm serve``'s decode many times over (``kvstorm bench co-tenant``, docs/benchmarks.md), where the fair share
of what is left costs 2x. So a sampler thread reads every
quarter second how much of the engine's CPUs other processes used (``/proc/stat`` less this process's own CPU time,
steal included) and decides on as many threads as whole cores are left, and the runner applies it before each step
(``ThreadGovernor.follow``); when the co-tenant goes, the threads come back. It is used only where kvstorm's kernels
give the same bits at any of its thread counts (the compiled CPU attention gives each row to one thread; the tile
matmuls each output tile; oneDNN's row ranges are probed at every count, ``engine.model.packed_linear``), so a
co-tenant changes how fast a request runs, never its tokens.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch

from engine.core.outputs import CpuShare

# How often the CPU's use is read, and how many reads in a row must ask for more threads before they come back.
# Fewer are taken at the first read that asks: a step on too few threads costs at most the threads it lacks, one on
# a core shared with a busy process many times that.
SAMPLE_INTERVAL_S = 0.25
CONFIRMATIONS = 2
# Other processes' use, in cores, from which a core counts as taken: beside one at 40% of a core, the thread there
# waits often enough that the other threads are faster without it.
CORE_TAKEN_AT = 0.4
# /proc/stat's per-CPU columns that are time something ran: user, nice, system, irq, softirq and steal (time a
# hypervisor gave this CPU to another machine: a co-tenant too). Idle and iowait are not.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def thread_levels(max_threads: int) -> tuple[int, ...]:
    """The thread counts the governor may choose, most first: all of them up to 4 threads, beyond that the counts
    for one core or half the cores taken and a single thread (the probe of oneDNN's row ranges runs at each)."""
    if max_threads <= 4:
        return tuple(range(max_threads, 0, -1))
    return tuple(sorted({max_threads, max_threads - 1, math.ceil(max_threads / 2), 1}, reverse=True))


def read_cpu_busy_s(cpus: frozenset[int], stat_path: str = "/proc/stat") -> float | None:
    """Seconds ``cpus`` have run anything since boot (``_BUSY_COLUMNS``), or None where the file cannot be read."""
    try:
        with open(stat_path) as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    ticks = 0
    found = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        columns = rest.split()
        ticks += sum(int(columns[i]) for i in _BUSY_COLUMNS if i < len(columns))
        found += 1
    return ticks / os.sysconf("SC_CLK_TCK") if found == len(cpus) else None


class ThreadGovernor:
    """Runs the model's thread on as many intra-op threads (``set_threads``, torch's by default) as whole cores other
    processes leave of ``cpus``, within ``thread_levels(max_threads)``. ``sample`` reads the CPU's use (every
    ``SAMPLE_INTERVAL_S`` on a thread of its own once ``start_sampling`` is called, so a step after idle time sees
    the last quarter second, not the idle time); ``follow``, on the model's thread before each step, applies what it
    decided. ``read_busy``, ``own_cpu_s`` and ``clock`` give the CPUs' busy time, this process's CPU time and the
    time, in seconds."""

    def __init__(
        self,
        max_threads: int,
        cpus: frozenset[int],
        read_busy: Callable[[frozenset[int]], float | None] = read_cpu_busy_s,
        own_cpu_s: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.max_threads = max_threads
        self.levels = thread_levels(max_threads)
        self.cpus = cpus
        self._read_busy, self._own_cpu_s, self._clock, self._set_threads = read_busy, own_cpu_s, clock, set_threads
        self.threads = max_threads  # as decided by the last sample
        self.co_tenant_cores: float | None = None
        self._last = self._read()
        self._times_more_wanted = 0
        self._applied = threading.local()  # per thread (torch's count is): the count follow() set on it

    def _read(self) -> tuple[float, float | None, float]:
        return self._clock(), self._read_busy(self.cpus), self._own_cpu_s()

    def sample(self) -> int:
        """Read the CPU's use since the last read and decide the thread count: fewer as soon as a read asks for
        fewer, more once ``CONFIRMATIONS`` reads in a row asked for more."""
        last, self._last = self._last, self._read()
        wall_s, busy, own_s = self._last
        if busy is None or last[1] is None or wall_s <= last[0]:
            return self.threads
        self.co_tenant_cores = max(0.0, (busy - last[1] - (own_s - last[2])) / (wall_s - last[0]))
        wanted = self.threads_for(self.co_tenant_cores)
        self._times_more_wanted = self._times_more_wanted + 1 if wanted > self.threads else 0
        if wanted < self.threads or self._times_more_wanted >= CONFIRMATIONS:
            self.threads, self._times_more_wanted = wanted, 0
        return self.threads

    def follow(self) -> int:
        """The thread count for the next step, set on the calling thread where it changed."""
        threads = self.threads
        if threads != getattr(self._applied, "threads", None):
            self._set_threads(threads)
            self._applied.threads = threads
        return threads

    def start_sampling(self) -> None:
        """``sample`` every ``SAMPLE_INTERVAL_S`` on a daemon thread, which ends once this governor is gone."""
        threading.Thread(target=_sample_while_alive, args=(weakref.ref(self),), name="cpu-share", daemon=True).start()

    def threads_for(self, co_tenant_cores: float) -> int:
        """The most threads of ``levels`` that fit in the cores other processes leave whole."""
        taken = math.floor(co_tenant_cores + 1 - CORE_TAKEN_AT)
        left = len(self.cpus) - taken
        return next((level for level in self.levels if level <= left), self.levels[-1])

    def share(self) -> CpuShare:
        return CpuShare(self.threads, self.max_threads, self.co_tenant_cores, "follows the CPU other processes leave")


def _sample_while_alive(governor_ref: weakref.ref[ThreadGovernor]) -> None:
    while (governor := governor_ref()) is not None:
        governor.sample()
        del governor  # not held while asleep
        time.sleep(SAMPLE_INTERVAL_S)


class FixedThreads:
    """The engine on a fixed thread count (``--cpu-threads``, or where its results would change with the count)."""

    def __init__(self, threads: int, why: str, set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.threads, self.why = threads, why
        self._set_threads = set_threads
        self._applied = threading.local()  # per thread (torch's count is): whether follow() set it there

    def follow(self) -> int:
        if not getattr(self._applied, "done", False):
            self._set_threads(self.threads)
            self._applied.done = True
        return self.threads

    def share(self) -> CpuShare:
        return CpuShare(self.threads, self.threads, None, f"fixed: {self.why}")


def thread_policy(cpu_threads: int | None, fixed_because: str | None = None) -> ThreadGovernor | FixedThreads:
    """``cpu_threads`` fixed (set now, so that what is packed and probed next sees it), else a governor over
    torch's thread count and this process's CPUs; fixed at torch's count ``fixed_because`` (where results would
    change with the count) or where ``/proc/stat`` cannot be read."""
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
        return FixedThreads(cpu_threads, "--cpu-threads")
    max_threads = torch.get_num_threads()
    if fixed_because is not None:
        return FixedThreads(max_threads, fixed_because)
    if max_threads == 1:
        return FixedThreads(1, "no fewer to run on")
    cpus = frozenset(os.sched_getaffinity(0))
    if read_cpu_busy_s(cpus) is None:
        return FixedThreads(max_threads, "/proc/stat cannot be read here")
    governor = ThreadGovernor(max_threads, cpus)
    governor.start_sampling()
    return governor


def describe_threads(share: CpuShare) -> str:
    """The start-up line's words: "2 CPU threads, fewer while other processes take a core" or "... (fixed: why)"."""
    if share.policy.startswith("fixed"):
        return f"{share.threads} CPU thread{'s' * (share.threads != 1)} ({share.policy})"
    return f"{share.max_threads} CPU threads, fewer while other processes take a core"
