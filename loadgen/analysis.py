"""Aggregates of a run: throughput, latency percentiles, goodput under SLOs, outcome counts, and time series.

Latencies are over ``ok`` requests only (a broken stream's TTFT is not a success's TTFT); ITL pools every gap of
every ok request. Percentiles interpolate linearly (numpy's default, as vLLM's benchmark does).

SLOs (``--slo``): ``METRIC_STAT=DURATION`` joined by commas, e.g. ``ttft_p99=2s,tpot_p99=200ms``. METRIC is ttft,
tpot, itl or e2e; STAT is mean, p50, p90, p95, p99 or max. Each SLO holds when that statistic of the run is within
its threshold. Goodput counts the ok requests that meet every threshold themselves (TTFT, TPOT and E2E of the
request; for ITL, the request's longest gap), per second of the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel

from loadgen.records import Outcome, RequestRecord
from loadgen.spec import parse_duration

METRICS = ("ttft", "tpot", "itl", "e2e")
# The summary's TTFT counted from the scheduled send, as the tables label it.
LATE_TTFT_ROW = ("ttft_from_schedule", "TTFT from its scheduled send")
STATS = {"mean": None, "p50": 50, "p90": 90, "p95": 95, "p99": 99, "max": 100}


class LatencyStats(BaseModel):
    """Seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats | None:
        if not values:
            return None
        array = np.asarray(values, dtype=np.float64)
        p50, p90, p95, p99, top = np.percentile(array, [50, 90, 95, 99, 100])
        return cls(count=len(array), mean=float(array.mean()), p50=p50, p90=p90, p95=p95, p99=p99, max=top)

    def stat(self, name: str) -> float:
        return getattr(self, name)


class Slo(BaseModel):
    metric: str
    stat: str
    threshold_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}"


class SloResult(BaseModel):
    slo: Slo
    observed_s: float | None
    met: bool


class PrefixReuse(BaseModel):
    """Over the ok requests whose prompt size the server reported: how many prompt tokens a prefix cache could have
    served (their leading tokens an earlier request of the run sent first, as the workload counts them) and how many
    the server says it served (usage.prompt_tokens_details.cached_tokens; None when it never said)."""

    prompt_tokens: int
    shareable_tokens: int
    cached_tokens: int | None

    @property
    def expected_fraction(self) -> float | None:
        return self.shareable_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def measured_fraction(self) -> float | None:
        return None if self.cached_tokens is None or not self.prompt_tokens else self.cached_tokens / self.prompt_tokens

    def describe(self) -> str:
        measured = "not reported" if self.measured_fraction is None else f"{self.measured_fraction:.1%}"
        beyond = (
            " More than the workload counts: it leaves out what it cannot count in tokens before the server does (a "
            "multi-turn system prompt that other sessions sent), and a cache warm from earlier traffic serves more."
            if self.cached_tokens is not None and self.cached_tokens > self.shareable_tokens
            else ""
        )
        return (
            f"Prefix reuse: {self.expected_fraction:.1%} of {self.prompt_tokens} prompt tokens could come from a "
            f"prefix cache (the workload's count); the server says it served {measured}.{beyond}"
        )


class TurnStats(BaseModel):
    """One turn index of a multi-turn run, over its sessions' requests that reached it."""

    turn: int
    num_sent: int
    num_ok: int
    ttft: LatencyStats | None
    mean_prompt_tokens: float | None
    cached_tokens: int | None

    def cells(self) -> tuple[str, ...]:
        """A row under ``TURN_COLUMNS``."""
        p50, p99 = ("-", "-") if self.ttft is None else (f"{self.ttft.p50 * 1e3:.1f}", f"{self.ttft.p99 * 1e3:.1f}")
        prompt = "-" if self.mean_prompt_tokens is None else f"{self.mean_prompt_tokens:.0f}"
        cached = "-" if self.cached_tokens is None else str(self.cached_tokens)
        return str(self.turn), str(self.num_sent), str(self.num_ok), p50, p99, prompt, cached


TURN_COLUMNS = ("turn", "sent", "ok", "TTFT p50 ms", "TTFT p99 ms", "mean prompt tokens", "cached tokens")


