"""Loads an experiment runs: the load generator's open-loop run, with the server's metrics scraped around it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any

import requests

from chaos.run.metrics import MetricsSample, scrape
from chaos.run.monitor import MetricsMonitor
from chaos.run.state import LoadRun, RunState, current
from loadgen.benchmark import run_benchmark
from loadgen.results import RunConfig, RunResult
from loadgen.runner import RunCutShort, run_event_loop

BASELINE_REQUESTS = 3
# The baseline draws its prompts from a seed no load uses by default, so it leaves no prefix in a server's cache that
# the load after it would be served from (the load's first requests would then start warm).
BASELINE_SEED = 1_000_003
# How often a running load looks whether the experiment was interrupted.
STOP_POLL_S = 0.2
# How long the scrape after a load waits for a server that is down, polled every second: one the experiment restarts
# (kill-and-restart, whose server may take longer to come back than the load lasts: vLLM-CPU's 68 s), and any other,
# down for good as far as the run knows (vLLM after an out-of-memory step), for long enough to tell a blip from that.
AFTER_SCRAPE_TIMEOUT_S = 180.0
DOWN_FOR_GOOD_AFTER_S = 10.0


HARNESS_DEFAULTS: dict[str, Any] = {
    "workload": "random",
    "input_len": "fixed:128",
    "output_len": "fixed:64",
    "num_requests": None,
    "duration_s": None,
    "max_concurrency": None,
    "request_timeout_s": 300.0,
    "stall_timeout_s": 30.0,
    "seed": 0,
}


def load_config(target_url: str, model: str, arrival: str, **fields: Any) -> RunConfig:
    """A load's configuration: ``fields`` over the harness's defaults, exact output lengths, no SLO of its own (the
    experiment's probes judge)."""
    unknown = set(fields) - set(HARNESS_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown load settings {sorted(unknown)}")
    values = {**HARNESS_DEFAULTS, **fields}
    return RunConfig(base_url=target_url, model=model, arrival=arrival, exact_output=True, slo=None, **values)


def run_load(name: str, config: RunConfig, metrics_url: str | None = None) -> LoadRun:
    """Run a load to its end and record it in the run's state under ``name``. ``metrics_url``: where the server's
    ``/metrics`` are when the load goes through something else (a fault proxy); default the load's target."""
    load = LoadRun(name)
    current().loads[name] = load
    _execute(load, config, metrics_url or config.base_url)
    return load


def _execute(load: LoadRun, config: RunConfig, metrics_url: str) -> None:
    state = current()
    load.counters.on_record = lambda record: state.emit(
        "request", load=load.name, outcome=record.outcome.value, ttft_s=record.ttft_s, itl_s=record.itl_s
    )
    try:
        load.metrics_before = scrape(metrics_url)
        with MetricsMonitor(metrics_url) as monitor:
            benchmark = run_benchmark(config, show_progress=False, counters=load.counters)
            result = run_event_loop(_unless_stopped(benchmark, state.stopping))
        result.prometheus = monitor.series()
        load.samples = monitor.samples
        load.result = result
        load.metrics_after = _scrape_once_up(metrics_url, state.stopping, after_scrape_timeout_s(state))
    except Exception as error:
        load.error = f"{type(error).__name__}: {error}"
        raise


def after_scrape_timeout_s(state: RunState) -> float:
    """How long the scrape after a load waits for a server that does not answer: ``AFTER_SCRAPE_TIMEOUT_S`` where
    the run restarts its server, else ``DOWN_FOR_GOOD_AFTER_S``."""
    return AFTER_SCRAPE_TIMEOUT_S if state.managed_server is not None else DOWN_FOR_GOOD_AFTER_S


def _scrape_once_up(metrics_url: str, stopping: threading.Event, timeout_s: float) -> MetricsSample:
    """A scrape of ``metrics_url``, waiting up to ``timeout_s`` for a server that does not answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return scrape(metrics_url)
        except requests.RequestException:
            if time.monotonic() > deadline or stopping.wait(1.0):
                raise


class LoadStopped(Exception):
    """The experiment was interrupted while this load ran."""


async def _unless_stopped(benchmark: Coroutine[Any, Any, RunResult], stopping: threading.Event) -> RunResult:
    """The load's run, cancelled (its open streams closed) once ``stopping`` is set."""
    run = asyncio.ensure_future(benchmark)
    while not stopping.is_set():
        done, _ = await asyncio.wait([run], timeout=STOP_POLL_S)
        if done:
            return run.result()
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError, RunCutShort):
        await run
    raise LoadStopped("the experiment was interrupted: the load's open streams were closed, the rest not sent")


def load_for_probe(name: str, configuration: Mapping[str, Any] | None) -> LoadRun:
    """The load named ``name`` once it has run; before that (the steady state before the method), a calm baseline:
    a few requests one at a time with the experiment's shapes (``configuration``: target_url, model, input_len,
    output_len, workload) and prompts of their own (``BASELINE_SEED``), run once and shared by every probe that
    asks."""
    state = current()
    load = state.loads.get(name)
    if load is not None:
        if load.result is None:
            raise RuntimeError(f"load {name!r} did not finish: {load.error or 'still running'}")
        return load
    if state.baseline is not None and state.baseline.result is None:
        raise RuntimeError(f"the baseline load did not finish: {state.baseline.error}")
    if state.baseline is None:
        config = dict(configuration or {})
        if "target_url" not in config or "model" not in config:
            raise ValueError("the experiment's configuration needs target_url and model for the baseline load")
        state.baseline = LoadRun("baseline")
        baseline_config = load_config(
            config["target_url"],
            config["model"],
            "constant:rate=100",
            num_requests=int(config.get("baseline_requests", BASELINE_REQUESTS)),
            max_concurrency=1,
            seed=BASELINE_SEED,
            **{key: config[key] for key in ("workload", "input_len", "output_len") if key in config},
        )
        _execute(state.baseline, baseline_config, config["target_url"])
    return state.baseline


def summary_of(result: RunResult) -> dict[str, Any]:
    """What a journal keeps of a load: outcomes, throughput, latency percentiles in seconds."""
    s = result.summary
    latency = {
        metric: {stat: round(getattr(stats, stat), 4) for stat in ("p50", "p90", "p99", "max")}
        for metric in ("ttft", "tpot", "itl", "e2e")
        if (stats := getattr(s, metric)) is not None
    }
    return {
        "requests": s.num_requests,
        "outcomes": {outcome.value: count for outcome, count in s.outcomes.items()},
        "duration_s": round(s.duration_s, 2),
        "request_throughput": round(s.request_throughput, 3),
        "output_token_throughput": round(s.output_token_throughput, 1),
        "latency_s": latency,
    }
