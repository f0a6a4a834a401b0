"""What one experiment run has done so far, shared by its actions, probes and controls.

Chaos Toolkit calls each activity as a plain function (background ones in threads) and keeps nothing between them,
so the run's state lives here, one per process: ``chaos run`` runs one experiment per process, and ``kvstorm chaos
run`` calls ``reset`` before each.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos.injectors.cpu_co_tenant import CpuCoTenant
from chaos.injectors.disconnects import StormReport
from chaos.injectors.engine_admin import LeaseKeeper
from chaos.injectors.processes import ManagedServer
from chaos.injectors.proxy import FaultProxy
from chaos.injectors.supervised import SupervisedServer
from chaos.run.metrics import KVOccupancy, MetricsSample
from loadgen.counters import RunCounters
from loadgen.results import FaultWindow, RunResult

if TYPE_CHECKING:  # chaos.run.sizing runs loads, which record themselves here
    from chaos.run.sizing import TargetSize

# The SLO spec a run is judged by (chaos.judgement.slo_check): a profile of dashboards.slo and a file of overrides.
SLO_PROFILE_ENV = "KVSTORM_SLO_PROFILE"
SLO_FILE_ENV = "KVSTORM_SLO_FILE"


@dataclass
class LoadRun:
    """One load the experiment ran (or the calm baseline the steady state measures before the method)."""

    name: str
    counters: RunCounters = field(default_factory=RunCounters)
    result: RunResult | None = None
    metrics_before: MetricsSample | None = None
    metrics_after: MetricsSample | None = None
    # /metrics every second while it ran (chaos.run.monitor).
    samples: list[MetricsSample] = field(default_factory=list)
    error: str | None = None


@dataclass
class RunState:
    started_unix: float = field(default_factory=time.time)
    loads: dict[str, LoadRun] = field(default_factory=dict)
    # The baseline load the steady-state probes measure when the load they name has not run yet.
    baseline: LoadRun | None = None
    # Faults by window name ("engine:kv_cap", "network:downstream", ...): when they went on (unix seconds), and
    # the closed windows.
    open_faults: dict[str, float] = field(default_factory=dict)
    fault_windows: list[FaultWindow] = field(default_factory=list)
    # What the server held before the method (the first "settled" probe records it).
    baseline_occupancy: KVOccupancy | None = None
    proxies: dict[str, FaultProxy] = field(default_factory=dict)
    storms: list[StormReport] = field(default_factory=list)
    # The server kill-and-restart kills: one it started itself, or one a supervisor restarts (chaos.controls and
    # chaos.supervised_control).
    managed_server: ManagedServer | SupervisedServer | None = None
    # Why the server cannot take this experiment (chaos.judgement.applicability), when the kvstorm control stopped it.
    not_applicable: str | None = None
    # Per server with engine faults set: the thread that renews their lease.
    lease_keepers: dict[str, LeaseKeeper] = field(default_factory=dict)
    # CPU co-tenants started on this host (chaos.injectors.cpu_co_tenant), for the rollback to stop.
    co_tenants: list[CpuCoTenant] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    # The server's capacity and KV size, once the method's measure_target has measured them (chaos.run.sizing).
    target_size: TargetSize | None = None
    slo_profile: str = field(default_factory=lambda: os.environ.get(SLO_PROFILE_ENV, "cpu"))
    slo_file: Path | None = field(
        default_factory=lambda: Path(os.environ[SLO_FILE_ENV]) if os.environ.get(SLO_FILE_ENV) else None
    )
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set when the experiment is interrupted (a SIGTERM from the controller's stop, Ctrl-C): loads still running end
    # early (chaos.run.load) instead of holding the process until the rest of their schedule has been sent.
    stopping: threading.Event = field(default_factory=threading.Event)
    # Who hears the run's events as they happen (``emit``): phases, activities, faults on and off, load figures,
    # each request's end (``kvstorm chaos run --events``, which the chaos controller reads).
    listeners: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"ts": time.time(), "type": kind, **fields}
        for listener in self.listeners:
            listener(event)

    def main_load(self) -> LoadRun | None:
        """The load named "main", else the first one the experiment ran."""
        return self.loads.get("main") or next(iter(self.loads.values()), None)

    def fault_on(self, name: str, now: float | None = None) -> None:
        with self.lock:
            if name in self.open_faults:
                return
            self.open_faults[name] = now or time.time()
        self.emit("fault", name=name, active=True, at=self.open_faults[name])

    def fault_off(self, name: str, now: float | None = None) -> None:
        with self.lock:
            start = self.open_faults.pop(name, None)
            if start is None:
                return
            window = FaultWindow(name=name, start_unix=start, end_unix=now or time.time())
            self.fault_windows.append(window)
        self.emit("fault", name=name, active=False, at=window.end_unix)

    def all_faults_off(self, now: float | None = None) -> None:
        for name in list(self.open_faults):
            self.fault_off(name, now)


_run = RunState()


def reset() -> RunState:
    """A fresh state for the next experiment."""
    global _run
    _run = RunState()
    return _run


def current() -> RunState:
    return _run
