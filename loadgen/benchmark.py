"""One serving benchmark from its configuration to its :class:`RunResult`: plan, run open-loop, summarize, fetch
the server's Prometheus series. The library entry point behind ``kvstorm bench serve``; a caller that injects faults
passes their windows, and the report draws them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

from loadgen.analysis import LATE_TTFT_ROW, TURN_COLUMNS, Summary, advisories, describe_rates, parse_slos, summarize
from loadgen.arrivals import ARRIVAL_KINDS
from loadgen.client import StreamingClient
from loadgen.counters import RunCounters
from loadgen.plan import plan_run
from loadgen.progress import LiveProgress
from loadgen.prometheus import fetch_series
from loadgen.records import Outcome
from loadgen.results import FaultWindow, RunConfig, RunResult
from loadgen.runner import RunCutShort
from loadgen.spec import parse_spec
from loadgen.traces import replay
from loadgen.workers import run_in_workers


async def run_benchmark(
    config: RunConfig,
    *,
    fault_windows: Sequence[FaultWindow] = (),
    prometheus_url: str | None = None,
    prometheus_step_s: float = 1.0,
    extra_body: dict | None = None,
    api_key: str | None = None,
    show_progress: bool = True,
    counters: RunCounters | None = None,
    announce: Callable[[str], None] | None = None,
) -> RunResult:
    """``counters``: live counts for a caller that shows its own progress (a chaos run); fresh ones otherwise.
    ``announce``: told, before anything is sent, what the plan expects where a reader should know it first (the
    prefix reuse a shared-prefix workload offers). A run stopped before its end raises :class:`RunCutShort` with
    ``result`` set: the results of the requests that ended, marked ``cut_short``, for the caller to keep."""
    slos = parse_slos(config.slo)  # fail on a bad SLO before sending anything
    plan = plan_run(config)
    shareable = sum(planned.shared_prefix_tokens for planned in plan.requests)
    if announce is not None and shareable:
        prompt_tokens = sum(len(planned.body["prompt"]) for planned in plan.requests)
        announce(
            f"Prefix reuse the plan offers: {shareable} of its {prompt_tokens} prompt tokens "
            f"({shareable / prompt_tokens:.1%}) repeat a prefix an earlier request sent (a server caches whole "
            "blocks only, so it can serve a little less)"
        )
    counters = counters or RunCounters()
    progress = LiveProgress(counters) if show_progress else contextlib.nullcontext()
    cut: RunCutShort | None = None
    try:
        if config.workers > 1:
            async with progress:
                records, timing, _ = await run_in_workers(
                    config, config.workers, extra_body=extra_body, api_key=api_key, counters=counters
                )
        else:
            client = StreamingClient.for_run(config, extra_body=extra_body, api_key=api_key, counters=counters)
            async with client, progress:
                records, timing = await plan.run(client, config.max_concurrency)
    except RunCutShort as error:
        cut, records, timing = error, error.records, error.timing
    summary = summarize(records, timing.duration_s, slos, plan.num_turns)
    notes = advisories(summary, records, exact_output=config.exact_output, max_concurrency=config.max_concurrency)
    notes += timing.notes
    if parse_spec(config.arrival, ARRIVAL_KINDS).kind == "trace":
        notes.insert(0, replay(config.arrival).description)
    if cut is not None:
        notes.insert(0, f"CUT SHORT: {cut.reason}. Every number here is of the requests that ended before.")
    series = []
    if prometheus_url and cut is None:
        end_unix = max(time.time(), timing.start_unix + timing.duration_s)
        series, prometheus_notes = await fetch_series(prometheus_url, timing.start_unix, end_unix, prometheus_step_s)
        notes += prometheus_notes
    result = RunResult(
        run_id=timing.run_id,
        start_unix=timing.start_unix,
        start_ts=timing.start_ts,
        config=config,
        summary=summary,
        advisories=notes,
        records=records,
        fault_windows=list(fault_windows),
        prometheus=series,
        cut_short=cut.reason if cut is not None else None,
    )
    if cut is not None:
        cut.result = result
        raise cut
    return result


def summary_markdown(result: RunResult) -> str:
    """The run in a few lines of markdown: what ran, outcomes, throughput, latency table, SLOs, advisories."""
    s, c = result.summary, result.config
    bounds = f"{c.num_requests} requests" if c.num_requests else f"{c.duration_s:g} s" if c.duration_s else "to its end"
    cap = f", max concurrency {c.max_concurrency}" if c.max_concurrency else ""
    cap += f", sent from {c.workers} worker processes" if c.workers > 1 else ""
    lines = [
        f"Server {c.base_url}, model `{c.model}`; workload `{c.workload}` (input `{c.input_len}`, output "
        f"`{c.output_len}`{', exact' if c.exact_output else ''}); arrival `{c.arrival}`, {bounds}{cap}.",
        "",
        f"{s.num_requests} requests in {s.duration_s:.1f} s (peak {s.peak_in_flight} in flight): "
        + ", ".join(f"{outcome.value} {s.outcomes[outcome]}" for outcome in Outcome)
        + f". Throughput **{s.request_throughput:.2f} req/s**, **{s.output_token_throughput:.1f} output tok/s**"
        + (f", goodput **{s.goodput:.2f} req/s**." if s.goodput is not None else "."),
        "",
        "| ms | mean | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    for metric, label in (*((m, m.upper()) for m in ("ttft", "tpot", "itl", "e2e")), LATE_TTFT_ROW):
        stats = getattr(s, metric)
        cells = " | ".join(
            f"{getattr(stats, k) * 1e3:.1f}" if stats else "-" for k in ("mean", "p50", "p90", "p99", "max")
        )
        lines.append(f"| {label} | {cells} |")
    lines += _detail_lines(s)
    for slo_result in s.slos:
        observed = "-" if slo_result.observed_s is None else f"{slo_result.observed_s * 1e3:.1f} ms"
        verdict = "met" if slo_result.met else "**MISSED**"
        lines.append(f"\nSLO {slo_result.slo.name} <= {slo_result.slo.threshold_s * 1e3:g} ms: {observed}, {verdict}")
    lines += [f"\n> {note}" for note in result.advisories]
    return "\n".join(lines)


def _detail_lines(s: Summary) -> list[str]:
    lines = [f"\n{text}" for text in (describe_rates(s),) if text]
    lines += [f"\n{part.describe()}" for part in (s.sessions, s.prefix_reuse) if part is not None]
    if s.turns:
        lines += ["", "| " + " | ".join(TURN_COLUMNS) + " |", "|" + "---|" * len(TURN_COLUMNS)]
        lines += ["| " + " | ".join(turn.cells()) + " |" for turn in s.turns]
    return lines