class SessionCounts(BaseModel):
    """Sessions of a multi-turn run: all started at their arrival; completed ones got every turn answered ok, the
    others were cut short by a turn that was not."""

    num_sessions: int
    num_turns: int
    completed: int
    cut_short: int
    # Of the completed sessions: seconds from the first turn's send to the last answer's end (think times included).
    duration: LatencyStats | None = None

    def describe(self) -> str:
        took = (
            ""
            if self.duration is None
            else f" Completed sessions took {self.duration.p50:.1f} s (p50), {self.duration.p99:.1f} s (p99) from the "
            "first question to the last answer."
        )
        return (
            f"{self.num_sessions} sessions of {self.num_turns} turns: {self.completed} completed, {self.cut_short} cut "
            f"short by a turn that did not end ok.{took}"
        )


class Summary(BaseModel):
    duration_s: float
    num_requests: int
    outcomes: dict[Outcome, int]
    request_throughput: float
    output_token_throughput: float
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2e: LatencyStats | None
    send_lag: LatencyStats | None
    # TTFT counted from when the request was meant to leave, not from when it left: the client's own lateness
    # (a client that fell behind, a client-side concurrency cap) counts against it, as coordinated omission demands.
    ttft_from_schedule: LatencyStats | None = None
    peak_in_flight: int
    num_short_outputs: int
    slos: list[SloResult]
    goodput: float | None
    prefix_reuse: PrefixReuse | None = None
    turns: list[TurnStats] | None = None
    sessions: SessionCounts | None = None
    # Arrivals per second over the schedule as configured and as the client really sent them (first to last; a
    # multi-turn run counts the sessions' first turns, whose times the schedule sets); None with fewer than two.
    scheduled_rate: float | None = None
    delivered_rate: float | None = None


def parse_slos(text: str | None) -> list[Slo]:
    if not text:
        return []
    slos = []
    for item in text.split(","):
        name, sep, value = item.partition("=")
        metric, _, stat = name.strip().partition("_")
        if not sep or metric not in METRICS or stat not in STATS:
            raise ValueError(
                f"SLO {item!r}: expected METRIC_STAT=DURATION with METRIC in {list(METRICS)} and STAT in {list(STATS)}"
            )
        slos.append(Slo(metric=metric, stat=stat, threshold_s=parse_duration(value)))
    return slos


def summarize(
    records: list[RequestRecord], duration_s: float, slos: Sequence[Slo] = (), num_turns: int | None = None
) -> Summary:
    """``num_turns``: the turns of each session of a multi-turn run (None for single requests)."""
    ok = [record for record in records if record.outcome is Outcome.OK]
    stats = {
        "ttft": LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": LatencyStats.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": LatencyStats.of([gap for r in ok for gap in r.itl_s]),
        "e2e": LatencyStats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
    }
    counts = Counter(record.outcome for record in records)
    slo_results = []
    for slo in slos:
        metric_stats = stats[slo.metric]
        observed = metric_stats.stat(slo.stat) if metric_stats else None
        slo_results.append(
            SloResult(slo=slo, observed_s=observed, met=observed is not None and observed <= slo.threshold_s)
        )
    good = [record for record in ok if all(_meets(record, slo) for slo in slos)]
    return Summary(
        duration_s=duration_s,
        num_requests=len(records),
        outcomes={outcome: counts.get(outcome, 0) for outcome in Outcome},
        request_throughput=len(ok) / duration_s,
        output_token_throughput=sum(r.output_tokens for r in ok) / duration_s,
        send_lag=LatencyStats.of([r.sent_s - r.scheduled_s for r in records]),
        ttft_from_schedule=LatencyStats.of([r.sent_s - r.scheduled_s + r.ttft_s for r in ok if r.ttft_s is not None]),
        peak_in_flight=peak_in_flight(records),
        num_short_outputs=sum(r.output_tokens < r.requested_output_tokens for r in ok),
        slos=slo_results,
        goodput=len(good) / duration_s if slos else None,
        scheduled_rate=_rate([r.scheduled_s for r in records if r.turn in (None, 1)]),
        delivered_rate=_rate([r.sent_s for r in records if r.turn in (None, 1)]),
        prefix_reuse=prefix_reuse(ok),
        turns=turn_stats(records) if num_turns else None,
        sessions=session_counts(records, num_turns) if num_turns else None,
        **stats,
    )


def describe_rates(summary: Summary) -> str | None:
    """The arrival rate the schedule asked for beside the one the client delivered (None with fewer than two)."""
    if summary.scheduled_rate is None or summary.delivered_rate is None:
        return None
    return (
        f"Arrivals: {summary.delivered_rate:.2f} requests/s sent of {summary.scheduled_rate:.2f} scheduled "
        f"({summary.delivered_rate / summary.scheduled_rate:.0%})."
    )


