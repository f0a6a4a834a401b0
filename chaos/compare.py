"""One experiment against kvstorm in each preemption mode (recompute, swap, auto), back to back on identical load.

For each mode a fresh ``kvstorm serve --preemption-mode MODE`` is started with the same arguments, the experiment
runs against it (same seed, so the same arrivals, prompts and lengths), and the server is stopped. The table puts
the modes side by side: the verdict, the clients' latency, what preemption cost (blocks and bytes moved, tokens
computed again) and goodput (ok requests per second that met every latency SLO of the experiment).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from chaos.engine_admin import ADMIN_TOKEN_ENV
from chaos.processes import ManagedServer, free_port
from chaos.runner import ExperimentRun, run_experiment_file
from loadgen.analysis import Slo, summarize

MODES = ("recompute", "swap", "auto")


@dataclass(frozen=True)
class ModeRun:
    mode: str
    run: ExperimentRun
    goodput: float | None


def compare_preemption_modes(
    experiment: Path,
    modes: Sequence[str],
    server_args: Sequence[str],
    results_root: Path,
    model: str = "smollm2-135m",
    console: Console | None = None,
) -> list[ModeRun]:
    console = console or Console(stderr=True)
    os.environ.setdefault(ADMIN_TOKEN_ENV, secrets.token_urlsafe(16))
    runs = []
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"preemption modes are {MODES}, got {mode!r}")
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        command = ["kvstorm", "serve", "--port", str(port), "--preemption-mode", mode, *server_args]
        results_root.mkdir(parents=True, exist_ok=True)
        server = ManagedServer(command, f"{base_url}/ready", log_path=results_root / f"server-{mode}.log")
        console.print(f"[bold]--preemption-mode {mode}[/]: starting the server ...")
        server.start()
        try:
            run = run_experiment_file(experiment, {"target_url": base_url, "model": model}, results_root, console)
        finally:
            server.stop()
        runs.append(ModeRun(mode, run, _goodput(run)))
    return runs


def comparison_markdown(runs: Sequence[ModeRun]) -> str:
    header = (
        "| mode | verdict | ok / broken / timed out | TTFT p50 / p99 s | TPOT p50 / p99 ms | E2E p50 / p99 s "
        "| preemptions (swap / recompute) | swapped out | recomputed tokens | goodput req/s |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for mode_run in runs:
        verdict = mode_run.run.verdict
        load, activity = verdict.load, verdict.activity
        if load is None or activity is None:
            lines.append(f"| {mode_run.mode} | {verdict.status}: {verdict.reason} |")
            continue
        outcomes = load.outcomes
        by_mode = activity.preemptions_by_mode
        lines.append(
            f"| {mode_run.mode} | {verdict.status} "
            f"| {outcomes['ok']} / {outcomes['broken_stream']} / {outcomes['client_timeout']} "
            f"| {_pair(load.ttft, 1)} | {_pair(load.tpot, 1e3)} | {_pair(load.e2e, 1)} "
            f"| {activity.preemptions} ({by_mode.get('swap', 0)} / {by_mode.get('recompute', 0)}) "
            f"| {activity.swapped_out_blocks} blocks, {activity.swapped_bytes / 2**20:.0f} MiB "
            f"| {activity.recomputed_tokens} | {_number(mode_run.goodput)} |"
        )
    return "\n".join(lines)


def _goodput(run: ExperimentRun) -> float | None:
    """Ok requests per second whose own latencies met every latency SLO the experiment states."""
    slos = [
        Slo(metric=args["metric"], stat=args["stat"], threshold_s=float(probe["tolerance"]["range"][1]))
        for probe in run.journal["experiment"]["steady-state-hypothesis"]["probes"]
        if probe["provider"].get("func") == "load_latency"
        for args in [probe["provider"]["arguments"]]
    ]
    if run.load is None or not slos:
        return None
    return summarize(run.load.records, run.load.summary.duration_s, slos).goodput


def _pair(stats, scale: float) -> str:
    return "-" if stats is None else f"{stats.p50 * scale:.2f} / {stats.p99 * scale:.2f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
