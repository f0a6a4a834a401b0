"""A server's ``/metrics`` as numbers: scraped, parsed with prometheus-client's parser, compared over time.

Only vLLM's metric names are needed for the checks that must work on any server (queues, KV usage, preemptions,
finish reasons); kvstorm's own series (``kvstorm:*``: preemptions by mode, swapped blocks, free blocks per pool)
add detail where they exist.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import requests
from prometheus_client.parser import text_string_to_metric_families

from loadgen.results import FaultWindow

LabelSet = frozenset[tuple[str, str]]
_SAMPLE_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


@dataclass(frozen=True)
class MetricsSample:
    """Every sample of one scrape, by sample name and label set, and when it was taken (``time.time()``)."""

    unix_s: float
    values: dict[str, dict[LabelSet, float]] = field(default_factory=dict)
    # Every family the page declares, with samples or not yet (a labelled counter before its first event).
    families: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str, unix_s: float) -> MetricsSample:
        values: dict[str, dict[LabelSet, float]] = {}
        families = set()
        for family in text_string_to_metric_families(text):
            families.add(family.name)
            for sample in family.samples:
                values.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
        return cls(unix_s, values, frozenset(families))

    def has(self, name: str) -> bool:
        """Whether the server exports the series ``name`` (a sample name such as ``x_total``, or a family)."""
        family = next((name.removesuffix(s) for s in _SAMPLE_SUFFIXES if name.endswith(s)), name)
        return name in self.values or name in self.families or family in self.families

    def total(self, name: str, **labels: str) -> float:
        """The sum over every series of ``name`` whose labels include ``labels`` (0 when there is none)."""
        wanted = set(labels.items())
        return sum(value for label_set, value in self.values.get(name, {}).items() if wanted <= label_set)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name`` summed per value of one label."""
        sums: dict[str, float] = {}
        for label_set, value in self.values.get(name, {}).items():
            key = dict(label_set).get(label, "")
            sums[key] = sums.get(key, 0.0) + value
        return sums


def scrape(base_url: str, timeout_s: float = 10.0) -> MetricsSample:
    response = requests.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return MetricsSample.parse(response.text, time.time())


@dataclass(frozen=True)
class EngineActivity:
    """What a server did between two scrapes (counter deltas). kvstorm's own series are None on a server that does
    not export them (vLLM has no swap, no admission refusals, no failed-step counter): never a zero it did not
    report."""

    preemptions: int
    preemptions_by_mode: dict[str, int] | None
    recomputed_tokens: int | None
    swapped_out_blocks: int | None
    swapped_in_blocks: int | None
    swapped_bytes: int | None
    failed_steps: int | None
    aborted_requests: int
    finished_by_reason: dict[str, int]
    rejected_by_reason: dict[str, int] | None

    @classmethod
    def between(
        cls, before: MetricsSample, after: MetricsSample, during: Sequence[MetricsSample] = ()
    ) -> EngineActivity:
        """``during``: the scrapes taken in between, so that a counter that drops (the server restarted) counts
        from zero again, as Prometheus' ``increase()`` does, instead of going negative."""
        chain = [before, *during, after]

        def delta(name: str, **labels: str) -> int:
            return round(counter_increase([sample.total(name, **labels) for sample in chain]))

        def delta_by(name: str, label: str) -> dict[str, int]:
            counts = [sample.by_label(name, label) for sample in chain]
            return {
                key: round(counter_increase([count.get(key, 0.0) for count in counts]))
                for key in sorted(after.by_label(name, label))
            }

        # kvstorm's own series: None where the server does not export them.
        def own_delta(name: str, **labels: str) -> int | None:
            return delta(name, **labels) if after.has(name) else None

        def own_delta_by(name: str, label: str) -> dict[str, int] | None:
            return delta_by(name, label) if after.has(name) else None

        return cls(
            preemptions=delta("vllm:num_preemptions_total"),
            preemptions_by_mode=own_delta_by("kvstorm:preemptions_total", "mode"),
            recomputed_tokens=own_delta("kvstorm:recomputed_tokens_total"),
            swapped_out_blocks=own_delta("kvstorm:swap_blocks_total", direction="out"),
            swapped_in_blocks=own_delta("kvstorm:swap_blocks_total", direction="in"),
            swapped_bytes=own_delta("kvstorm:swap_bytes_total"),
            failed_steps=own_delta("kvstorm:failed_steps_total"),
            aborted_requests=delta("vllm:request_success_total", finished_reason="abort"),
            finished_by_reason=delta_by("vllm:request_success_total", "finished_reason"),
            rejected_by_reason=own_delta_by("kvstorm:rejected_requests_total", "reason"),
        )


@dataclass(frozen=True)
class KVOccupancy:
    """Requests in the engine's queues and the KV it holds, from one scrape."""

    running: int
    waiting: int
    swapped: int
    device_usage: float
    host_usage: float
    # kvstorm only: blocks in use per pool (total minus free); None on other servers.
    used_blocks: dict[str, int] | None

    @classmethod
    def of(cls, sample: MetricsSample) -> KVOccupancy:
        used = None
        if sample.has("kvstorm:free_blocks"):
            free, total = (
                sample.by_label("kvstorm:free_blocks", "pool"),
                sample.by_label("kvstorm:total_blocks", "pool"),
            )
            used = {pool: round(total[pool] - free.get(pool, 0.0)) for pool in total}
        return cls(
            running=round(sample.total("vllm:num_requests_running")),
            waiting=round(sample.total("vllm:num_requests_waiting")),
            swapped=round(sample.total("vllm:num_requests_swapped")),
            device_usage=sample.total("vllm:kv_cache_usage_perc"),
            host_usage=sample.total("vllm:cpu_cache_usage_perc"),
            used_blocks=used,
        )

    def within(self, baseline: KVOccupancy) -> bool:
        """No more requests in any queue and no more KV held than at ``baseline``."""
        baseline_blocks = baseline.used_blocks or {}
        blocks_within = self.used_blocks is None or all(
            used <= baseline_blocks.get(pool, 0) for pool, used in self.used_blocks.items()
        )
        return (
            self.running <= baseline.running
            and self.waiting <= baseline.waiting
            and self.swapped <= baseline.swapped
            and self.device_usage <= baseline.device_usage
            and self.host_usage <= baseline.host_usage
            and blocks_within
        )


