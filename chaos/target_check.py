"""``kvstorm chaos check``: a look at a server before any experiment is sent to it.

What it exports (vLLM's series, kvstorm's, the prefix cache's counters, its KV size in ``vllm:cache_config_info``),
whether kvstorm's fault contract answers (``/admin/faults``: the bundled engine, or kvstorm's plugin in a vLLM, at
``faults_url``), which experiments of the library apply to it and, for each that does not, why; then a few calm
requests, one at a time, and an SLO profile sized from what they measured. The profile is written beside the run
folders (``<results>/targets/<host>-<port>.*``) and ``kvstorm chaos run`` against the same target judges by it
unless the operator names a profile or an SLO file.

The sizing rule (``measured_profile``): TTFT within 20x the calm median (at least 0.5 s), each inter-token gap within
10x the calm time per output token (at least 50 ms), the whole request within its calm median twice over plus the
TTFT bound, each raised to the nearest bucket boundary the server's histogram has (a latency SLO is counted from
the bucket at its threshold); the guardrails (preemptions, swap) are those of the built-in profile whose pace is
nearest (``h200`` when a calm token takes under 20 ms, else ``cpu``). It is a starting point from one calm moment,
said as such in the verdicts it judges: a server's operator who holds an SLO of their own gives it with
``--slo-file``.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.run.load import load_config
from chaos.run.metrics import MetricsSample, scrape
from chaos.run.sizing import CACHE_CONFIG_SERIES, kv_tokens_of
from dashboards.slo import bucket_bounds, load_spec
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.runner import run_event_loop

CALM_SHAPES = {"workload": "random", "input_len": "fixed:128", "output_len": "fixed:64"}
SWAP_FAULTS = frozenset({"swap_cap", "swap_delay_per_block"})
SWAP_SERIES = "kvstorm:swap_blocks_total"
PREFIX_CACHE_SERIES = "vllm:prefix_cache_queries_total"
# The sizing rule (see the module's docstring).
TTFT_MULTIPLE, MIN_TTFT_S = 20.0, 0.5
ITL_MULTIPLE, MIN_ITL_S = 10.0, 0.05
FAST_TOKEN_S = 0.02


@dataclass(frozen=True)
class FaultsAnswer:
    """What ``GET <faults_url>/admin/faults`` said: ``usable`` when the faults can be set with the token at hand."""

    url: str
    usable: bool
    description: str


@dataclass(frozen=True)
class CalmMeasurement:
    num_requests: int
    ttft_p50_s: float
    ttft_max_s: float
    tpot_p50_s: float
    e2e_p50_s: float


@dataclass(frozen=True)
class TargetFacts:
    target_url: str
    model: str
    families: frozenset[str]
    kv_tokens: int | None
    faults: FaultsAnswer
    has_admin_stats: bool

    @property
    def exports(self) -> dict[str, bool]:
        return {
            "vLLM's series (vllm:*)": any(name.startswith("vllm:") for name in self.families),
            "kvstorm's series (kvstorm:*)": any(name.startswith("kvstorm:") for name in self.families),
            f"prefix-cache counters ({PREFIX_CACHE_SERIES})": PREFIX_CACHE_SERIES in self.families,
            f"its KV size ({CACHE_CONFIG_SERIES})": self.kv_tokens is not None,
            f"swap ({SWAP_SERIES})": SWAP_SERIES in self.families,
        }


@dataclass
class TargetCheck:
    facts: TargetFacts
    applicability: dict[str, str | None]  # experiment -> None (applies) or why not
    calm: CalmMeasurement | None
    base_profile: str | None
    slo_overrides: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        facts = asdict(self.facts) | {"families": sorted(self.facts.families), "exports": self.facts.exports}
        return {
            "facts": facts,
            "applicability": self.applicability,
            "calm": None if self.calm is None else asdict(self.calm),
            "base_profile": self.base_profile,
            "slo_overrides": self.slo_overrides,
        }


def target_key(target_url: str) -> str:
    """A file name for a target: its host and port."""
    parts = urllib.parse.urlsplit(target_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return re.sub(r"[^A-Za-z0-9.-]", "_", f"{parts.hostname}-{port}")


def read_facts(target_url: str, model: str | None, faults_url: str | None, admin_token: str | None) -> TargetFacts:
    """What the target says of itself; ``RuntimeError`` when it does not answer as an OpenAI-compatible server."""
    target_url = target_url.rstrip("/")
    try:
        models = requests.get(f"{target_url}/v1/models", timeout=10).json()["data"]
        served = [entry["id"] for entry in models if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
    except (requests.RequestException, ValueError, KeyError, TypeError) as error:
        raise RuntimeError(
            f"{target_url} does not answer GET /v1/models as an OpenAI-compatible server: {error}"
        ) from None
    if model is None and not served:
        raise RuntimeError(f"{target_url} lists no model in /v1/models: give one with --model")
    sample: MetricsSample | None = None
    with contextlib.suppress(requests.RequestException, ValueError):  # no /metrics, or not Prometheus' text
        sample = scrape(target_url)
    # Sample names and family names (a labelled counter before its first event declares only its family), with a
    # counter family's samples' _total: a check asks for either.
    families = (
        frozenset()
        if sample is None
        else frozenset({*sample.values, *sample.families, *(f"{family}_total" for family in sample.families)})
    )
    return TargetFacts(
        target_url=target_url,
        model=model or served[0],
        families=families,
        kv_tokens=None if sample is None else kv_tokens_of(sample),
        faults=ask_faults((faults_url or target_url).rstrip("/"), admin_token),
        has_admin_stats=_answers(f"{target_url}/admin/stats", admin_token),
    )


def ask_faults(faults_url: str, admin_token: str | None) -> FaultsAnswer:
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        response = requests.get(f"{faults_url}/admin/faults", headers=headers, timeout=10)
    except requests.RequestException as error:
        return FaultsAnswer(faults_url, False, f"no answer from {faults_url}/admin/faults: {type(error).__name__}")
    if response.status_code == 200:
        return FaultsAnswer(faults_url, True, "kvstorm's fault contract answers, and the admin token is accepted")
    if response.status_code in (401, 403):
        return FaultsAnswer(
            faults_url, False, f"kvstorm's fault contract answers, but wants the admin token (${ADMIN_TOKEN_ENV})"
        )
    try:
        reason = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        reason = f"HTTP {response.status_code}"
    return FaultsAnswer(faults_url, False, f"no fault contract at {faults_url}/admin/faults: {str(reason)[:200]}")


def _answers(url: str, admin_token: str | None) -> bool:
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        return requests.get(url, headers=headers, timeout=10).status_code == 200
    except requests.RequestException:
        return False


def why_not_applicable(experiment: Mapping[str, Any], facts: TargetFacts) -> str | None:
    """Why ``experiment`` cannot run against the target these facts describe, or None when it can."""
    reasons = []
    for activity in experiment.get("method") or ():
        provider = activity.get("provider") or {}
        func, arguments = provider.get("func"), provider.get("arguments") or {}
        if func == "set_engine_faults":
            if not facts.faults.usable:
                reasons.append(f"its engine faults need kvstorm's fault contract: {facts.faults.description}")
            if SWAP_FAULTS & set(arguments.get("faults") or {}) and SWAP_SERIES not in facts.families:
                reasons.append(f"it slows or caps swapping, and the server exports no {SWAP_SERIES} (no swap)")
        elif func == "disconnect_storm" and arguments.get("phase") == "swapped" and not facts.has_admin_stats:
            reasons.append("its storm aims at swapped requests, which only kvstorm's /admin/stats lists")
        elif func == "kill_server":
            reasons.append("it kills and restarts the server, so the harness must start it: --var server_command=...")
        elif func == "measure_target" and arguments.get("num_requests") == 0 and facts.kv_tokens is None:
            reasons.append(f"its load is sized from the KV size, and the server exports no {CACHE_CONFIG_SERIES}")
    for probe in (experiment.get("steady-state-hypothesis") or {}).get("probes") or ():
        if (probe.get("provider") or {}).get("func") == "prefix_cache_recovery_s" and (
            PREFIX_CACHE_SERIES not in facts.families
        ):
            reasons.append(f"it times the prefix cache's recovery, and the server exports no {PREFIX_CACHE_SERIES}")
    return "; ".join(dict.fromkeys(reasons)) or None


def measure_calm(target_url: str, model: str, num_requests: int) -> CalmMeasurement:
    """``num_requests`` requests of the library's default shapes, one at a time."""
    config = load_config(target_url, model, "constant:rate=1000", num_requests=num_requests, max_concurrency=1,
                         **CALM_SHAPES)  # fmt: skip
    summary = run_event_loop(run_benchmark(config, show_progress=False)).summary
    if summary.outcomes[Outcome.OK] < num_requests or summary.ttft is None or summary.tpot is None:
        raise RuntimeError(f"not every calm request ended ok: {summary.outcomes}; nothing is sized from them")
    return CalmMeasurement(
        num_requests=num_requests,
        ttft_p50_s=round(summary.ttft.p50, 4),
        ttft_max_s=round(summary.ttft.max, 4),
        tpot_p50_s=round(summary.tpot.p50, 4),
        e2e_p50_s=round(summary.e2e.p50, 4),
    )