def _rate(offsets_s: list[float]) -> float | None:
    span_s = max(offsets_s, default=0.0) - min(offsets_s, default=0.0)
    return (len(offsets_s) - 1) / span_s if len(offsets_s) > 1 and span_s > 0 else None


def prefix_reuse(ok: list[RequestRecord]) -> PrefixReuse | None:
    """None when the workload shares no prefix and the server reports no cached tokens."""
    counted = [r for r in ok if r.prompt_tokens is not None]
    reported = [r.cached_tokens for r in counted if r.cached_tokens is not None]
    shareable = sum(min(r.shared_prefix_tokens, r.prompt_tokens) for r in counted)
    if not counted or (not shareable and not reported):
        return None
    return PrefixReuse(
        prompt_tokens=sum(r.prompt_tokens for r in counted),
        shareable_tokens=shareable,
        cached_tokens=sum(reported) if reported else None,
    )


def turn_stats(records: list[RequestRecord]) -> list[TurnStats]:
    by_turn: dict[int, list[RequestRecord]] = {}
    for record in records:
        if record.turn is not None:
            by_turn.setdefault(record.turn, []).append(record)
    stats = []
    for turn, sent in sorted(by_turn.items()):
        ok = [r for r in sent if r.outcome is Outcome.OK]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        stats.append(
            TurnStats(
                turn=turn,
                num_sent=len(sent),
                num_ok=len(ok),
                ttft=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
                mean_prompt_tokens=float(np.mean(prompts)) if prompts else None,
                cached_tokens=sum(cached) if cached else None,
            )
        )
    return stats


def session_counts(records: list[RequestRecord], num_turns: int) -> SessionCounts:
    sessions: dict[int, list[RequestRecord]] = {}
    for record in records:
        if record.session is not None:
            sessions.setdefault(record.session, []).append(record)
    completed = [
        turns for turns in sessions.values() if len(turns) == num_turns and all(r.outcome is Outcome.OK for r in turns)
    ]
    return SessionCounts(
        num_sessions=len(sessions),
        num_turns=num_turns,
        completed=len(completed),
        cut_short=len(sessions) - len(completed),
        duration=LatencyStats.of([max(r.end_s for r in turns) - min(r.sent_s for r in turns) for turns in completed]),
    )


def _meets(record: RequestRecord, slo: Slo) -> bool:
    value = {
        "ttft": record.ttft_s,
        "tpot": record.tpot_s,
        "itl": max(record.itl_s, default=None),
        "e2e": record.e2e_s,
    }[slo.metric]
    return value is None or value <= slo.threshold_s


