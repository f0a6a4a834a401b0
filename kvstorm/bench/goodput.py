"""``kvstorm bench goodput``: the goodput curve under overload, with admission control off and on.

Finds the capacity (the highest Poisson rate at which the SLOs hold with admission off), then runs multiples of it
against a fresh ``kvstorm serve`` each, once with ``--ttft-slo off`` and once with the objective. Per run: goodput
(requests meeting every SLO per second of the schedule), ok / rejected / broken / timed out, TTFT and TPOT of the
admitted requests, the forecast's error (predicted over observed TTFT of each admitted request: how often within
25%, and its 10th, 50th and 90th percentiles, from the server's histogram, after the first ``--warm-up`` seconds),
the cold start (the longest TTFT of the requests sent in the first seconds), and whether Retry-After tells the
truth: a probe sends one request every few seconds, and when it is refused waits the Retry-After it was given and
sends it again, counting the second tries that are admitted. Writes the table and an HTML plot (plotly,
self-contained) to the results directory; docs/benchmarks.md keeps a section per dtype and CPU kind (admission's
promise is one per machine)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from chaos.injectors.processes import kvstorm_server
from engine.model.registry import describe_dtype_choice, resolve_dtype
from kernels.cpu_isa import cpu_kind
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import cpu_name
from loadgen.analysis import parse_slos
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.results import RunConfig, RunResult
from loadgen.runner import run_event_loop
from loadgen.spec import parse_duration

PREDICTION_TOLERANCE_BUCKETS = ("0.75", "1.25")  # predicted / observed within 25% either way
PREDICTION_QUANTILES = (0.1, 0.5, 0.9)
PROBE_INTERVAL_S = 3.0
# The cold start: requests sent this early meet a server whose step-time model and margin are still learning.
COLD_START_S = 5.0


def add_bench_goodput_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "goodput",
        help="goodput at multiples of capacity, admission control off and on",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--server-args",
        default="--num-kv-blocks 136 --swap-space 1GiB --preemption-mode auto",
        help="kvstorm serve's arguments besides port, model and admission",
    )
    parser.add_argument("--input-len", default="fixed:256")
    parser.add_argument("--output-len", default="fixed:64")
    parser.add_argument("--ttft-slo", default="5s", help="the TTFT objective: the SLO of goodput and admission's")
    parser.add_argument("--tpot-slo", default="1s", help="the TPOT bound of goodput (admission does not use it)")
    parser.add_argument("--duration", type=parse_duration, default=40.0, help="schedule of each run")
    parser.add_argument("--capacity", type=float, default=None, help="skip the search: this many requests/s")
    parser.add_argument("--multiples", default="0.5,1,2,3,5", help="rates to run, as multiples of the capacity")
    parser.add_argument(
        "--warm-up",
        type=parse_duration,
        default=10.0,
        help="predictions before this are not counted (the model learns)",
    )
    parser.add_argument("--request-timeout", type=parse_duration, default=60.0, help="the client's whole-request limit")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--results-dir", type=Path, default=Path("bench-results"))


@dataclass(frozen=True)
class GoodputRow:
    admission: str
    multiple: float
    rate: float
    ok: int
    rejected: int
    broken: int
    timed_out: int
    goodput: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    predictions_within_25pct: float | None
    # Predicted over observed TTFT at PREDICTION_QUANTILES (under 1: the first token came later than predicted).
    prediction_ratio_quantiles: tuple[float, ...] | None
    cold_start_ttft_max_s: float | None
    retries: int
    retries_admitted: int


def run_bench_goodput(args: argparse.Namespace) -> BenchReport:
    slo = f"ttft_p99={args.ttft_slo},tpot_p99={args.tpot_slo}"
    parse_slos(slo)
    bench = _Bench(args, slo)
    capacity = args.capacity or bench.find_capacity()
    multiples = [float(m) for m in args.multiples.split(",")]
    rows = [
        bench.run(admission, multiple, capacity * multiple)
        for admission in ("off", args.ttft_slo)
        for multiple in multiples
    ]
    html_path = args.results_dir / f"goodput-{time.strftime('%Y%m%d-%H%M%S')}.html"
    _plot(rows, capacity, parse_duration(args.ttft_slo), html_path)
    dtype = _server_dtype(args.server_args)
    return BenchReport(
        _markdown(args, capacity, bench.search_log, rows, html_path, dtype),
        data={"rows": [asdict(r) for r in rows], "cpu": cpu_name(), "cpu_kind": cpu_kind()},
        case=f"{str(resolve_dtype(dtype, torch.device('cpu'))).removeprefix('torch.')}-{cpu_kind()}",
    )


def _server_dtype(server_args: str) -> str:
    """The ``--dtype`` the servers are given (auto when none)."""
    words = shlex.split(server_args)
    given = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--dtype"]
    given += [word.split("=", 1)[1] for word in words if word.startswith("--dtype=")]
    return given[-1] if given else "auto"


class _Bench:
    def __init__(self, args: argparse.Namespace, slo: str) -> None:
        self.args, self.slo = args, slo
        self.search_log: list[str] = []

    def find_capacity(self) -> float:
        """Double the rate from 0.5/s until the SLOs fail with admission off, then bisect twice."""
        low, high = 0.0, 0.5
        while self._holds(high):
            low, high = high, high * 2
        for _ in range(2):
            middle = (low + high) / 2
            low, high = (middle, high) if self._holds(middle) else (low, middle)
        if low == 0:
            raise RuntimeError("the SLOs fail even at 0.5 requests/s: nothing to measure")
        return low

    def _holds(self, rate: float) -> bool:
        result, _, _ = self._run("off", rate)
        summary = result.summary
        holds = all(s.met for s in summary.slos) and summary.outcomes[Outcome.OK] == len(result.records)
        slos = ", ".join(f"{s.slo.metric}_{s.slo.stat} {_ms(s.observed_s)}" for s in summary.slos)
        self.search_log.append(f"{rate:.3g} req/s: {slos}: {'held' if holds else 'missed'}")
        return holds

    def run(self, admission: str, multiple: float, rate: float) -> GoodputRow:
        result, (within, quantiles), probes = self._run(admission, rate)
        summary = result.summary
        counts, ttft, tpot = summary.outcomes, summary.ttft, summary.tpot
        return GoodputRow(
            admission=admission,
            multiple=multiple,
            rate=rate,
            ok=counts[Outcome.OK],
            rejected=counts[Outcome.REJECTED],
            broken=counts[Outcome.BROKEN_STREAM],
            timed_out=counts[Outcome.CLIENT_TIMEOUT],
            # Per second of the schedule, not of the run: a backlog that drains after it must not dilute the rate.
            goodput=(summary.goodput or 0.0) * summary.duration_s / self.args.duration,
            ttft_p50_s=ttft.p50 if ttft else None,
            ttft_p99_s=ttft.p99 if ttft else None,
            tpot_p50_s=tpot.p50 if tpot else None,
            tpot_p99_s=tpot.p99 if tpot else None,
            predictions_within_25pct=within,
            prediction_ratio_quantiles=quantiles,
            cold_start_ttft_max_s=max(
                (r.ttft_s for r in result.records if r.outcome is Outcome.OK and r.sent_s < COLD_START_S),
                default=None,
            ),
            retries=len(probes),
            retries_admitted=sum(probes),
        )

    def _run(self, admission: str, rate: float) -> tuple[RunResult, PredictionError, list[bool]]:
        args = self.args
        serve_args = ["--model", args.model, "--ttft-slo", admission, *shlex.split(args.server_args)]
        log_path = args.results_dir / f"goodput-server-{admission}-{rate:.3f}.log"
        with kvstorm_server(serve_args, log_path) as kvstorm:
            config = RunConfig(
                base_url=kvstorm.url,
                model=args.model,
                arrival=f"poisson:rate={rate:.4f}",
                workload="random",
                input_len=args.input_len,
                output_len=args.output_len,
                num_requests=None,
                duration_s=args.duration,
                max_concurrency=None,
                request_timeout_s=args.request_timeout,
                stall_timeout_s=30.0,
                exact_output=True,
                seed=args.seed,
                slo=self.slo,
            )
            result, error, probes = run_event_loop(_measure(config, args.warm_up))
        result.write(args.results_dir / f"goodput-{admission}-{rate:.3f}.json")
        return result, error, probes


# The share of predictions within 25% and the ratio's PREDICTION_QUANTILES; None where nothing was predicted.
PredictionError = tuple[float | None, tuple[float, ...] | None]


async def _measure(config: RunConfig, warm_up_s: float) -> tuple[RunResult, PredictionError, list[bool]]:
    async with aiohttp.ClientSession() as session:
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe_retry_after(session, config, stop))
        warm = asyncio.create_task(_ratio_buckets_after(session, config.base_url, warm_up_s))
        result = await run_benchmark(config, show_progress=False)
        stop.set()
        probes = await probe
        before = await warm
        after = await _ratio_buckets(session, config.base_url)
    if before is None or after is None or after["+Inf"] == before["+Inf"]:
        return result, (None, None), probes
    counted = {le: after[le] - before[le] for le in after}
    low, high = PREDICTION_TOLERANCE_BUCKETS
    within = (counted[high] - counted[low]) / counted["+Inf"]
    return result, (within, tuple(_bucket_quantile(counted, q) for q in PREDICTION_QUANTILES)), probes


def _bucket_quantile(cumulative: dict[str, float], quantile: float) -> float:
    """The quantile of a histogram's cumulative bucket counts, interpolated within its bucket as Prometheus'
    histogram_quantile does (from 0 below the first bucket; the last finite bound beyond it)."""
    bounds = sorted((float(le), count) for le, count in cumulative.items())
    rank = quantile * bounds[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 0.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


async def _probe_retry_after(session: aiohttp.ClientSession, config: RunConfig, stop: asyncio.Event) -> list[bool]:
    """Every few seconds one request like the load's; when refused, wait its Retry-After and send it again: True
    for each second try that was admitted. An admitted probe is cancelled at once (its 200 is the answer)."""
    body = {"model": config.model, "prompt": "Retry-After probe " * 60, "max_tokens": 8, "stream": True}
    outcomes: list[bool] = []
    url = f"{config.base_url}/v1/completions"
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), PROBE_INTERVAL_S)
        if stop.is_set():
            break
        async with session.post(url, json=body) as first:
            if first.status != 429:
                continue
            retry_after_s = float(first.headers["Retry-After"])
        await asyncio.sleep(retry_after_s)
        async with session.post(url, json=body) as second:
            outcomes.append(second.status == 200)
    return outcomes


async def _ratio_buckets_after(session: aiohttp.ClientSession, base_url: str, delay_s: float) -> dict | None:
    await asyncio.sleep(delay_s)
    return await _ratio_buckets(session, base_url)


async def _ratio_buckets(session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """Cumulative counts of ``kvstorm:admission_ttft_prediction_ratio`` by ``le``; None if the server has none."""
    async with session.get(f"{base_url}/metrics") as response:
        text = await response.text()
    buckets = {}
    for line in text.splitlines():
        if line.startswith("kvstorm:admission_ttft_prediction_ratio_bucket{"):
            labels, value = line.rsplit(" ", 1)
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = float(value)
    return buckets or None


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.0f} ms"


def _seconds(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s:.2f}"


def _markdown(args, capacity: float, search_log: list[str], rows: list[GoodputRow], html_path: Path, dtype: str) -> str:
    device = torch.device("cpu")
    lines = [
        f"{platform.machine()}, {cpu_name()} ({cpu_kind()}), {torch.get_num_threads()} threads; the engine in "
        f"{str(resolve_dtype(dtype, device)).removeprefix('torch.')} ({describe_dtype_choice(dtype, device)}).",
        "",
        f"`kvstorm serve {args.server_args}` on the bundled {args.model}, a fresh server per run (so every point "
        "starts from a cold prefix cache, whatever the seed: no point is served what an earlier one sent); Poisson "
        f"arrivals for {args.duration:g} s, prompts `{args.input_len}`, outputs `{args.output_len}` (exact); SLOs "
        f"TTFT p99 <= {args.ttft_slo} and TPOT p99 <= {args.tpot_slo}; goodput counts the requests that met both, per "
        f"second of the schedule. Client timeout {args.request_timeout:g} s.",
        "",
        f"Capacity: **{capacity:.2f} req/s**"
        + (f" (search, admission off: {'; '.join(search_log)})" if search_log else " (given)"),
        "",
        "| admission | load | req/s | ok / rejected / broken / timed out | goodput req/s | vs 1x | TTFT p50 / p99 s "
        "| TPOT p50 / p99 ms | predictions within 25% | predicted / observed p10 / p50 / p90 "
        f"| TTFT max, sent in the first {COLD_START_S:g} s | retries admitted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    baseline = {r.admission: r.goodput for r in rows if r.multiple == 1.0}
    for r in rows:
        ratio = f"{r.goodput / baseline[r.admission]:.0%}" if baseline.get(r.admission) else "-"
        within = "-" if r.predictions_within_25pct is None else f"{r.predictions_within_25pct:.0%}"
        quantiles = " / ".join(f"{q:.2f}" for q in r.prediction_ratio_quantiles or ()) or "-"
        admission = "off" if r.admission == "off" else f"TTFT {r.admission}"
        lines.append(
            f"| {admission} | {r.multiple:g}x | {r.rate:.2f} | {r.ok} / {r.rejected} / {r.broken} / {r.timed_out} "
            f"| {r.goodput:.2f} | {ratio} | {_seconds(r.ttft_p50_s)} / {_seconds(r.ttft_p99_s)} "
            f"| {_ms(r.tpot_p50_s).removesuffix(' ms')} / {_ms(r.tpot_p99_s).removesuffix(' ms')} | {within} "
            f"| {quantiles} | {_seconds(r.cold_start_ttft_max_s)} | {r.retries_admitted} of {r.retries} |"
        )
    lines.append(f"\nPlot: `{html_path.name}` in the results directory (plotly, self-contained).")
    return "\n".join(lines)


def _plot(rows: list[GoodputRow], capacity: float, ttft_slo_s: float, path: Path) -> None:
    figure = make_subplots(
        rows=1, cols=2, subplot_titles=("Goodput (requests/s meeting the SLOs)", "TTFT p99 of admitted requests (s)")
    )
    objective = next(r.admission for r in rows if r.admission != "off")
    for admission, color in (("off", "#d62728"), (objective, "#2ca02c")):
        mine = [r for r in rows if r.admission == admission]
        name = "admission off" if admission == "off" else f"admission, TTFT objective {admission}"
        x = [r.multiple for r in mine]
        figure.add_trace(go.Scatter(x=x, y=[r.goodput for r in mine], name=name, line={"color": color}), 1, 1)
        figure.add_trace(
            go.Scatter(x=x, y=[r.ttft_p99_s for r in mine], name=name, line={"color": color}, showlegend=False), 1, 2
        )
    figure.add_hline(y=ttft_slo_s, line={"dash": "dot", "color": "grey"}, annotation_text="SLO", row=1, col=2)
    multiples = sorted({r.multiple for r in rows})
    figure.update_xaxes(
        title_text=f"offered load, multiple of capacity ({capacity:.2f} req/s)",
        type="log",
        tickvals=multiples,
        ticktext=[f"{m:g}x" for m in multiples],
    )
    figure.update_yaxes(rangemode="tozero")
    figure.update_layout(
        width=1080,
        height=460,
        margin={"t": 90, "b": 60, "l": 50, "r": 20},
        legend={"orientation": "h", "x": 0.5, "xanchor": "center", "y": 1.2},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.write_html(path, include_plotlyjs=True, config={"displayModeBar": False})
