"""A verdict as tables: one list of sections, rendered for the terminal (rich), markdown and the HTML report (the
renderers take any sections: ``chaos.judgement.compare``'s side-by-side table is one)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from chaos.injectors.disconnects import NOT_EXPORTED
from chaos.judgement.verdict import Check, Verdict
from chaos.run.metrics import RECOVERED_SHARE, RECOVERY_WINDOW_S, EngineActivity
from chaos.run.sizing import CACHE_CONFIG_SERIES, TargetSize
from dashboards.slo import GUARDRAIL_FOR_S, Slo
from loadgen.records import Outcome

# The words each status of ``chaos.judgement.verdict.STATUSES`` is shown as, everywhere (terminal, verdict.md,
# report.html).
STATUS_WORDS = {
    "held": "HELD",
    "not_run": "NOT RUN",
    "deviated": "DEVIATED",
    "failed": "FAILED",
    "aborted": "ABORTED",
    "interrupted": "INTERRUPTED",
    "unknown": "UNKNOWN",
    "not_applicable": "NOT APPLICABLE",
}


@dataclass(frozen=True)
class Section:
    title: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    # Per row: True met, False missed, None neither (colours the row).
    marks: list[bool | None]


def sections(verdict: Verdict) -> list[Section]:
    result = [_checks(verdict)]
    if verdict.load is not None:
        result.append(_load(verdict))
    if verdict.activity is not None:
        result.append(_activity(verdict))
    if verdict.slos:
        result.append(_slos(verdict))
    if verdict.storms:
        keys = tuple(verdict.storms[0])
        rows = [tuple(format_value(storm[key]) for key in keys) for storm in verdict.storms]
        marks = [not (storm["leaked"] or storm["aborts_missing"] not in (0, NOT_EXPORTED)) for storm in verdict.storms]
        result.append(Section("Disconnect storms", keys, rows, marks))
    result.append(_timeline(verdict))
    return result


def headline(verdict: Verdict) -> str:
    """One line: "<title>: NOT RUN: the baseline misses ttft-p99-s (0.367 s > 1e-06), nothing was injected"."""
    return f"{verdict.title}: {STATUS_WORDS[verdict.status]}: {verdict.reason}"


def print_verdict(verdict: Verdict, console: Console) -> None:
    style = "bold green" if verdict.held else "bold red"
    console.print(Group(*rich_tables(sections(verdict)), Text(headline(verdict), style=style)))


def to_markdown(verdict: Verdict) -> str:
    return "\n\n".join([f"**{headline(verdict)}**", sections_markdown(sections(verdict))])


def to_html(verdict: Verdict) -> str:
    heading = f"<h2 class='{'met' if verdict.held else 'missed'}'>{html.escape(headline(verdict))}</h2>"
    return heading + sections_html(sections(verdict))


def rich_tables(shown: list[Section]) -> list[Table]:
    """Each section as a terminal table, each row coloured by its mark."""
    tables = []
    for section in shown:
        table = Table(title=section.title, title_justify="left", header_style="bold")
        for column in section.header:
            table.add_column(column)
        for row, mark in zip(section.rows, section.marks, strict=True):
            table.add_row(*row, style={True: "green", False: "red", None: ""}[mark])
        tables.append(table)
    return tables


def sections_markdown(shown: list[Section]) -> str:
    parts = []
    for section in shown:
        lines = [f"| {' | '.join(section.header)} |", "|" + "---|" * len(section.header)]
        lines += [f"| {' | '.join(row)} |" for row in section.rows]
        parts.append(f"{section.title}:\n\n" + "\n".join(lines))
    return "\n\n".join(parts)


def sections_html(shown: list[Section]) -> str:
    parts = []
    for section in shown:
        header = "".join(f"<th>{html.escape(column)}</th>" for column in section.header)
        rows = "".join(
            f"<tr class='{ {True: 'met', False: 'missed', None: ''}[mark] }'>"
            + "".join(f"<td>{html.escape(cell)}</td>" for cell in row)
            + "</tr>"
            for row, mark in zip(section.rows, section.marks, strict=True)
        )
        parts.append(f"<h3>{html.escape(section.title)}</h3><table><tr>{header}</tr>{rows}</table>")
    return "".join(parts)


def _checks(verdict: Verdict) -> Section:
    rows, marks = [], []
    for check in verdict.checks:
        rows.append(
            (check.name, check.expectation, format_value(check.before), format_value(check.after), _check_result(check))
        )
        marks.append(False if check.met_before is False else check.met)
    return Section(
        "Steady state (before: calm baseline; after: the experiment's load)",
        ("check", "expected", "before", "after", "result"),
        rows,
        marks,
    )


def _check_result(check: Check) -> str:
    if check.met_before is False:
        return "FAIL before the method (nothing was injected)"
    if check.met is None:
        return "not run" if check.met_before is None else "pass before; not run after"
    result = "pass" if check.met else "FAIL"
    return result + (" (evaluated after Chaos Toolkit stopped)" if check.evaluated_late else "")


def _load(verdict: Verdict) -> Section:
    s = verdict.load
    outcomes = ", ".join(f"{outcome.value} {s.outcomes[outcome]}" for outcome in Outcome)
    rows = [("requests", f"{s.num_requests} in {s.duration_s:.1f} s ({outcomes})")]
    if verdict.arrival is not None:
        rows.append(("arrival", verdict.arrival))
    if verdict.target_size is not None:
        rows.append(("sized from the server", describe_size(verdict.target_size)))
    for metric in ("ttft", "tpot", "itl", "e2e"):
        stats = getattr(s, metric)
        if stats is not None:
            rows.append(
                (f"{metric.upper()} p50 / p99 / max", f"{_ms(stats.p50)} / {_ms(stats.p99)} / {_ms(stats.max)}")
            )
    rows.append(("throughput", f"{s.request_throughput:.2f} ok req/s, {s.output_token_throughput:.1f} output tok/s"))
    marks = [s.outcomes[Outcome.BROKEN_STREAM] == 0] + [None] * (len(rows) - 1)
    return Section("The load, as its clients saw it", ("", "value"), rows, marks)


def shown_if_exported(value: Any, show: Any = str) -> str:
    """``show(value)``, or that the server does not export the series (None)."""
    return NOT_EXPORTED if value is None else show(value)


def _counts(by_key: dict[str, int]) -> str:
    return ", ".join(f"{key} {count}" for key, count in by_key.items() if count)


def describe_preemptions(a: EngineActivity) -> str:
    """The preemptions, by mode where the server exports the modes: "29 (swap 29)"."""
    if a.preemptions_by_mode is None:
        return f"{a.preemptions}" + (f" (by mode: {NOT_EXPORTED})" if a.preemptions else "")
    by_mode = _counts(a.preemptions_by_mode)
    return f"{a.preemptions}" + (f" ({by_mode})" if by_mode else "")


def describe_swapped(a: EngineActivity) -> str:
    if a.swapped_out_blocks is None or a.swapped_in_blocks is None or a.swapped_bytes is None:
        return NOT_EXPORTED
    return f"{a.swapped_out_blocks} / {a.swapped_in_blocks} ({a.swapped_bytes / 2**20:.1f} MiB)"


def describe_size(size: TargetSize) -> str:
    kv = (
        f"KV cache {size.kv_tokens:,} tokens ({CACHE_CONFIG_SERIES})"
        if size.kv_tokens is not None
        else f"KV cache size not exported by this server ({CACHE_CONFIG_SERIES})"
    )
    if size.capacity_rps is None:
        return kv
    return (
        f"{kv}; capacity {size.capacity_rps:.2f} req/s, {size.output_tokens_per_s:.0f} output tok/s "
        f"at {size.concurrency} streams ({size.num_requests} requests)"
    )


def _activity(verdict: Verdict) -> Section:
    a = verdict.activity
    rows = [
        ("preemptions", describe_preemptions(a)),
        ("KV blocks swapped out / in", describe_swapped(a)),
        ("tokens recomputed after preemption", shown_if_exported(a.recomputed_tokens)),
        ("failed steps (backed off)", shown_if_exported(a.failed_steps)),
        ("finished by reason", ", ".join(f"{k} {v}" for k, v in a.finished_by_reason.items() if v) or "-"),
        ("refused before start", shown_if_exported(a.rejected_by_reason, lambda by: _counts(by) or "0")),
    ]
    return Section("The server during the load (from /metrics)", ("", "value"), rows, [None] * len(rows))


def _slos(verdict: Verdict) -> Section:
    rows, marks = [], []
    for result in verdict.slos:
        slo = result.slo
        if not result.exposed:
            measured, outcome = "-", f"not measured: {result.why_unmeasured}"
        elif result.value is None:
            measured, outcome = "-", "no events"
        else:
            outcome = "met" if result.met else "MISSED"
            if slo.kind == "events":
                measured = f"{result.value:.2%} ({result.good:.0f} of {result.total:.0f})"
            elif result.seconds_over is not None:
                measured = f"peak {result.value:.0%}, above {slo.threshold:.0%} for {result.seconds_over:.0f} s"
            else:
                measured = f"{result.value:.2f} /s"
        burn = "-" if result.burn_rate is None else f"{result.burn_rate:.1f}x"
        rows.append((slo.title, _objective(slo), measured, burn, outcome))
        marks.append(result.met)
    return Section(
        f"SLOs over the load (profile {verdict.slo_profile}, from /metrics: what the SLO dashboard shows for these "
        "minutes; the steady state decides the verdict)",
        ("SLO", "objective", "during the load", "burn rate", "result"),
        rows,
        marks,
    )


def _objective(slo: Slo) -> str:
    if slo.kind == "events":
        within = f" within {slo.threshold:g} s" if slo.histogram else ""
        return f">= {slo.objective:.2%}{within}"
    if slo.rate_of is not None:
        return f"<= {slo.threshold:g} /s"
    return f"<= {slo.threshold:.0%} (for under {GUARDRAIL_FOR_S} s)"


def _timeline(verdict: Verdict) -> Section:
    rows = [(window.name, f"{window.end_unix - window.start_unix:.1f} s") for window in verdict.fault_windows]
    if verdict.fault_windows:
        recovery = "not within the load" if verdict.recovery_s is None else _seconds(verdict.recovery_s)
        rows.append(("time to recover (last fault off -> backlog back to its pre-fault level)", recovery))
    if verdict.load_phases is not None:
        for stat in ("p50", "p99"):
            cells = " / ".join(_ms(p.ttft.stat(stat)) if p.ttft else "-" for p in verdict.load_phases)
            rows.append((f"TTFT {stat} of the load's requests sent before / during / after the faults", cells))
        if any(p.reuse and p.reuse.measured_fraction is not None for p in verdict.load_phases):
            cached = " / ".join(
                "-" if p.reuse is None or p.reuse.measured_fraction is None else f"{p.reuse.measured_fraction:.0%}"
                for p in verdict.load_phases
            )
            rows.append(("the load's prompt tokens served from the cache (its usage) before / during / after", cached))
    if verdict.prefix_cache is not None:
        phases = (verdict.prefix_cache.before, verdict.prefix_cache.during, verdict.prefix_cache.after)
        rates = " / ".join("-" if p.hit_rate is None else f"{p.hit_rate:.0%}" for p in phases)
        rows.append(("server's prefix cache hit rate before / during / after (all its traffic, prompt tokens)", rates))
        computed = " / ".join(
            "-" if p.computed_tokens_per_s is None else f"{p.computed_tokens_per_s:.0f}" for p in phases
        )
        rows.append(("prompt tokens computed per second before / during / after (looked up, not cached)", computed))
        recovery = verdict.prefix_cache.hit_rate_recovery_s
        rows.append(
            (
                f"hit rate back to {RECOVERED_SHARE:.0%} of its rate before (last fault off -> over "
                f"{RECOVERY_WINDOW_S:g} s)",
                "not within the load" if recovery is None else _seconds(recovery),
            )
        )
    rows += [("restart: time to ready", _seconds(ready_s)) for ready_s in verdict.restarts_s]
    if not rows:
        rows.append(("no fault was injected", "-"))
    return Section("Faults and recovery", ("", "duration"), rows, [None] * len(rows))


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):  # as the expectations write them
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def _ms(value: float) -> str:
    return f"{value * 1e3:.0f} ms"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"