def measured_profile(
    calm: CalmMeasurement, buckets: Mapping[str, Sequence[float]] | None = None
) -> tuple[str, dict[str, dict[str, float]]]:
    """The built-in profile whose guardrails apply, and the latency thresholds sized from ``calm``. A latency SLO is
    counted from the server's histogram bucket at its threshold, so each threshold is raised to the nearest bucket
    boundary the server exports for it (``buckets``: SLO name -> boundaries; the largest when all are below)."""
    ttft_s = max(MIN_TTFT_S, TTFT_MULTIPLE * calm.ttft_p50_s)
    itl_s = max(MIN_ITL_S, ITL_MULTIPLE * calm.tpot_p50_s)
    e2e_s = 2 * calm.e2e_p50_s + ttft_s
    base = "h200" if calm.tpot_p50_s < FAST_TOKEN_S else "cpu"
    overrides = {}
    for name, value in (("ttft", ttft_s), ("itl", itl_s), ("e2e", e2e_s)):
        bounds = (buckets or {}).get(name)
        threshold = min((b for b in bounds if b >= value), default=max(bounds)) if bounds else float(f"{value:.2g}")
        overrides[name] = {"threshold": threshold}
    return base, overrides


def latency_buckets(sample: MetricsSample) -> dict[str, tuple[float, ...]]:
    """The bucket boundaries the server exports for each latency SLO's histogram."""
    return {
        slo.name: bounds
        for slo in load_spec()
        if slo.histogram is not None and (bounds := bucket_bounds(sample.values, slo.histogram))
    }


