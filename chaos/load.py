"""Loads an experiment runs: the load generator's open-loop run, with the server's metrics scraped around it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from chaos.metrics import scrape
from chaos.monitor import MetricsMonitor
from chaos.state import LoadRun, current
from loadgen.benchmark import run_benchmark
from loadgen.results import RunConfig, RunResult

BASELINE_REQUESTS = 3


def run_load(
    name: str,
    target_url: str,
    model: str,
    *,
    arrival: str,
    duration_s: float | None = None,
    num_requests: int | None = None,
    workload: str = "random",
    input_len: str = "fixed:128",
    output_len: str = "fixed:64",
    max_concurrency: int | None = None,
    request_timeout_s: float = 300.0,
    stall_timeout_s: float = 30.0,
    seed: int = 0,
    metrics_url: str | None = None,
) -> LoadRun:
    """Run a load to its end and record it in the run's state under ``name``. ``metrics_url``: where the server's
    ``/metrics`` are when the load goes through something else (a fault proxy); default ``target_url``."""
    load = LoadRun(name)
    current().loads[name] = load
    config = RunConfig(
        base_url=target_url,
        model=model,
        arrival=arrival,
        workload=workload,
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests,
        duration_s=duration_s,
        max_concurrency=max_concurrency,
        request_timeout_s=request_timeout_s,
        stall_timeout_s=stall_timeout_s,
        exact_output=True,
        seed=seed,
        slo=None,
    )
    _execute(load, config, metrics_url or target_url)
    return load


def _execute(load: LoadRun, config: RunConfig, metrics_url: str) -> None:
    try:
        load.metrics_before = scrape(metrics_url)
        with MetricsMonitor(metrics_url) as monitor:
            result = asyncio.run(run_benchmark(config, show_progress=False, counters=load.counters))
        result.prometheus = monitor.series()
        load.samples = monitor.samples
        load.result = result
        load.metrics_after = scrape(metrics_url)
    except Exception as error:
        load.error = f"{type(error).__name__}: {error}"
        raise


def load_for_probe(name: str, configuration: Mapping[str, Any] | None) -> LoadRun:
    """The load named ``name`` once it has run; before that (the steady state before the method), a calm baseline:
    a few requests one at a time with the experiment's shapes (``configuration``: target_url, model, input_len,
    output_len, workload), run once and shared by every probe that asks."""
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
        baseline_config = RunConfig(
            base_url=config["target_url"],
            model=config["model"],
            arrival="constant:rate=100",
            workload=config.get("workload", "random"),
            input_len=config.get("input_len", "fixed:128"),
            output_len=config.get("output_len", "fixed:64"),
            num_requests=int(config.get("baseline_requests", BASELINE_REQUESTS)),
            duration_s=None,
            max_concurrency=1,
            request_timeout_s=300.0,
            stall_timeout_s=30.0,
            exact_output=True,
            seed=0,
            slo=None,
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