IDLE = KVOccupancy(running=0, waiting=0, swapped=0, device_usage=0.0, host_usage=0.0, used_blocks=None)


def wait_until_settled(
    base_url: str, timeout_s: float, baseline: KVOccupancy = IDLE, interval_s: float = 0.25
) -> tuple[float | None, KVOccupancy]:
    """Poll ``/metrics`` until the server holds no more requests and KV than at ``baseline`` (by default: none):
    (the seconds it took, or None when it did not within ``timeout_s``; the last occupancy seen)."""
    start = time.monotonic()
    while True:
        occupancy = KVOccupancy.of(scrape(base_url))
        elapsed = time.monotonic() - start
        if occupancy.within(baseline):
            return elapsed, occupancy
        if elapsed > timeout_s:
            return None, occupancy
        time.sleep(interval_s)


def time_to_recover(samples: list[MetricsSample], fault_windows: list[FaultWindow]) -> float | None:
    """Seconds from the end of the last fault until the server's backlog (waiting + swapped requests) is back to
    the most it was before the first fault; None when it never is within ``samples`` (or there was no fault)."""
    if not fault_windows:
        return None
    first_start = min(w.start_unix for w in fault_windows)
    last_end = max(w.end_unix for w in fault_windows)

    def backlog(sample: MetricsSample) -> float:
        return sample.total("vllm:num_requests_waiting") + sample.total("vllm:num_requests_swapped")

    normal = max((backlog(s) for s in samples if s.unix_s < first_start), default=0.0)
    return next((s.unix_s - last_end for s in samples if s.unix_s >= last_end and backlog(s) <= normal), None)


# The hit rate has recovered once it is back to this share of its rate before the faults, over this trailing window.
RECOVERED_SHARE = 0.9
RECOVERY_WINDOW_S = 5.0


@dataclass(frozen=True)
class CachePhase:
    """The prefix cache in one phase of a run, from the server's counters: the hit rate (hit over queried prompt
    tokens; None when no prompt was looked up), and the prompt tokens it had to compute per second (queried but
    missed: the prefill the cache did not spare)."""

    hit_rate: float | None
    computed_tokens_per_s: float | None


@dataclass(frozen=True)
class PrefixCachePhases:
    """The prefix cache before the first fault, while faults were on, and after the last one ended; and how long
    after the last fault the hit rate took to come back to ``RECOVERED_SHARE`` of its rate before (over the trailing
    ``RECOVERY_WINDOW_S``; None when it did not within the load, or had no rate before)."""

    before: CachePhase
    during: CachePhase
    after: CachePhase
    hit_rate_recovery_s: float | None


def prefix_cache_phases(samples: list[MetricsSample], fault_windows: list[FaultWindow]) -> PrefixCachePhases | None:
    """None when there was no fault, or the server exports no prefix-cache counters."""
    if not fault_windows or not samples or not samples[0].has("vllm:prefix_cache_queries_total"):
        return None
    first_start = min(w.start_unix for w in fault_windows)
    last_end = max(w.end_unix for w in fault_windows)
    fault_on, fault_off = _last_at(samples, first_start), _last_at(samples, last_end)
    before = cache_phase(samples[0], fault_on)
    recovery_s = None
    if before.hit_rate:
        for sample in samples:
            if sample.unix_s <= last_end:
                continue
            window_start = _last_at(samples, max(last_end, sample.unix_s - RECOVERY_WINDOW_S))
            rate = cache_phase(window_start, sample).hit_rate
            if rate is not None and rate >= RECOVERED_SHARE * before.hit_rate:
                recovery_s = sample.unix_s - last_end
                break
    return PrefixCachePhases(
        before=before,
        during=cache_phase(fault_on, fault_off),
        after=cache_phase(fault_off, samples[-1]),
        hit_rate_recovery_s=recovery_s,
    )


def _last_at(samples: list[MetricsSample], unix_s: float) -> MetricsSample:
    return next((s for s in reversed(samples) if s.unix_s <= unix_s), samples[0])


def cache_phase(start: MetricsSample, end: MetricsSample) -> CachePhase:
    """The prefix cache between two scrapes of one server."""
    queried = end.total("vllm:prefix_cache_queries_total") - start.total("vllm:prefix_cache_queries_total")
    hits = end.total("vllm:prefix_cache_hits_total") - start.total("vllm:prefix_cache_hits_total")
    seconds = end.unix_s - start.unix_s
    return CachePhase(
        hit_rate=hits / queried if queried > 0 else None,
        computed_tokens_per_s=(queried - hits) / seconds if seconds > 0 else None,
    )


def counter_increase(counts: Sequence[float]) -> float:
    """A counter's increase over its values in consecutive scrapes; a drop is a restart, after which it counts from
    zero (Prometheus' ``increase()``)."""
    return sum(later - earlier if later >= earlier else later for earlier, later in pairwise(counts))
