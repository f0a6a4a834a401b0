"""The Locust front, run as users run it: headless, distributed (master + worker) and from the web UI, each in its
own processes (gevent's monkey-patching never enters the pytest process), for seconds against the scripted server."""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import requests

from chaos.injectors.processes import free_port
from loadgen.plan import plan_run
from loadgen.records import Outcome
from loadgen.results import RunResult
from loadgen.scripted_server import EXPECTED_OUTCOME
from loadgen.web_login import PASSWORD_ENV, PUBLISHED_ON_ENV
from tests.loadgen.conftest import REPO_ROOT, child_env, scripted_server

LOCUSTFILE = str(REPO_ROOT / "loadgen" / "locustfile.py")
OPTIONS = ["--headless", "--model", "m", "--output-len", "fixed:10", "--stall-timeout", "1s", "--request-timeout", "3s"]


def locust(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", LOCUSTFILE, *args],
        cwd=cwd,
        env=child_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_stats(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv") as file:
        return {row["Type"]: row for row in csv.DictReader(file)}


def read_rows(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    """The stats CSV's rows by type and name (a conversation's TTFT has one row per turn)."""
    with open(f"{prefix}_stats.csv") as file:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(file)}


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


def test_without_a_model_each_user_asks_the_host_and_one_that_lists_none_is_a_failure(tmp_path):
    """No --model: a user asks the host's /v1/models (compose's stack, pointed at a URL alone). The scripted server
    lists none: each user reports that as a failure in the stats and stops, sending nothing under a guessed name (a
    real server's list: tests/test_compose.py's stack)."""
    with scripted_server() as server:
        process = locust(
            "--headless", "--host", server.base_url, "-u", "2", "-t", "3s", "--csv", str(tmp_path / "run"), cwd=tmp_path
        )
        output, _ = process.communicate(timeout=60)
    rows = read_rows(tmp_path / "run")
    assert int(rows[("GET", "/v1/models")]["Failure Count"]) >= 2, output  # the shape spawns stopped users anew
    assert not [row for row in rows if row[0] in ("POST", "TTFT")], "nothing sent"


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


def test_conversation_users_report_ttft_by_turn_and_send_the_conversation_back(tmp_path):
    # Words stand in for tokens at the scripted server: a 30-word system prompt, 12-word user messages, and answers
    # of 10 words (" t0" ... " t9").
    system_words, user_words, answer_words, num_turns = 30, 12, 10, 3
    workload = f"multiturn:turns={num_turns},system_len=40,think_s=0.1"
    with scripted_server("--fault-plan", "mixed") as server:
        process = locust(
            *OPTIONS, "--host", server.base_url, "-u", "1", "-t", "6s", "--csv", str(tmp_path / "run"),
            "--workload", workload, "--input-len", "fixed:16", cwd=tmp_path,
        )  # fmt: skip
        output, _ = process.communicate(timeout=60)
        log = sorted(server.script_log().values(), key=lambda entry: entry["order"])
    assert process.returncode in (0, 1), output  # 1: the fault plan breaks or refuses some turns
    assert '"ConversationUser": 1' in output  # the class --workload calls for
    rows = read_rows(tmp_path / "run")
    ttft_counts = [int(rows[("TTFT", f"turn {turn}")]["Request Count"]) for turn in range(1, num_turns + 1)]
    # A turn is sent only after the one before it ended ok; the broken and the refused turns cut conversations short.
    assert ttft_counts == sorted(ttft_counts, reverse=True), ttft_counts
    assert ttft_counts[0] > ttft_counts[-1] >= 1, ttft_counts
    sessions = rows[("SESSION", "conversation")]
    assert int(sessions["Failure Count"]) >= 1
    assert int(sessions["Request Count"]) > int(sessions["Failure Count"])

    # One user: the server saw the turns in order. Each turn sends the one before it, its answer and a new message;
    # a conversation starts over after its last turn or a turn that did not end ok.
    first_turn_words = system_words + user_words
    last_turn_words = first_turn_words + (num_turns - 1) * (answer_words + user_words)
    expected, previous = [], None
    for entry in log:
        goes_on = (
            previous is not None
            and EXPECTED_OUTCOME[previous["fault"]] is Outcome.OK
            and previous["prompt_tokens"] < last_turn_words
        )
        expected.append(previous["prompt_tokens"] + answer_words + user_words if goes_on else first_turn_words)
        previous = entry
    assert [entry["prompt_tokens"] for entry in log] == expected
    assert last_turn_words in expected
    second_turn = next(entry for entry in log if entry["prompt_tokens"] == first_turn_words + answer_words + user_words)
    answer = second_turn["prompt_head"][first_turn_words : first_turn_words + answer_words]
    assert answer == [f"t{position}" for position in range(answer_words)]  # the answer as it streamed


def test_shared_prefix_users_share_the_prefixes_not_the_suffixes(tmp_path):
    prefix_len = 16
    with scripted_server() as server:
        process = locust(
            *OPTIONS, "--host", server.base_url, "-u", "2", "-r", "2", "-t", "3s",
            "--workload", f"shared-prefix:num_prefixes=1,prefix_len={prefix_len}", "--input-len", "fixed:8",
            cwd=tmp_path,
        )  # fmt: skip
        output, _ = process.communicate(timeout=60)
        log = sorted(server.script_log().values(), key=lambda entry: entry["received_ts"])
    assert process.returncode == 0, output
    assert '"SharedPrefixUser": 2' in output
    assert {entry["prompt_tokens"] for entry in log} == {prefix_len + 8}
    # A user sends its next request after its stream ended (150 + 9 x 20 ms): two requests closer than that in time
    # come from the two users.
    pairs = [(a, b) for a, b in itertools.pairwise(log) if b["received_ts"] - a["received_ts"] < 0.2]
    assert pairs
    for earlier, later in pairs:
        assert earlier["prompt_head"][:prefix_len] == later["prompt_head"][:prefix_len]
    assert len({tuple(entry["prompt_head"][:prefix_len]) for entry in log}) == 1
    assert len({tuple(entry["prompt_head"]) for entry in log}) == len(log)  # suffixes of their own


def test_web_ui_class_picker_runs_the_ticked_class(tmp_path):
    web_port = free_port()
    with scripted_server() as server:
        process = locust(
            "--host", server.base_url, "--model", "m", "--output-len", "fixed:10", "--input-len", "fixed:8",
            "--conversation", "multiturn:turns=2,system_len=20", "--class-picker", "--web-host", "127.0.0.1",
            "--web-port", str(web_port), cwd=tmp_path,
        )  # fmt: skip
        try:
            ui = f"http://127.0.0.1:{web_port}"
            _wait_for(lambda: urllib.request.urlopen(ui, timeout=1).status == 200)
            form = {"user_count": 2, "spawn_rate": 2, "host": server.base_url, "user_classes": "ConversationUser"}
            started = json.load(urllib.request.urlopen(f"{ui}/swarm", data=urllib.parse.urlencode(form).encode()))
            assert started["success"], started

            def counts() -> dict[tuple[str, str], int]:
                stats = json.load(urllib.request.urlopen(f"{ui}/stats/requests", timeout=5))["stats"]
                return {(row["method"], row["name"]): row["num_requests"] for row in stats}

            _wait_for(lambda: counts().get(("SESSION", "conversation"), 0) >= 2)
            assert counts().get(("TTFT", "turn 2"), 0) >= 2
            assert not [key for key in counts() if key[0] == "TTFT" and not key[1].startswith("turn ")]
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


def test_an_open_loop_plan_sharded_over_two_workers_comes_back_as_one_run(tmp_path):
    port = free_port()
    results = tmp_path / "results"
    with scripted_server() as server:
        master = locust(
            *OPTIONS, "--host", server.base_url, "--arrival", "poisson:rate=30", "--num-requests", "60",
            "--workload", "random", "--input-len", "fixed:32", "-u", "2", "-r", "2", "-t", "60s", "--master",
            "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port), "--expect-workers", "2",
            "--results-dir", str(results), cwd=tmp_path,
        )  # fmt: skip
        workers = [
            locust("--worker", "--master-host", "127.0.0.1", "--master-port", str(port), cwd=tmp_path) for _ in range(2)
        ]
        try:
            output, _ = master.communicate(timeout=90)
            for worker in workers:
                worker.communicate(timeout=30)
        finally:
            for process in (master, *workers):
                if process.poll() is None:
                    process.kill()
                    process.wait()
    assert master.returncode == 0, output
    # Each worker sent its own half of the plan (requests i mod 2), and the master merged them into one run.
    assert "shard 0 of 2 sent 30 records" in output
    assert "shard 1 of 2 sent 30 records" in output
    run = RunResult.read(next(results.glob("locust-*.json")))
    planned = plan_run(run.config).requests
    assert [r.index for r in run.records] == [p.index for p in planned]
    assert [r.scheduled_s for r in run.records] == [p.offset_s for p in planned]
    assert run.config.workers == 2
    assert run.config.arrival == "poisson:rate=30"
    assert all(r.outcome is Outcome.OK for r in run.records)
    assert all(r.sent_s >= r.scheduled_s - 0.001 for r in run.records), "none sent before its planned instant"
    assert 0.14 <= run.summary.ttft.p50 <= 0.25  # scripted 150 ms
    assert 0.015 <= run.summary.itl.p50 <= 0.04  # scripted 20 ms
    assert "Locust workers" in run.advisories[0]
    assert next(results.glob("locust-*.json")).with_suffix(".html").is_file()


def test_a_locust_user_sends_a_refused_request_again_with_retries(tmp_path):
    """Every tenth request of the mixed plan is answered 429: with --retries each is sent again (0.5 s later: the
    scripted server names no Retry-After) and none ends refused; each refusal stays a failed POST in Locust's table."""
    results = tmp_path / "results"
    with scripted_server("--fault-plan", "mixed") as server:
        process = locust(
            *OPTIONS, "--host", server.base_url, "--arrival", "poisson:rate=30", "--num-requests", "30",
            "--workload", "random", "--input-len", "fixed:32", "-u", "1", "-r", "1", "-t", "60s", "--retries", "3",
            "--results-dir", str(results), "--csv", str(tmp_path / "run"), cwd=tmp_path,
        )  # fmt: skip
        output, _ = process.communicate(timeout=90)
    assert process.returncode in (0, 1), output  # 1: the mixed plan's broken streams fail
    run = RunResult.read(next(results.glob("locust-*.json")))
    assert run.config.retries == 3
    came_back = [r for r in run.records if r.attempts > 1]
    assert len(came_back) >= 2
    assert all(r.ttft_s is None or r.ttft_s >= 0.5 for r in came_back), "its TTFT runs from the first send"
    assert not [r for r in run.records if r.outcome is Outcome.REJECTED], "every refusal was sent again"
    posts = read_stats(tmp_path / "run")["POST"]
    assert int(posts["Failure Count"]) >= len(came_back)


def test_a_retry_count_out_of_bounds_is_refused_before_anything_starts(tmp_path):
    process = locust(*OPTIONS, "--host", "http://127.0.0.1:9", "--retries", "99", "-t", "1s", cwd=tmp_path)
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "--retries must be in 0-10, got 99" in output


# What decides where the web UI binds and whether it asks for a login, none of it taken from the test's own
# environment.
WEB_UI_VARIABLES = (PASSWORD_ENV, PUBLISHED_ON_ENV, "LOCUST_WEB_HOST", "LOCUST_WEB_PORT", "LOCUST_WEB_LOGIN")


def web_ui_env(**variables: str) -> dict[str, str]:
    return {k: v for k, v in child_env().items() if k not in WEB_UI_VARIABLES} | variables


@contextlib.contextmanager
def running(process: subprocess.Popen):
    """``process`` stopped on the way out, whatever happened inside."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            process.communicate(timeout=30)


@pytest.mark.parametrize(
    ("config_file", "variables", "args"),
    [
        ("web-host = 0.0.0.0", {}, []),
        ("", {"LOCUST_WEB_HOST": "0.0.0.0"}, []),
        ("", {}, ["--web-host", "0.0.0.0"]),
        ("web-host = 127.0.0.1", {}, ["--web-host", "*"]),  # the command line over the config file
    ],
    ids=["locust.conf", "environment", "command-line", "command-line-over-locust.conf"],
)
def test_a_web_ui_beyond_loopback_wants_a_password_whatever_set_its_host(tmp_path, config_file, variables, args):
    """The login is decided on the web host Locust finally parsed, whatever set it: without a password Locust refuses
    to start (before its web UI binds)."""
    (tmp_path / "locust.conf").write_text(f"{config_file}\nweb-port = {free_port()}\n")
    process = locust("--host", "http://127.0.0.1:9", "--model", "m", *args, cwd=tmp_path, env=web_ui_env(**variables))
    with running(process):
        output, _ = process.communicate(timeout=60)
    assert process.returncode != 0, output
    assert f"a web host beyond loopback: {'every interface' if '*' in args else '0.0.0.0'}" in output
    assert f"${PASSWORD_ENV} is empty" in output


def test_a_locust_conf_beyond_loopback_puts_the_web_ui_behind_the_login(tmp_path):
    """``web-host = 0.0.0.0`` in locust.conf, reached here on 127.0.0.1: every page but the login answers with a
    redirect to it until the password is given; the command line's ``--web-host 127.0.0.1`` over the same file binds
    loopback only, and no login is asked for."""
    web_port, password = free_port(), "3f9c2d7e8a1b4c6d9e0f1a2b3c4d5e6f"
    (tmp_path / "locust.conf").write_text(f"web-host = 0.0.0.0\nweb-port = {web_port}\n")
    ui = f"http://127.0.0.1:{web_port}"
    common = ("--host", "http://127.0.0.1:9", "--model", "m")
    with running(locust(*common, cwd=tmp_path, env=web_ui_env(**{PASSWORD_ENV: password}))):
        _wait_for(lambda: requests.get(f"{ui}/login", timeout=1).ok)
        assert requests.get(ui, allow_redirects=False, timeout=5).headers["Location"].endswith("/login?next=%2F")
        swarm = requests.post(f"{ui}/swarm", data={"user_count": 1, "spawn_rate": 1}, allow_redirects=False, timeout=5)
        assert swarm.status_code == 302
        session = requests.Session()
        session.post(f"{ui}/kvstorm-login", data={"username": "kvstorm", "password": password}, timeout=5)
        assert session.get(f"{ui}/stats/requests", timeout=5).json()["state"] == "ready"
    with running(locust(*common, "--web-host", "127.0.0.1", cwd=tmp_path, env=web_ui_env())):
        _wait_for(lambda: requests.get(ui, allow_redirects=False, timeout=1).status_code == 200)


def test_swarm_refuses_every_field_but_the_forms_and_applies_none_of_it(tmp_path):
    """An open-loop run whose results go to the operator's folder: /swarm forms that would point the results, the
    workload or the schedule at files (or change an option of Locust's own) are 400s that start nothing; the run the
    form then starts sends the operator's plan and writes only where the operator said."""
    web_port, results, elsewhere = free_port(), tmp_path / "results", tmp_path / "elsewhere"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "kvstorm-marker of a file nobody may read"}) + "\n")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 8, "output_length": 4}) + "\n")
    refused_fields = {
        "results_dir": str(elsewhere),
        "workload": f"jsonl:path={prompts}",
        "arrival": f"trace:path={trace}",
        "html_file": str(elsewhere / "report.html"),
    }
    ui = f"http://127.0.0.1:{web_port}"
    with scripted_server() as server:
        process = locust(
            "--model", "m", "--output-len", "fixed:10", "--host", server.base_url, "--arrival", "poisson:rate=20",
            "--num-requests", "4", "--workload", "random", "--input-len", "fixed:8", "--results-dir", str(results),
            "--web-host", "127.0.0.1", "--web-port", str(web_port), cwd=tmp_path, env=web_ui_env(),
        )  # fmt: skip
        with running(process):
            _wait_for(lambda: requests.get(ui, timeout=1).ok)
            form = {"user_count": 1, "spawn_rate": 1, "host": server.base_url}
            for name, value in refused_fields.items():
                answer = requests.post(f"{ui}/swarm", data={**form, name: value}, timeout=5)
                assert answer.status_code == 400, (name, answer.text)
                assert answer.json()["success"] is False
                assert f"/swarm may not set {name!r}" in answer.json()["message"]
                assert requests.get(f"{ui}/stats/requests", timeout=5).json()["state"] == "ready", name
            assert requests.post(f"{ui}/swarm", data=form, timeout=5).json()["success"]
            _wait_for(lambda: any(results.glob("locust-*.json")), timeout_s=60)
            log = server.script_log()
    run = RunResult.read(next(results.glob("locust-*.json")))
    assert [r.outcome for r in run.records] == [Outcome.OK] * 4
    assert run.config.workload == "random"
    assert run.config.arrival == "poisson:rate=20"
    assert {entry["prompt_tokens"] for entry in log.values()} == {8}
    assert "kvstorm-marker" not in json.dumps(log)
    assert not elsewhere.exists()


