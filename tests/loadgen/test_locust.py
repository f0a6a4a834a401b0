"""The Locust front, run as users run it: headless, distributed (master + worker) and from the web UI, each in its
own processes (gevent's monkey-patching never enters the pytest process), for seconds against the scripted server."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from chaos.injectors.processes import free_port
from tests.loadgen.conftest import REPO_ROOT, child_env, scripted_server

LOCUSTFILE = str(REPO_ROOT / "loadgen" / "locustfile.py")
OPTIONS = ["--headless", "--model", "m", "--output-len", "fixed:10", "--stall-timeout", "1s", "--request-timeout", "3s"]


def locust(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", LOCUSTFILE, *args],
        cwd=cwd,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_stats(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv") as file:
        return {row["Type"]: row for row in csv.DictReader(file)}


def check_stats(stats: dict[str, dict[str, str]]) -> None:
    assert {"TTFT", "ITL", "E2E", "POST"} <= set(stats)
    ttft, itl, e2e = stats["TTFT"], stats["ITL"], stats["E2E"]
    assert int(ttft["Request Count"]) >= 10
    assert 140 <= float(ttft["50%"]) <= 250  # scripted 150 ms
    assert int(itl["Request Count"]) >= 9 * int(ttft["Request Count"]) - 9 * 10  # 9 gaps per 10-token stream
    assert 15 <= float(itl["50%"]) <= 40  # scripted 20 ms
    assert 300 <= float(e2e["50%"]) <= 450  # 150 + 9 x 20 = 330 ms
    # The mixed fault plan breaks some streams: they are E2E failures; rejections are failures of the POST.
    assert int(e2e["Failure Count"]) >= 1
    assert int(stats["POST"]["Failure Count"]) > int(e2e["Failure Count"])


def test_headless_run_reports_ttft_itl_e2e_and_bursts(tmp_path):
    with scripted_server("--fault-plan", "mixed") as server:
        process = locust(
            *OPTIONS, "--host", server.base_url, "-u", "8", "-t", "5s", "--csv", str(tmp_path / "run"),
            "--shape", "spike:base=4,peak=8,at_s=2,spike_s=2,spawn_rate=8", cwd=tmp_path,
        )  # fmt: skip
        output, _ = process.communicate(timeout=60)
    assert process.returncode in (0, 1), output  # 1: some requests failed, as the fault plan intends
    assert "Shape test updating to 8 users" in output
    check_stats(read_stats(tmp_path / "run"))


def test_distributed_master_and_worker(tmp_path):
    port = free_port()
    with scripted_server("--fault-plan", "mixed") as server:
        master = locust(
            *OPTIONS, "--host", server.base_url, "-u", "8", "-t", "5s", "--csv", str(tmp_path / "dist"),
            "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port), "--expect-workers", "1",
            cwd=tmp_path,
        )  # fmt: skip
        worker = locust("--worker", "--master-host", "127.0.0.1", "--master-port", str(port), cwd=tmp_path)
        try:
            output, _ = master.communicate(timeout=60)
            worker.communicate(timeout=30)
        finally:
            for process in (master, worker):
                if process.poll() is None:
                    process.kill()
                    process.wait()
    assert master.returncode in (0, 1), output
    assert "to 1 ready workers" in output  # the load ran on the worker
    check_stats(read_stats(tmp_path / "dist"))


def test_web_ui_swarm_shows_the_stream_request_types(tmp_path):
    web_port = free_port()
    with scripted_server() as server:
        process = locust(
            "--host", server.base_url, "--model", "m", "--output-len", "fixed:10", "--web-host", "127.0.0.1",
            "--web-port", str(web_port), cwd=tmp_path,
        )  # fmt: skip
        try:
            ui = f"http://127.0.0.1:{web_port}"
            _wait_for(lambda: urllib.request.urlopen(ui, timeout=1).status == 200)
            form = urllib.parse.urlencode({"user_count": 4, "spawn_rate": 4, "host": server.base_url}).encode()
            started = json.load(urllib.request.urlopen(f"{ui}/swarm", data=form, timeout=5))
            assert started["success"], started

            def counts() -> dict[str, int]:
                stats = json.load(urllib.request.urlopen(f"{ui}/stats/requests", timeout=5))["stats"]
                return {row["method"]: row["num_requests"] for row in stats}

            _wait_for(lambda: counts().get("TTFT", 0) >= 4 and counts().get("ITL", 0) >= 36)
            assert counts().get("E2E", 0) >= 4
        finally:
            process.terminate()
            process.communicate(timeout=30)


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.2)