def check_target(
    target_url: str,
    model: str | None,
    experiments: Mapping[str, Mapping[str, Any]],
    *,
    faults_url: str | None = None,
    admin_token: str | None = None,
    calm_requests: int = 5,
) -> TargetCheck:
    facts = read_facts(target_url, model, faults_url, admin_token)
    applicability = {name: why_not_applicable(experiment, facts) for name, experiment in sorted(experiments.items())}
    calm = measure_calm(facts.target_url, facts.model, calm_requests) if calm_requests else None
    base, overrides = measured_profile(calm, latency_buckets(scrape(facts.target_url))) if calm else (None, {})
    return TargetCheck(facts, applicability, calm, base, overrides)


def write_check(check: TargetCheck, results_root: Path) -> Path:
    """The check as JSON, and its SLO overrides as a ``--slo-file``, under ``<results_root>/targets/``; returns the
    JSON's path."""
    folder = results_root / "targets"
    folder.mkdir(parents=True, exist_ok=True)
    key = target_key(check.facts.target_url)
    path = folder / f"{key}.json"
    path.write_text(json.dumps(check.to_json(), indent=1))
    if check.slo_overrides:
        (folder / f"{key}.slo.yaml").write_text(yaml.safe_dump(check.slo_overrides))
    return path


def measured_slo(results_root: Path, target_url: str) -> tuple[str, Path] | None:
    """The base profile and the SLO file a ``kvstorm chaos check`` of ``target_url`` wrote, if it wrote one."""
    folder, key = results_root / "targets", target_key(target_url)
    slo_file = folder / f"{key}.slo.yaml"
    if not slo_file.exists():
        return None
    base = json.loads((folder / f"{key}.json").read_text()).get("base_profile")
    return (base, slo_file) if isinstance(base, str) else None
