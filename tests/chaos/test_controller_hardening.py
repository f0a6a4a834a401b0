"""The chaos controller tried as an attacker would, over real HTTP, as its own process: nothing a request carries is
executed, resolved from the environment or read outside the operator's data directory; every value is bounded; the
token is checked before a body is parsed and a body is bounded; a run that cannot start frees the slot; results are
written whole or not at all. No engine is needed: every request here is refused, or fails, before a run starts."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import yaml
from rich.console import Console

from chaos.actions import run_load
from chaos.controller.parameters import OPERATOR_PARAMETERS, RESERVED_PARAMETERS, SCHEMAS, check_overrides
from chaos.controller.runs import load_library, variable_args
from chaos.injectors.processes import ManagedServer, free_port
from chaos.judgement.verdict import Verdict
from chaos.run.runner import EXPERIMENTS_DIR, _write_results
from chaos.run.sizing import TargetSize
from chaos.run.state import reset
from kvstorm.chaos_commands import chaos_run_variables
from kvstorm.cli import build_parser
from loadgen.plan import PlanTooLarge
from loadgen.results import replacing, write_text_atomic
from tests.chaos.test_experiments import SHORT

TOKEN = "hardening-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WRONG = {"Authorization": "Bearer wrong"}


@contextmanager
def controller(workdir: Path, results_dir: Path, *options: str) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A target nobody serves: every request here is refused or fails before a run would reach it.
    command = ["kvstorm", "chaos", "serve", "--target", f"http://127.0.0.1:{free_port()}", "--port", str(port),
               "--model", "unused", "--results-dir", str(results_dir), "--max-run-s", "60", *options]  # fmt: skip
    env = {"KVSTORM_CHAOS_TOKEN": TOKEN, "KVSTORM_ADMIN_TOKEN": "engine-token-not-used-here"}
    process = ManagedServer(command, f"{url}/health", workdir / "controller.log", env=env)
    process.start()
    try:
        yield url
    finally:
        process.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """No data directory, no server command: the defaults."""
    workdir = tmp_path_factory.mktemp("plain")
    with controller(workdir, workdir / "results") as url:
        yield url, workdir


@pytest.fixture(scope="module")
def with_data(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A data directory; the results directory under a regular file, so no run's folder can be made (the tests run
    as root: permissions would not stop it)."""
    workdir = tmp_path_factory.mktemp("with-data")
    data = workdir / "data"
    data.mkdir()
    (data / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    (data / "trace.jsonl").write_text('{"timestamp": 0, "prompt_len": 300, "output_len": 20}\n')
    (workdir / "elsewhere.jsonl").write_text('{"prompt": "secret"}\n')
    (data / "link.jsonl").symlink_to(workdir / "elsewhere.jsonl")
    (workdir / "not-a-directory").write_text("")
    with controller(workdir, workdir / "not-a-directory" / "results", "--data-dir", str(data)) as url:
        yield url, workdir


def post_run(url: str, experiment: str = "burst-with-vram-cap", headers: dict = AUTH, **overrides) -> requests.Response:
    return requests.post(f"{url}/runs", json={"experiment": experiment, "overrides": overrides}, headers=headers,
                         timeout=30)  # fmt: skip


def refused(response: requests.Response, parameter: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["parameter"] == parameter, body
    for word in words:
        assert word in body["reason"], body


def assert_nothing_ran(url: str, results_dir: Path) -> None:
    assert requests.get(f"{url}/runs", headers=AUTH, timeout=30).json() == []
    assert not results_dir.exists() or not any(results_dir.iterdir()), "no run's folder"


def test_a_command_or_a_value_from_the_environment_is_refused_and_runs_nothing(plain):
    url, workdir = plain
    marker = workdir / "pwned.txt"
    attack = post_run(url, "kill-and-restart", server_command=f'sh -c "env > {marker}"')
    refused(attack, "server_command", "--server-command")
    # Without the operator's command, the experiment that needs one does not run either.
    refused(post_run(url, "kill-and-restart"), "server_command", "--server-command")
    env_value = {"type": "env", "key": "KVSTORM_CHAOS_TOKEN"}
    refused(post_run(url, duration_s=env_value), "duration_s", "no object")
    refused(post_run(url, workload=env_value), "workload", "no object")
    refused(post_run(url, arrival=["poisson:rate=1"]), "arrival", "no object")
    refused(post_run(url, arrival="poisson:rate=${server_command}"), "arrival")
    refused(post_run(url, target_url="http://elsewhere"), "target_url", "reserved")
    refused(post_run(url, faults_url="http://elsewhere"), "faults_url", "reserved")  # where the admin token would go
    time.sleep(1.0)  # what a started child would have had time to do
    assert not marker.exists()
    assert_nothing_ran(url, workdir / "results")


def test_files_resolve_only_under_the_operator_data_directory(plain, with_data):
    url, workdir = plain
    refused(post_run(url, workload="jsonl:path=/etc/passwd"), "workload", "--data-dir")
    refused(post_run(url, arrival="trace:path=/etc/passwd"), "arrival", "--data-dir")
    assert_nothing_ran(url, workdir / "results")

    url, workdir = with_data
    refused(post_run(url, workload="jsonl:path=/etc/passwd"), "workload", "relative to the data directory")
    refused(post_run(url, workload="jsonl:path=../elsewhere.jsonl"), "workload", "no '..'")
    refused(post_run(url, workload="jsonl:path=link.jsonl"), "workload", "no file")
    refused(post_run(url, arrival="trace:path=/etc/passwd"), "arrival", "relative to the data directory")
    # A trace's lengths scaled up to 100 times say how long a request may become.
    refused(post_run(url, arrival="trace:path=trace.jsonl,length_scale=100"), "arrival", "needs max_len")
    assert requests.get(f"{url}/runs", headers=AUTH, timeout=30).json() == []


def test_rates_lengths_and_durations_are_bounded(plain):
    url, workdir = plain
    refused(post_run(url, arrival="poisson:rate=1e9"), "arrival", "200")
    refused(post_run(url, arrival="onoff:base=1,burst=1e6,burst_s=5,period_s=30"), "arrival", "200")
    refused(post_run(url, arrival="poisson:rate=inf"), "arrival")
    refused(post_run(url, duration_s=1e9), "duration_s", "3600")
    refused(post_run(url, output_len="fixed:100000000"), "output_len", "32768")
    refused(post_run(url, cap_fraction=2), "cap_fraction", "[0, 1]")
    refused(post_run(url, baseline_requests=True), "baseline_requests", "number")
    refused(post_run(url, workload="multiturn:turns=100000"), "workload", "[1, 64]")
    refused(post_run(url, workload="shared-prefix:num_prefixes=2,prefix_len=1e9"), "workload", "32768")
    refused(post_run(url, workload="multiturn:turns=2,command=ls"), "workload", "unknown key")
    refused(post_run(url, workload="chat:x=1"), "workload", "no settings")
    refused(post_run(url, arrival="trace:path=t.csv,max_len=1e9"), "arrival", "32768")
    refused(post_run(url, arrival="trace:path=t.csv,format=../x"), "arrival", "format")
    assert_nothing_ran(url, workdir / "results")
    library = {e["name"]: e for e in requests.get(f"{url}/experiments", headers=AUTH, timeout=30).json()}
    assert library["burst-with-vram-cap"]["schema"]["arrival"]["max_rate"] == 200
    assert "server_command" not in library["kill-and-restart"]["parameters"]
    assert library["kill-and-restart"]["operator_parameters"] == ["server_command"]


def test_a_plan_is_bounded_by_its_product_not_only_by_each_value(plain):
    url, workdir = plain
    main_load = "arrival, duration_s, workload, input_len, output_len"
    # The two: about 13 GB of prefixes, and 720,000 requests of 32,768 tokens; each value within its bound.
    prefixes = post_run(url, workload="shared-prefix:num_prefixes=10000,prefix_len=32768")
    refused(prefixes, main_load, "10,000 prefixes x 32,768 tokens", "100,000,000 tokens", "MAX_PLAN_TOKENS")
    hour = post_run(url, arrival="poisson:rate=200", duration_s=3600, input_len="fixed:32768")
    refused(hour, main_load, "720,001 requests x (32,768 prompt", "100,000,000 tokens")
    flood = post_run(url, "prefix-cache-thrash", flood_arrival="poisson:rate=200", flood_for_s=3600,
                     flood_input_len="fixed:32768")  # fmt: skip
    refused(flood, "flood_arrival, flood_for_s, flood_input_len, flood_output_len", "720,001 requests")
    # A lognormal's tail is clipped at its max, and the max is bounded as every length is.
    refused(post_run(url, output_len="lognormal:median=100,sigma=1,max=100000"), "output_len", "32768")
    assert_nothing_ran(url, workdir / "results")


def test_a_load_sized_from_the_server_is_bounded_by_the_run_once_the_size_is_known():
    """A burst in multiples of the measured capacity: the controller sees 0.5 x capacity for an hour (1,801 requests
    at 1 request/s), the run a server measured at 20 requests/s (as ``measure_target`` records it), 36,001
    requests of 8,256 tokens. The load is refused before it is built or sends anything (no server listens here)."""
    burst = load_library()["burst-at-2x-capacity"]
    load = {"arrival": "poisson:rate=0.5", "duration_s": 3600, "input_len": "fixed:8192", "output_len": "fixed:64"}
    assert check_overrides(burst.name, burst.parameters, load, None) == load
    reset().target_size = TargetSize(kv_tokens=1_000_000, capacity_rps=20.0)
    with pytest.raises(PlanTooLarge, match=r"36,001 requests x \(8,192 prompt \+ 64 output tokens\)"):
        run_load(f"http://127.0.0.1:{free_port()}", "m", rate_unit="capacity", **load)


def test_overrides_reach_the_run_as_the_types_they_were_checked_as():
    """The controller's child command line, read by ``kvstorm chaos run``'s own parser: a float that YAML reads as
    a string (1e-05, which the engine then refuses) stays a float, an int an int, a string a string."""
    swap = load_library()["swap-pressure-slow-host-link"]
    overrides = {"swap_delay_per_block": 1e-05, "duration_s": 30, "faults_for_s": 2.5, "arrival": "poisson:rate=1"}
    variables = check_overrides(swap.name, swap.parameters, overrides, None)
    argv = ["chaos", "run", str(swap.path), *variable_args(variables)]
    received = chaos_run_variables(build_parser(argv).parse_args(argv))
    assert received == variables == overrides
    assert [type(received[key]) for key in overrides] == [float, int, float, str]
    assert yaml.safe_load("1e-05") == "1e-05", "what the child read before: its --var values are YAML"


def test_the_token_is_checked_before_the_body_and_the_body_is_bounded(plain):
    url, workdir = plain
    big = {"experiment": "burst-with-vram-cap", "overrides": {"workload": "x" * 100_000}}
    assert requests.post(f"{url}/runs", json=big, headers=AUTH, timeout=30).status_code == 413
    assert requests.post(f"{url}/runs", json=big, headers=WRONG, timeout=30).status_code == 401
    assert requests.post(f"{url}/runs", json=big, timeout=30).status_code == 401
    # A malformed body without the token is never parsed: 401, not 422.
    garbage = requests.post(f"{url}/runs", data=b"{not json", headers={**WRONG, "Content-Type": "application/json"},
                            timeout=30)  # fmt: skip
    assert garbage.status_code == 401

    def chunks() -> Iterator[bytes]:
        yield b'{"experiment": "burst-with-vram-cap", "overrides": {"workload": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}}'

    chunked = requests.post(f"{url}/runs", data=chunks(), headers={**AUTH, "Content-Type": "application/json"},
                            timeout=30)  # fmt: skip
    assert chunked.status_code == 413
    assert_nothing_ran(url, workdir / "results")
    assert requests.get(f"{url}/health", timeout=30).status_code == 200


def test_a_run_that_cannot_start_is_an_error_and_frees_the_slot(with_data):
    url, _ = with_data
    # A file under the data directory is taken (resolved there); the run then fails to make its folder.
    first = post_run(url, workload="jsonl:path=prompts.jsonl", **SHORT)
    assert first.status_code == 500, first.text
    assert "did not start" in first.json()["detail"]
    (run,) = requests.get(f"{url}/runs", headers=AUTH, timeout=30).json()
    assert run["status"] == "error"
    assert run["ended_unix"] is not None
    assert "did not start" in run["error"]
    second = post_run(url, **SHORT)
    assert second.status_code == 500, "the slot is free: the next start is tried, not refused with a 409"
    assert [r["status"] for r in requests.get(f"{url}/runs", headers=AUTH, timeout=30).json()] == ["error", "error"]


def test_every_library_parameter_has_a_schema_and_its_defaults_pass_it():
    library = load_library()
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        configuration = yaml.safe_load(path.read_text())["configuration"]
        uncovered = set(configuration) - set(SCHEMAS) - set(RESERVED_PARAMETERS) - set(OPERATOR_PARAMETERS)
        assert not uncovered, f"{path.name}: no schema for {sorted(uncovered)}"
        parameters = library[path.stem].parameters
        assert check_overrides(path.stem, parameters, parameters, None) == parameters
    vram = library["burst-with-vram-cap"].parameters
    assert check_overrides("burst-with-vram-cap", vram, SHORT, None) == SHORT


def write_half_then_die(path: Path) -> None:
    with replacing(path) as temporary:
        temporary.write_text("half of the sec")
        raise RuntimeError("the writer died midway")


def test_the_atomic_writer_leaves_the_old_file_or_the_whole_new_one(tmp_path):
    path = tmp_path / "verdict.md"
    write_text_atomic(path, "first\n")
    with pytest.raises(RuntimeError, match="midway"):
        write_half_then_die(path)
    assert path.read_text() == "first\n"
    write_text_atomic(path, "second\n")
    assert path.read_text() == "second\n"
    assert [p.name for p in tmp_path.iterdir()] == ["verdict.md"], "no temporary file left behind"
    with pytest.raises(NotADirectoryError):
        write_text_atomic(tmp_path / "verdict.md" / "inside-a-file", "x")
    assert [p.name for p in tmp_path.iterdir()] == ["verdict.md"]


def test_results_that_cannot_be_written_are_named_not_raised(tmp_path):
    """The verdict event carries what _write_results returns: a results folder that cannot be written costs the run
    its files, never its verdict."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    verdict = Verdict(title="t", status="held", reason="every steady-state check was met", checks=[])
    error = _write_results(
        verdict, {"status": "completed"}, reset(), blocker / "run", None, Console(file=io.StringIO())
    )
    assert error is not None
    assert "results not written" in error
    assert "NotADirectoryError" in error
    written = tmp_path / "run"
    written.mkdir()
    assert _write_results(verdict, {"status": "completed"}, reset(), written, None, Console(file=io.StringIO())) is None
    assert "HELD" in (written / "verdict.md").read_text()
    assert "HELD" in (written / "report.html").read_text()
