"""Prometheus files from the SLO spec: recording rules for every SLI, multi-window multi-burn-rate alerts, alerts on
the engine's own failure modes, and the scrape config.

Recording rules are named ``level:metric:operation`` (``model_name:slo_ttft_errors:ratio_rate5m``: the fraction of
requests over the TTFT threshold in the last 5 minutes, per model). Burn-rate alerts follow Google's SRE workbook:
page when the error budget burns 14.4x too fast over both 1h and 5m, or 6x over both 6h and 30m; open a ticket at
1x over both 3d and 6h. The others fire on what the chaos experiments provoke: a preemption storm, swap thrash, an
engine that stopped stepping with work to do, KV held by an engine with no request left.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from dashboards.slo import GUARDRAIL_FOR_S, MODEL, RATE_WINDOWS, Slo

RULES_FILE = "kvstorm-rules.yml"
# (severity, long window, short window, burn rate)
BURN_RATE_ALERTS = (
    ("page", "1h", "5m", 14.4),
    ("page", "6h", "30m", 6.0),
    ("ticket", "3d", "6h", 1.0),
)
SWAP_THRASH_BLOCKS_PER_S = 5.0
GUARDRAIL_ALERTS = {"preemptions": "PreemptionStorm", "swap_out": "SwapOutRateHigh", "kv_usage": "KVCacheNearlyFull"}


def guardrail_record(slo: Slo) -> str:
    return f"{MODEL}:slo_{slo.name}:value"


def recordings(slos: Sequence[Slo]) -> dict[str, str]:
    """Each recording rule's name and the expression it records."""
    return {rule["record"]: rule["expr"] for group in rule_groups(slos)["groups"] for rule in group["rules"]
            if "record" in rule}  # fmt: skip


def rule_groups(slos: Sequence[Slo], interval: str = "15s") -> dict[str, Any]:
    """The rule file's content (``RULES_FILE``), evaluated every ``interval``."""
    events = [slo for slo in slos if slo.kind == "events"]
    guardrails = [slo for slo in slos if slo.kind == "guardrail"]
    recording = [
        {"record": slo.recorded_error_ratio(window), "expr": slo.error_ratio(window)}
        for slo in events
        for window in RATE_WINDOWS
    ] + [{"record": guardrail_record(slo), "expr": slo.value} for slo in guardrails]
    alerts = [alert for slo in events for alert in _burn_rate_alerts(slo)]
    alerts += [_guardrail_alert(slo) for slo in guardrails]
    alerts += ENGINE_ALERTS
    return {
        "groups": [
            {"name": "kvstorm-slo-recording", "interval": interval, "rules": recording},
            {"name": "kvstorm-alerts", "interval": interval, "rules": alerts},
        ]
    }


def _burn_rate_alerts(slo: Slo) -> list[dict[str, Any]]:
    alerts = []
    for severity, long, short, burn in BURN_RATE_ALERTS:
        limit = burn * slo.error_budget
        alerts.append(
            {
                "alert": f"SLOBurn_{slo.name}_{long}_{short}",
                "expr": f"{slo.recorded_error_ratio(long)} > {limit:g} "
                f"and {slo.recorded_error_ratio(short)} > {limit:g}",
                "labels": {"severity": severity, "slo": slo.name},
                "annotations": {
                    "summary": f"{slo.title}: the error budget burns {burn:g}x too fast ({long} and {short})",
                    "description": f"SLO: {slo.description}. At {burn:g}x the 30-day budget "
                    f"({slo.error_budget:.2%} of requests) lasts {30 / burn:.1f} days.",
                },
            }
        )
    return alerts


def _guardrail_alert(slo: Slo) -> dict[str, Any]:
    return {
        "alert": GUARDRAIL_ALERTS.get(slo.name, f"Guardrail_{slo.name}"),
        "expr": f"{guardrail_record(slo)} > {slo.threshold:g}",
        "for": f"{GUARDRAIL_FOR_S}s",
        "labels": {"severity": "ticket", "slo": slo.name},
        "annotations": {
            "summary": f"{slo.title} above {slo.threshold:g} for {GUARDRAIL_FOR_S / 60:g} minutes",
            "description": slo.description,
        },
    }


ENGINE_ALERTS: list[dict[str, Any]] = [
    {
        "alert": "SwapThrash",
        "expr": " and ".join(
            f'sum by ({MODEL}) (rate(kvstorm:swap_blocks_total{{direction="{direction}"}}[2m])) '
            f"> {SWAP_THRASH_BLOCKS_PER_S:g}"
            for direction in ("out", "in")
        ),
        "for": "2m",
        "labels": {"severity": "ticket"},
        "annotations": {
            "summary": "KV blocks swapped out and back in, both fast, for 2 minutes: the engine is thrashing",
            "description": "The KV pool is too small for the load, or capped: preemption by recompute, admission "
            "control or more KV memory would stop the copies.",
        },
    },
    {
        "alert": "EngineStalled",
        "expr": f"sum by ({MODEL}) (vllm:num_requests_running) > 0 "
        f"and sum by ({MODEL}) (rate(vllm:generation_tokens_total[1m])) == 0",
        "for": "1m",
        "labels": {"severity": "page"},
        "annotations": {
            "summary": "Requests are running and no token was generated for a minute: the engine is wedged",
            "description": "A hung kernel, a deadlock or a frozen loop; kvstorm's /health says so after "
            "--stall-timeout.",
        },
    },
    {
        "alert": "KVHeldAfterDrain",
        "expr": f"sum by ({MODEL}) (vllm:num_requests_running + vllm:num_requests_waiting) == 0 "
        f"and max by ({MODEL}) (vllm:kv_cache_usage_perc) > 0",
        "for": "2m",
        "labels": {"severity": "ticket"},
        "annotations": {
            "summary": "No request in the engine and its KV cache still in use for 2 minutes: leaked blocks",
            "description": "An aborted or finished request did not give its blocks back.",
        },
    },
]


def scrape_config(
    engine_targets: Sequence[str] | Path, controller_targets: Sequence[str], interval: str = "5s"
) -> dict:
    """``prometheus.yml``: the engine(s) and the chaos controller(s), and the rule file beside it. ``engine_targets``:
    host:port addresses, or the file_sd file that names them (compose's, written from its target's URL by
    ``dashboards.scrape_target``)."""
    if isinstance(engine_targets, Path):
        engine = {"job_name": "engine", "file_sd_configs": [{"files": [str(engine_targets)]}]}
    else:
        engine = {"job_name": "engine", "static_configs": [{"targets": list(engine_targets)}]}
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [RULES_FILE],
        "scrape_configs": [
            engine,
            {"job_name": "chaos-controller", "static_configs": [{"targets": list(controller_targets)}]},
        ],
    }


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=200)