def test_user_settings_take_only_what_the_ui_edits(tmp_path):
    """Locust's /user sets any attribute of a user class: here it takes the UI's user settings (host, weight,
    fixed_count, tasks) for a class that exists, typed, and refuses the rest with a 400 that changes nothing."""
    web_port = free_port()
    ui = f"http://127.0.0.1:{web_port}"
    process = locust(
        "--host", "http://127.0.0.1:9", "--model", "m", "--class-picker", "--web-host", "127.0.0.1",
        "--web-port", str(web_port), cwd=tmp_path, env=web_ui_env(),
    )  # fmt: skip
    with running(process):
        _wait_for(lambda: requests.get(ui, timeout=1).ok)
        refused = [
            ({"user_class_name": "StreamingUser", "wait_time": 5}, "/user may not set 'wait_time'"),
            ({"user_class_name": "StreamingUser", "abstract": True}, "/user may not set 'abstract'"),
            ({"user_class_name": "NoSuchUser", "weight": 1}, "user_class_name is one of"),
            ({"user_class_name": "StreamingUser", "weight": "heavy"}, "weight must be a non-negative integer"),
            ({"user_class_name": "StreamingUser", "tasks": [1]}, "tasks must be a list of task names"),
            ([1, 2], "a JSON object"),
        ]
        for settings, message in refused:
            answer = requests.post(f"{ui}/user", json=settings, timeout=5)
            assert answer.status_code == 400, (settings, answer.text)
            assert message in answer.json()["message"]
        accepted = {"user_class_name": "StreamingUser", "weight": 3, "host": "http://127.0.0.1:9"}
        assert requests.post(f"{ui}/user", json=accepted, timeout=5).status_code == 201
        page = requests.get(ui, timeout=5).text
    assert '"weight": 3' in page or '"weight":3' in page
