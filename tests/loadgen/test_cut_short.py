"""A run that stops for any reason still writes its results, with every request that ended, and says it was cut
short: Ctrl-C on ``kvstorm bench serve`` (one process or several), a load worker killed, a failure of the client
on one request (that request's record, not the run's end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadgen.client import StreamingClient
from loadgen.records import Outcome
from loadgen.results import RunResult
from loadgen.runner import run_event_loop, run_open_loop
from loadgen.workloads import PlannedRequest
from tests.loadgen.conftest import child_env, scripted_server
from tests.loadgen.test_workers import _spawned_children

# 100 requests at 10/s, each streaming for about 2 s: a run of 12 s that the tests stop after 3.
LOAD_ARGS = ("--arrival", "constant:rate=10", "--num-requests", "100", "--output-len", "fixed:40")
SLOW_STREAMS = ("--ttft-ms", "100", "--gap-ms", "50")


def _start_bench_serve(base_url: str, results_dir: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", base_url, "--model", "m"]
    # The run is sent Ctrl-C: a shell that starts the tests in the background has them ignore SIGINT, which a child
    # would inherit through exec (a handler is reset to the default there, an ignored signal stays ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [*command, "--results-dir", str(results_dir), "--no-progress", *LOAD_ARGS, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_until_received(server, process: subprocess.Popen, num_requests: int) -> None:
    """Until the server has received ``num_requests`` (the run is well under way: the earliest have ended)."""
    deadline = time.monotonic() + 60
    while len(server.script_log()) < num_requests:
        assert process.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.1)


def _cut_run(process: subprocess.Popen, results_dir: Path) -> tuple[RunResult, str]:
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr[-2000:]
    assert "Traceback" not in stderr
    assert "failed: the run was cut short" in stderr
    (json_path,) = results_dir.glob("*.json")
    (html_path,) = results_dir.glob("*.html")
    assert html_path.stat().st_size > 0
    return RunResult.read(json_path), stdout


def test_ctrl_c_writes_every_record_that_ended_and_says_the_run_was_cut_short(tmp_path):
    with scripted_server(*SLOW_STREAMS) as server:
        process = _start_bench_serve(server.base_url, tmp_path)
        _wait_until_received(server, process, 30)
        process.send_signal(signal.SIGINT)
        result, stdout = _cut_run(process, tmp_path)
    assert result.cut_short is not None
    assert "the run was stopped after" in result.cut_short
    assert "in flight were cut" in result.cut_short
    assert 1 <= len(result.records) < 100
    assert {r.outcome for r in result.records} == {Outcome.OK}
    assert "CUT SHORT" in stdout


def test_ctrl_c_on_a_run_from_worker_processes_keeps_what_each_sent(tmp_path):
    with scripted_server(*SLOW_STREAMS) as server:
        process = _start_bench_serve(server.base_url, tmp_path, "--workers", "2")
        _wait_until_received(server, process, 30)
        workers = _spawned_children(process.pid)
        process.send_signal(signal.SIGINT)
        result, _ = _cut_run(process, tmp_path)
    assert "the run was interrupted" in (result.cut_short or "")
    assert {r.index % 2 for r in result.records} == {0, 1}, "records of both workers' shards"
    assert {r.outcome for r in result.records} == {Outcome.OK}
    assert len(workers) == 2
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers), "every worker stopped"


def test_a_killed_worker_does_not_lose_the_run(tmp_path):
    with scripted_server(*SLOW_STREAMS) as server:
        process = _start_bench_serve(server.base_url, tmp_path, "--workers", "2")
        _wait_until_received(server, process, 30)
        os.kill(min(_spawned_children(process.pid)), signal.SIGKILL)
        result, _ = _cut_run(process, tmp_path)
    assert "ended with exit code -9" in (result.cut_short or "")
    survivor = {r.index % 2 for r in result.records if r.index >= 60}
    assert len(survivor) == 1, "the other worker sent its shard to the end"
    assert sum(1 for r in result.records if r.index % 2 in survivor) == 50
    assert sum(1 for r in result.records if r.index % 2 not in survivor) >= 1, "the killed worker's early records"


def test_a_failure_of_the_client_on_one_request_is_that_requests_record():
    """A body the client cannot encode (a caller's extra_body holding a Python object) fails each request on this
    side: every request still ends as one record that says so, and the run ends normally."""
    plan = [
        PlannedRequest(index=i, offset_s=0.01 * i, path="/v1/completions", body={"prompt": "p"}, max_tokens=2)
        for i in range(3)
    ]

    async def run():
        client = StreamingClient(
            "http://127.0.0.1:9", "m", request_timeout_s=2, stall_timeout_s=1, extra_body={"x": object()}
        )
        async with client:
            return await run_open_loop(plan, client)

    records, _ = run_event_loop(run())
    assert [r.index for r in records] == [0, 1, 2]
    assert {r.outcome for r in records} == {Outcome.REJECTED}
    assert all("the client failed on this request: TypeError" in r.error for r in records)
