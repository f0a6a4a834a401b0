"""Chaos Toolkit probes of the kvstorm extension (``provider: {type: python, module: chaos.probes, func: ...}``).

The steady-state hypothesis runs before the method and again after it, with the same probes:

- probes over a load (``load_latency``, ``load_outcomes``, ``load_success_ratio``) read the load the method ran;
  before the method, when that load has not run, they read a calm baseline instead: a few requests one at a time
  with the experiment's request shapes (``chaos.run.load.load_for_probe``), so "the SLOs hold before" means the server
  meets them when nothing is wrong;
- ``settled`` records what the server holds (queues, KV) before the method, and after it waits for the server to
  return there;
- ``leaked_kv_blocks`` then counts KV blocks still held beyond that;
- ``prefix_cache_recovery_s``: how long the prefix cache's hit rate took to come back after the last fault;
- ``slo_met`` and ``slo_burn_rate`` judge the load by an SLO of the dashboards' spec (``chaos.judgement.slo_check``);
- ``stated_promise_kept``: the load's admitted requests against the TTFT objective the server itself states.

Every probe reads only HTTP (``/metrics``, ``/health``), so the hypothesis holds as well against vLLM. Thresholds
live in each probe's tolerance in the experiment file (a range ``[0, X]`` for a latency in seconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import requests

from chaos.judgement.slo_check import SloResult, evaluate, run_spec
from chaos.run.load import load_for_probe
from chaos.run.metrics import EngineActivity, KVOccupancy, prefix_cache_phases, scrape, wait_until_settled
from chaos.run.state import current
from loadgen.analysis import METRICS, STATS
from loadgen.records import Outcome

NO_VALUE = -1.0  # a latency with no ok request to measure it: outside any [0, X] tolerance


def server_healthy(target_url: str) -> bool:
    try:
        return requests.get(f"{target_url.rstrip('/')}/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


def load_latency(metric: str, stat: str, load: str = "main", configuration: Mapping[str, Any] | None = None) -> float:
    """A latency statistic of the load's ok requests in seconds: ``metric`` ttft, tpot, itl or e2e; ``stat`` mean,
    p50, p90, p95, p99 or max."""
    if metric not in METRICS or stat not in STATS:
        raise ValueError(f"metric must be one of {METRICS} and stat one of {tuple(STATS)}, got {metric}, {stat}")
    stats = getattr(load_for_probe(load, configuration).result.summary, metric)
    return NO_VALUE if stats is None else round(stats.stat(stat), 4)


def load_outcomes(outcome: str, load: str = "main", configuration: Mapping[str, Any] | None = None) -> int:
    """How many of the load's requests ended as ``outcome`` (ok, rejected, broken_stream, client_timeout)."""
    return load_for_probe(load, configuration).result.summary.outcomes[Outcome(outcome)]


def load_success_ratio(load: str = "main", configuration: Mapping[str, Any] | None = None) -> float:
    """The fraction of the load's requests that streamed cleanly to the end."""
    summary = load_for_probe(load, configuration).result.summary
    return round(summary.outcomes[Outcome.OK] / summary.num_requests, 4) if summary.num_requests else 0.0


def settled(target_url: str, timeout_s: float = 120.0) -> float:
    """Before the method: records what the server holds (0 seconds). After: seconds until it holds no more
    requests and KV than that again, or -1 if it does not within ``timeout_s`` (a leak, or a server that never
    recovers)."""
    state = current()
    if state.baseline_occupancy is None:
        state.baseline_occupancy = KVOccupancy.of(scrape(target_url))
        return 0.0
    seconds, _ = wait_until_settled(target_url, timeout_s, state.baseline_occupancy)
    return NO_VALUE if seconds is None else round(seconds, 2)


def leaked_kv_blocks(target_url: str) -> int:
    """KV blocks held beyond what the server held before the method, both pools (kvstorm's block gauges); on a
    server without them, 1 when its KV usage is above what it was, else 0."""
    occupancy = KVOccupancy.of(scrape(target_url))
    baseline = current().baseline_occupancy or occupancy
    if occupancy.used_blocks is not None:
        before = baseline.used_blocks or {}
        return sum(max(0, used - before.get(pool, 0)) for pool, used in occupancy.used_blocks.items())
    return int(occupancy.device_usage > baseline.device_usage or occupancy.host_usage > baseline.host_usage)


def prefix_cache_recovery_s(target_url: str, load: str = "main") -> float:
    """Seconds from the end of the last fault until the server's prefix-cache hit rate was back to 90% of its rate
    before the faults (``chaos.run.metrics.prefix_cache_phases``), or -1 when it was not within the load. Before the
    method, with no fault yet, 0 once the server shows it exports the counters. Fails, never passes, on a server
    that exports no prefix-cache counters or served nothing from its cache before the faults: there is no rate to
    recover to."""
    if load not in current().loads:
        if not scrape(target_url).has("vllm:prefix_cache_queries_total"):
            raise RuntimeError("not exported by this server: vllm:prefix_cache_queries_total")
        return 0.0
    run = current().loads[load]
    phases = prefix_cache_phases(run.samples, current().fault_windows)
    if phases is None:
        raise RuntimeError(f"no prefix-cache phases: no fault during load {load!r}, or no prefix-cache counters")
    if not phases.before.hit_rate:
        raise RuntimeError("the server served no prompt token from its prefix cache before the faults")
    recovery_s = phases.hit_rate_recovery_s
    return NO_VALUE if recovery_s is None else round(recovery_s, 2)


