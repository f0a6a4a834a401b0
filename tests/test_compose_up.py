"""`docker compose up` for real, in a Docker engine on this machine: the kvstorm image built from the real Dockerfile,
the stack brought up by docker-compose from compose.yaml (with compose.local.yaml: base images built from Debian's
packages, Grafana left out), every healthcheck waited for, a Locust burst and an experiment through the containers'
published ports, Prometheus' scrapes of both, the library's kill-and-restart through the controller (the engine
asked to exit, compose's restart policy starting it again, timed to ready), then everything torn down. Then the same
stack without its engine (compose.target.yaml), pointed by KVSTORM_TARGET_URL at a `kvstorm serve` this test runs
outside it, on the host: a burst, an experiment and Prometheus' scrape against that server. Last, the engine's
daemon is stopped.

The server outside the stack listens on the Docker bridge's own address (docker0's, where host.docker.internal
points from a container): compose's containers cannot reach the host's loopback, and host networking cannot carry
compose.yaml's published ports. That address is this machine's and its containers' only; since it is not loopback
the server takes a token of the test's own, which the controller gets as an operator gets it (an environment
override, as an edited kvstorm.env would give it).

Its own CI step (`make compose-check`), not part of `make test`: it needs root, Debian's docker.io, docker-compose
and debootstrap (the make target installs them) and about seven minutes. It prints what it saw (pytest -s).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import yaml

from chaos.injectors.processes import ManagedServer, free_port
from tests.chaos.test_supervised_restart import run_kill_and_restart
from tests.test_compose import (
    TARGET_OVERRIDE,
    TARGET_URL_ENV,
    env_of,
    exercise_stack,
    instant,
    published_port,
    services,
)

pytestmark = pytest.mark.containers

REPO = Path(__file__).resolve().parents[1]
PROJECT = "kvstorm-compose-check"
COMPOSE = ["docker-compose", "--project-name", PROJECT, "--file", "compose.yaml", "--file", "compose.local.yaml"]
IMAGE = "kvstorm:local"
IMAGE_USER = "10001"  # the Dockerfile's non-root user
LEFT_OUT = {"grafana": "no Grafana image or package can be had without an image registry"}
ONE_SHOTS = ("scrape-target",)  # done once the target answers: exited 0, not running
HEALTHY_WITHIN_S = 420  # the engine's start_period (180 s) with room for a slow first kernel build
# The bundled engine's flags for the server the external-target mode runs against (compose.yaml's engine command).
ENGINE_FLAGS = ["--num-kv-blocks", "88", "--swap-space", "256MiB", "--preemption-mode", "auto"]


def say(message: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command: list[str], env: dict[str, str], timeout_s: float, log: Path | None = None) -> str:
    """Runs a command to completion; its output goes to ``log`` when given (and its tail into the failure)."""
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    output = result.stdout + result.stderr
    if log is not None:
        log.write_text(output)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{output[-4000:]}"
    if log is not None:
        say(f"{' '.join(command)}: {time.monotonic() - started:.0f} s (log: {log})")
    return result.stdout


@pytest.fixture(scope="module")
def docker_env() -> Iterator[dict[str, str]]:
    """A Docker engine of the test's own, as it can run on a machine without iptables: its data in a folder of its
    own, its API on a socket there, its default bridge (docker0: host.docker.internal's address, compose.target.yaml)
    without NAT; stopped and removed at the end, and docker0 too when it made it."""
    missing = [tool for tool in ("dockerd", "docker", "docker-compose", "debootstrap") if not shutil.which(tool)]
    if missing or os.geteuid() != 0:
        pytest.fail(f"needs root and {', '.join(missing) or 'nothing more'}: `make compose-check` installs them")
    root = Path(tempfile.mkdtemp(prefix="kvstorm-docker-"))  # short: containerd's sockets live under it
    socket = root / "docker.sock"
    had_docker0 = Path("/sys/class/net/docker0").exists()
    log = open(root / "dockerd.log", "w")  # noqa: SIM115 -- open for the daemon's lifetime
    daemon = subprocess.Popen(
        ["dockerd", "--iptables=false", "--ip6tables=false", "--data-root", str(root / "data"),
         "--exec-root", str(root / "exec"), "--pidfile", str(root / "dockerd.pid"), "--host", f"unix://{socket}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    env = {**os.environ, "DOCKER_HOST": f"unix://{socket}", "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], env=env, capture_output=True).returncode != 0:
            assert daemon.poll() is None, (root / "dockerd.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "dockerd did not answer within 60 s"
            time.sleep(1)
        info = json.loads(run(["docker", "info", "--format", "{{json .}}"], env, 30))
        say(f"dockerd {info['ServerVersion']} up, storage driver {info['Driver']}, no iptables")
        yield env
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        for mount in reversed(Path("/proc/mounts").read_text().splitlines()):
            if mount.split()[1].startswith(str(root)):  # what a killed daemon may leave mounted
                subprocess.run(["umount", "--lazy", mount.split()[1]], check=False)
        shutil.rmtree(root, ignore_errors=True)
        if not had_docker0:
            subprocess.run(["ip", "link", "delete", "docker0"], capture_output=True, check=False)
        say(f"dockerd stopped, {root} removed" if not root.exists() else f"dockerd stopped, {root} NOT removed")


@pytest.fixture(scope="module")
def built(docker_env, tmp_path_factory) -> tuple[dict[str, str], Path]:
    """The local base images and the kvstorm image, built once for every stack of the module; the logs' folder."""
    logs = tmp_path_factory.mktemp("compose-check")
    run(["scripts/local_base_images.sh"], docker_env, 900, logs / "base-images.log")
    run([*COMPOSE, "build"], docker_env, 1800, logs / "build.log")
    image = json.loads(run(["docker", "image", "inspect", IMAGE], docker_env, 30))[0]
    say(f"image {IMAGE}: user {image['Config']['User']}, {image['Size'] / 2**30:.2f} GiB, "
        f"healthcheck {image['Config']['Healthcheck']['Test']}")  # fmt: skip
    assert image["Config"]["User"] == IMAGE_USER
    return docker_env, logs


@contextmanager
def compose_up(env: dict[str, str], logs: Path, files: list[str]) -> Iterator[dict[str, str]]:
    """``docker-compose up`` of compose.yaml and ``files`` (more ``--file``s), every healthcheck waited for; then its
    services' logs kept, everything torn down, and nothing of the project left."""
    compose = [*COMPOSE, *(arg for path in files for arg in ("--file", path))]
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    try:
        run([*compose, "up", "--detach", "--no-build"], env, 600, logs / "up.log")
        wait_until_healthy(env)
        yield env
    finally:
        services_log = subprocess.run([*compose, "logs", "--no-color", "--tail", "200"], cwd=REPO, env=env,
                                      capture_output=True, text=True, timeout=120)  # fmt: skip
        (logs / "services.log").write_text(services_log.stdout + services_log.stderr)
        say(f"the services' logs: {logs / 'services.log'}")
        run([*compose, "down", "--volumes", "--remove-orphans", "--timeout", "60"], env, 300, logs / "down.log")
        left = {kind: run(["docker", kind, "ls", "--quiet", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                          env, 30).split()
                for kind in ("container", "network", "volume")}  # fmt: skip
        say(f"torn down {time.monotonic() - started:.0f} s after `up`: containers, networks and volumes left {left}")
        assert not any(left.values()), left


@pytest.fixture
def stack(built) -> Iterator[dict[str, str]]:
    """compose.yaml with its bundled engine."""
    env, logs = built
    with compose_up(env, logs / "bundled", []) as running:
        yield running


@pytest.fixture
def external_stack(built) -> Iterator[tuple[dict[str, str], str]]:
    """compose.yaml with compose.target.yaml, pointed at a kvstorm serve run outside it, on the host; yields the
    Docker environment and the target's URL as the containers reach it."""
    env, logs = built
    (logs / "external").mkdir()
    gateway = host_gateway(env)
    token = secrets.token_hex(16)  # the server binds beyond loopback: kvstorm.env's committed token is refused there
    port = free_port()
    command = ["kvstorm", "serve", "--host", gateway, "--port", str(port), *ENGINE_FLAGS, "--admin-token", token]
    server = ManagedServer(command, f"http://{gateway}:{port}/ready", logs / "external" / "server.log")
    server.start(timeout_s=300)
    # The operator's own admin token for the controller, as an edited kvstorm.env would give it.
    operator = logs / "external" / "operator.yaml"
    operator.write_text(yaml.safe_dump({"services": {"chaos": {"environment": {"KVSTORM_ADMIN_TOKEN": token}}}}))
    target_url = f"http://host.docker.internal:{port}"
    say(f"a kvstorm serve outside the stack on {gateway}:{port}; {TARGET_URL_ENV}={target_url}")
    try:
        with compose_up({**env, TARGET_URL_ENV: target_url}, logs / "external", [TARGET_OVERRIDE.name, str(operator)]):
            yield env, target_url
    finally:
        server.stop()


def host_gateway(env: dict[str, str]) -> str:
    """Where host.docker.internal points from a container (docker0's address), as a container resolves it."""
    answer = run(["docker", "run", "--rm", "--add-host", "host.docker.internal:host-gateway", "--entrypoint",
                  "getent", IMAGE, "hosts", "host.docker.internal"], env, 60)  # fmt: skip
    return answer.split()[0]


def containers(env: dict[str, str]) -> dict[str, dict]:
    """The stack's containers as docker inspects them, by compose service."""
    ids = run(["docker", "ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={PROJECT}"], env, 30)
    inspected = json.loads(run(["docker", "inspect", *ids.split()], env, 30)) if ids.split() else []
    return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in inspected}


def wait_until_healthy(env: dict[str, str]) -> None:
    """Until every container with a healthcheck reports healthy; a container that exits fails at once."""
    started = time.monotonic()
    while True:
        running = containers(env)
        done = {name for name in ONE_SHOTS if name in running and running[name]["State"]["Status"] == "exited"}
        for name in done:
            assert running[name]["State"]["ExitCode"] == 0, f"{name} exited {running[name]['State']['ExitCode']}"
        exited = {name: c["State"]["Status"] for name, c in running.items() if c["State"]["Status"] != "running"}
        assert not set(exited) - done, f"containers not running: {exited}"
        running = {name: container for name, container in running.items() if name not in done}
        health = {name: c["State"].get("Health", {}).get("Status", "no healthcheck") for name, c in running.items()}
        if all(status in ("healthy", "no healthcheck") for status in health.values()):
            break
        assert time.monotonic() - started < HEALTHY_WITHIN_S, f"not healthy within {HEALTHY_WITHIN_S} s: {health}"
        time.sleep(5)
    for name, status in sorted(health.items()):
        say(f"{name}: {status}, running as user {running[name]['Config']['User'] or 'root'}")
    say(f"every healthcheck passed {time.monotonic() - started:.0f} s after `up`")
    for name, why in LEFT_OUT.items():
        say(f"{name}: left out ({why})")


def published_url(service: str) -> str:
    return f"http://127.0.0.1:{published_port(services()[service])}"


def test_the_stack_comes_up_in_docker_serves_a_burst_and_an_experiment_and_restarts_its_engine(stack, tmp_path):
    check_the_containers(stack)
    check_a_burst_and_an_experiment(stack, tmp_path)
    check_kill_and_restart(stack)


def check_the_containers(stack: dict[str, str]) -> None:
    running = containers(stack)
    assert set(running) == set(services()) - set(LEFT_OUT), sorted(running)
    for name, container in running.items():
        if container["Config"]["Image"] == IMAGE:
            assert container["Config"]["User"] == IMAGE_USER, name
    # The engine built kvstorm's CPU kernels as the image's user: a missing header or a home it cannot write would
    # leave it on the slow torch reference, with only a line in its log.
    engine_log = run([*COMPOSE, "logs", "--no-color", "engine"], stack, 60)
    (started,) = [
        line.split("| ", 1)[1]
        for line in engine_log.splitlines()
        if "kvstorm serve: " in line and ", attention " in line
    ]
    say(f"engine: {started}")
    assert "attention cpu" in started, started


def check_a_burst_and_an_experiment(stack: dict[str, str], tmp_path: Path) -> None:
    token = env_of(services()["chaos"])["KVSTORM_CHAOS_TOKEN"]
    exercised = exercise_stack(published_url, token)
    for method in ("TTFT", "ITL"):
        row = exercised.locust_rows[method]
        say(f"Locust {method}: {row['num_requests']} samples, {row['num_failures']} failures, median "
            f"{row['median_response_time']} ms, max {row['max_response_time']:.0f} ms")  # fmt: skip
    say(f"experiment burst-with-vram-cap through the controller's API: {exercised.verdict['status'].upper()}")
    say(f"Prometheus' up: {exercised.up}")
    # The run's report, written by the controller (uid 10001) into its volume.
    report = requests.get(f"{published_url('chaos')}/runs/{exercised.run_id}/report",
                          headers={"Authorization": f"Bearer {token}"}, timeout=60)  # fmt: skip
    assert report.status_code == 200, report.text[:400]
    assert "Burst with a 30% VRAM cap: HELD" in report.text
    say(f"the run's HTML report from the chaos container's volume: HTTP 200, {len(report.text) / 1024:.0f} KiB")
    # Its dashboards, drawn by the controller from the Prometheus container over compose's network (README, step 4).
    assert "The SLO and engine dashboards over this run" in report.text, "the controller drew no dashboards"
    chaos_container = containers(stack)["chaos"]["Id"]
    run(["docker", "cp", f"{chaos_container}:/data/chaos-results", str(tmp_path)], stack, 60)
    (dashboards,) = (tmp_path / "chaos-results" / exercised.run_id).rglob("dashboards.html")
    panels = dashboards.read_text().split("<div class='panel'>")[1:]
    drawn = [panel for panel in panels if "no data in this window" not in panel]
    say(f"{dashboards.relative_to(tmp_path)}: {len(drawn)} of {len(panels)} panels drawn from Prometheus' data")
    assert len(drawn) >= len(panels) // 2, f"{len(panels) - len(drawn)} of {len(panels)} panels have no data"


def check_kill_and_restart(stack: dict[str, str]) -> None:
    """The library's kill-and-restart through the controller's API: the engine asked to exit (no process signalled
    from outside its container, no command run), compose's restart policy starting it again, its time to ready in
    the verdict, and nothing left on after."""
    auth = {"Authorization": f"Bearer {env_of(services()['chaos'])['KVSTORM_CHAOS_TOKEN']}"}
    restarts_before = containers(stack)["engine"]["RestartCount"]
    run_summary, events = run_kill_and_restart(published_url("chaos"), auth)
    verdict = run_summary["verdict"]
    say(f"experiment kill-and-restart through the controller's API: {run_summary['status'].upper()}: "
        f"{verdict['reason']}")  # fmt: skip
    assert run_summary["status"] == "held", verdict["reason"]
    (ready_s,) = verdict["restarts_s"]
    restarts = containers(stack)["engine"]["RestartCount"] - restarts_before
    say(
        f"engine: restarted {restarts} time by compose's restart policy, ready again {ready_s:.1f} s after it went down"
    )
    assert restarts == 1
    assert 0 < ready_s < HEALTHY_WITHIN_S
    down = [(event["name"], event["active"]) for event in events if event["type"] == "fault"]
    assert down == [("server:down", True), ("server:down", False)]
    wait_until_healthy(stack)
    admin = {"Authorization": f"Bearer {env_of(services()['engine'])['KVSTORM_ADMIN_TOKEN']}"}
    assert requests.get(f"{published_url('engine')}/admin/faults", headers=admin, timeout=30).json()["active"] == []
    controller_metrics = requests.get(f"{published_url('chaos')}/metrics", timeout=30).text
    on = [line for line in controller_metrics.splitlines() if line.startswith("kvstorm_chaos_fault_active{")
          and not line.endswith(" 0.0")]  # fmt: skip
    assert on == [], on
    say("after the run: no engine fault active, no fault active in the controller, every container healthy")


def test_the_stack_without_its_engine_follows_one_url_to_a_server_outside_it(external_stack):
    env, target_url = external_stack
    running = containers(env)
    assert "engine" not in running, "compose.target.yaml leaves the bundled engine out"
    assert set(running) == set(services()) - set(LEFT_OUT) - {"engine"}, sorted(running)
    token = env_of(services()["chaos"])["KVSTORM_CHAOS_TOKEN"]
    exercised = exercise_stack(published_url, token)
    row = exercised.locust_rows["TTFT"]
    say(f"Locust against {target_url}: {row['num_requests']} TTFT samples, {row['num_failures']} failures")
    say(f"experiment burst-with-vram-cap through the controller's API: {exercised.verdict['status'].upper()}")
    instance = target_url.removeprefix("http://")
    scraped = instant(published_url("prometheus"), f'up{{job="engine", instance="{instance}"}}')
    assert [sample["value"][1] for sample in scraped] == ["1"], scraped
    say(f"Prometheus scrapes the engine job at {instance}: up {exercised.up['engine']}")
    # kill-and-restart needs a server that exits when asked: this one was started without --admin-exit.
    auth = {"Authorization": f"Bearer {token}"}
    run_summary, _ = run_kill_and_restart(published_url("chaos"), auth)
    assert run_summary["status"] == "not_applicable", run_summary
    assert "started without --admin-exit" in run_summary["verdict"]["reason"]
    say(f"kill-and-restart against it: NOT APPLICABLE ({run_summary['verdict']['reason']})")