def peak_in_flight(records: list[RequestRecord]) -> int:
    """Most requests between their send and their end at any instant."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


class TimeSeries(BaseModel):
    """Per bucket of ``bucket_s`` seconds by send time (``start_s`` are the buckets' left edges)."""

    bucket_s: float
    start_s: list[float]
    scheduled_rate: list[float]
    sent_rate: list[float]
    outcomes: dict[Outcome, list[int]]
    ttft: dict[str, list[float | None]]
    tpot: dict[str, list[float | None]]
    itl: dict[str, list[float | None]]
    e2e: dict[str, list[float | None]]


def time_series(records: list[RequestRecord], duration_s: float, bucket_s: float = 1.0) -> TimeSeries:
    num_buckets = max(1, int(np.ceil(duration_s / bucket_s)))

    def bucket(offset_s: float) -> int:
        return min(num_buckets - 1, max(0, int(offset_s // bucket_s)))

    scheduled = np.zeros(num_buckets)
    sent = np.zeros(num_buckets)
    outcomes = {outcome: [0] * num_buckets for outcome in Outcome}
    values: dict[str, list[list[float]]] = {metric: [[] for _ in range(num_buckets)] for metric in METRICS}
    for record in records:
        scheduled[bucket(record.scheduled_s)] += 1
        index = bucket(record.sent_s)
        sent[index] += 1
        outcomes[record.outcome][index] += 1
        if record.outcome is Outcome.OK:
            for metric, value in (("ttft", record.ttft_s), ("tpot", record.tpot_s), ("e2e", record.e2e_s)):
                if value is not None:
                    values[metric][index].append(value)
            values["itl"][index].extend(record.itl_s)
    percentiles = {
        metric: {
            name: [float(np.percentile(cell, STATS[name])) if cell else None for cell in cells]
            for name in ("p50", "p90", "p99")
        }
        for metric, cells in values.items()
    }
    return TimeSeries(
        bucket_s=bucket_s,
        start_s=[i * bucket_s for i in range(num_buckets)],
        scheduled_rate=(scheduled / bucket_s).tolist(),
        sent_rate=(sent / bucket_s).tolist(),
        outcomes=outcomes,
        **percentiles,
    )


def advisories(
    summary: Summary, records: list[RequestRecord], *, exact_output: bool, max_concurrency: int | None
) -> list[str]:
    """Plain-language warnings about how far the numbers can be trusted, for the report and the terminal."""
    notes = []
    lag = summary.send_lag
    if max_concurrency is not None and lag is not None:
        notes.append(
            f"Concurrency was capped at {max_concurrency} client-side: requests over the cap waited for a slot "
            f"(send lag p99 {lag.p99 * 1e3:.1f} ms, max {lag.max * 1e3:.1f} ms). Latencies count from the real send."
        )
    elif summary.delivered_rate and summary.scheduled_rate and summary.delivered_rate < 0.95 * summary.scheduled_rate:
        notes.append(
            f"The client fell behind its schedule: it sent {summary.delivered_rate:.2f} requests/s where the schedule "
            f"asked for {summary.scheduled_rate:.2f} ({1 - summary.delivered_rate / summary.scheduled_rate:.0%} "
            "short), so the server saw a lighter load than configured. Give the client more CPU, or shard the load."
        )
    elif lag is not None and lag.max > 0.010:
        notes.append(
            f"Some requests left late (send lag max {lag.max * 1e3:.1f} ms): the client may have been overloaded "
            "(its capacity is in docs/benchmarks.md)."
        )
    if exact_output and summary.num_short_outputs:
        notes.append(
            f"{summary.num_short_outputs} ok requests returned fewer tokens than max_tokens although ignore_eos and "
            "min_tokens were sent: the server does not honour them, so output lengths are not exact."
        )
    bad_requests = [r for r in records if r.outcome is Outcome.REJECTED and r.http_status == 400]
    if bad_requests:
        notes.append(
            f"{len(bad_requests)} requests were rejected with HTTP 400, e.g. {bad_requests[0].error!r}. If it names "
            "ignore_eos, min_tokens or stream_options, the server does not accept them: rerun with --no-exact-output."
        )
    retried = [r for r in records if r.attempts > 1]
    if retried:
        retried_ok = sum(1 for r in retried if r.outcome is Outcome.OK)
        notes.append(
            f"{len(retried)} requests were sent again after a 429 or 503 ({sum(r.attempts - 1 for r in retried)} "
            f"sends more in all); {retried_ok} of them then ended ok. Their TTFT and E2E run from the first send."
        )
    ok = [r for r in records if r.outcome is Outcome.OK]
    merged = [r for r in ok if r.usage_completion_tokens is not None and r.usage_completion_tokens > r.delivered_tokens]
    if merged:
        notes.append(
            f"{len(merged)} streams carried several tokens in one chunk (the server merges outputs when its client "
            "falls behind, as vLLM does under load): their inter-token gaps are per chunk, not per token."
        )
    if ok and all(r.usage_completion_tokens is None for r in ok):
        notes.append("The server sent no usage: output tokens are the token chunks counted; prompt tokens unknown.")
    reuse = summary.prefix_reuse
    if reuse is not None and reuse.cached_tokens is None:
        notes.append(
            f"The workload could have been served {reuse.expected_fraction:.0%} of its prompt tokens from a prefix "
            "cache, but the server reported no usage.prompt_tokens_details.cached_tokens: its hit rate is unmeasured "
            "here (vLLM sends it with --enable-prompt-tokens-details; its /metrics has vllm:prefix_cache_hits)."
        )
    first = min(records, key=lambda r: r.sent_s, default=None)
    if first is not None and first.outcome is Outcome.OK and first.cached_tokens:
        notes.append(
            f"The run's first request was served {first.cached_tokens} of its prompt tokens from the server's prefix "
            "cache, which nothing of this run had filled: the cache was warm from earlier traffic (an earlier run "
            "with the same --seed sends the same prompts), so hit rates and TTFT here are better than a cold start's. "
            "Reset the cache between runs (kvstorm: POST /admin/reset_prefix_cache), restart the server, or change "
            "--seed."
        )
    return notes