# The objective a server states for its admitted requests' time to first token, by quantile (kvstorm's --ttft-slo).
STATED_TTFT_OBJECTIVE = "kvstorm:admission_ttft_objective_seconds"


def stated_promise_kept(target_url: str, load: str = "main", configuration: Mapping[str, Any] | None = None) -> str:
    """Whether the load's admitted requests (every one not refused) kept the time to first token the server states
    on /metrics (``STATED_TTFT_OBJECTIVE``) at the quantile it states: "kept: ...", "missed: ..." (an admitted
    request that never got a first token misses it), "no promise stated" (a server that states none, or kvstorm
    with ``--ttft-slo off``), or "unreadable promise: ..." (a quantile outside (0, 1] or an objective that is not a
    positive number: it fails the check). Tolerance: ``{type: regex, pattern: "^(kept|no promise stated)"}``."""
    stated = scrape(target_url).by_label(STATED_TTFT_OBJECTIVE, "quantile")
    if not stated:
        return "no promise stated"
    quantile_label, objective_s = max(stated.items())
    try:
        quantile = float(quantile_label)
    except ValueError:
        quantile = math.nan
    if not (0 < quantile <= 1 and 0 < objective_s < math.inf):  # a promise that cannot be kept or checked
        return f"unreadable promise: {STATED_TTFT_OBJECTIVE}{{quantile={quantile_label[:32]!r}}} {objective_s:g}"
    records = load_for_probe(load, configuration).result.records
    waits = sorted(math.inf if r.ttft_s is None else r.ttft_s for r in records if r.outcome is not Outcome.REJECTED)
    if not waits:
        return f"kept: no request was admitted to a TTFT objective of {objective_s:g} s"
    at_quantile = waits[max(0, math.ceil(quantile * len(waits)) - 1)]
    within = sum(wait <= objective_s for wait in waits)
    verdict = "kept" if at_quantile <= objective_s else "missed"
    wait = "no first token" if math.isinf(at_quantile) else f"{at_quantile:.2f} s"
    return (
        f"{verdict}: admitted TTFT p{quantile * 100:g} {wait} against the stated {objective_s:g} s "
        f"({within} of {len(waits)} admitted within it)"
    )


def storms_with_leaks() -> int:
    """Disconnect storms (``chaos.actions.disconnect_storm``) after which the server did not return to its queues and
    KV usage of before, or counted fewer aborts than clients hung up (``StormReport.num_aborts_missing``; on a
    server that counts no aborts at all, the verdict's storm table says "not exported by this server")."""
    return sum(storm.leaked or bool(storm.num_aborts_missing) for storm in current().storms)


def slo_met(slo: str, load: str = "main", configuration: Mapping[str, Any] | None = None) -> bool:
    """Whether the load met one SLO of the run's spec (the dashboards' ``dashboards.slo``, by name: ttft, itl, e2e,
    errors, admitted, preemptions, swap_out, kv_usage), judged from the server's /metrics as the SLO dashboard
    judges it; true when the load caused no event it counts."""
    return _slo_result(slo, load, configuration).met is not False


def slo_burn_rate(slo: str, load: str = "main", configuration: Mapping[str, Any] | None = None) -> float:
    """How many times faster than its objective allows the load spent an events SLO's error budget (0: not at all;
    the burn-rate alerts page at 14.4 and 6)."""
    burn_rate = _slo_result(slo, load, configuration).burn_rate
    return 0.0 if burn_rate is None else round(burn_rate, 2)


def preemptions(load: str = "main", mode: str | None = None) -> int:
    """Preemptions while the load ran (``mode``: swap or recompute, kvstorm only; all of them otherwise)."""
    if mode is None:
        return _activity(load).preemptions
    _require_series(load, "kvstorm:preemptions_total")
    return _activity(load).preemptions_by_mode.get(mode, 0)


def swapped_out_blocks(load: str = "main") -> int:
    """KV blocks swapped out to host memory while the load ran (kvstorm)."""
    _require_series(load, "kvstorm:swap_blocks_total")
    return _activity(load).swapped_out_blocks


def promql(prometheus_url: str, query: str) -> float:
    """The value of an instant PromQL query (the first series; -1 when it returns none)."""
    response = requests.get(f"{prometheus_url.rstrip('/')}/api/v1/query", params={"query": query}, timeout=30)
    response.raise_for_status()
    result = response.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else NO_VALUE


def _slo_result(name: str, load: str, configuration: Mapping[str, Any] | None) -> SloResult:
    slos = {slo.name: slo for slo in run_spec()}
    if name not in slos:
        raise ValueError(f"unknown SLO {name!r}; the spec has {', '.join(slos)}")
    return evaluate(slos[name], load_for_probe(load, configuration))


def _require_series(load: str, name: str) -> None:
    """A kvstorm-only series the probe reads: a server without it fails the probe, never passes it on a zero."""
    _activity(load)  # the load ran to its end
    if not current().loads[load].metrics_after.has(name):
        raise RuntimeError(f"not exported by this server: {name}")


def _activity(load: str) -> EngineActivity:
    run = current().loads.get(load)
    if run is None or run.metrics_before is None or run.metrics_after is None:
        raise RuntimeError(f"load {load!r} has not run to its end")
    return EngineActivity.between(run.metrics_before, run.metrics_after, run.samples)
