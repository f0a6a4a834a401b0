"""`docker compose up` for real, in a Docker engine on this machine: the kvstorm image built from the real Dockerfile,
the stack brought up by docker-compose from compose.yaml (with compose.local.yaml: base images built from Debian's
packages, Grafana left out), every healthcheck waited for, a Locust burst and an experiment through the containers'
published ports, Prometheus' scrapes of both, then everything torn down, the engine's daemon included.

Its own CI step (`make compose-check`), not part of `make test`: it needs root, Debian's docker.io, docker-compose
and debootstrap (the make target installs them) and about ten minutes. It prints what it saw (pytest -s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.test_compose import env_of, exercise_stack, published_port, services

pytestmark = pytest.mark.containers

REPO = Path(__file__).resolve().parents[1]
PROJECT = "kvstorm-compose-check"
COMPOSE = ["docker-compose", "--project-name", PROJECT, "--file", "compose.yaml", "--file", "compose.local.yaml"]
IMAGE = "kvstorm:local"
IMAGE_USER = "10001"  # the Dockerfile's non-root user
LEFT_OUT = {"grafana": "no Grafana image or package can be had without an image registry"}
HEALTHY_WITHIN_S = 420  # the engine's start_period (180 s) with room for a slow first kernel build


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
    """A Docker engine of the test's own, as it can run on a machine without iptables or a default bridge: its data
    in a folder of its own, its API on a socket there; stopped and removed at the end."""
    missing = [tool for tool in ("dockerd", "docker", "docker-compose", "debootstrap") if not shutil.which(tool)]
    if missing or os.geteuid() != 0:
        pytest.fail(f"needs root and {', '.join(missing) or 'nothing more'}: `make compose-check` installs them")
    root = Path(tempfile.mkdtemp(prefix="kvstorm-docker-"))  # short: containerd's sockets live under it
    socket = root / "docker.sock"
    log = open(root / "dockerd.log", "w")  # noqa: SIM115 -- open for the daemon's lifetime
    daemon = subprocess.Popen(
        ["dockerd", "--iptables=false", "--ip6tables=false", "--bridge=none", "--data-root", str(root / "data"),
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
        say(f"dockerd {info['ServerVersion']} up, storage driver {info['Driver']}, no iptables, no default bridge")
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
        say(f"dockerd stopped, {root} removed" if not root.exists() else f"dockerd stopped, {root} NOT removed")


@pytest.fixture(scope="module")
def stack(docker_env, tmp_path_factory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("compose-check")
    run(["scripts/local_base_images.sh"], docker_env, 900, logs / "base-images.log")
    run([*COMPOSE, "build"], docker_env, 1800, logs / "build.log")
    image = json.loads(run(["docker", "image", "inspect", IMAGE], docker_env, 30))[0]
    say(f"image {IMAGE}: user {image['Config']['User']}, {image['Size'] / 2**30:.2f} GiB, "
        f"healthcheck {image['Config']['Healthcheck']['Test']}")  # fmt: skip
    assert image["Config"]["User"] == IMAGE_USER
    try:
        run([*COMPOSE, "up", "--detach", "--no-build"], docker_env, 300, logs / "up.log")
        wait_until_healthy(docker_env)
        yield docker_env
    finally:
        services_log = subprocess.run([*COMPOSE, "logs", "--no-color", "--tail", "200"], cwd=REPO, env=docker_env,
                                      capture_output=True, text=True, timeout=120)  # fmt: skip
        (logs / "services.log").write_text(services_log.stdout + services_log.stderr)
        say(f"the services' logs: {logs / 'services.log'}")
        run([*COMPOSE, "down", "--volumes", "--remove-orphans", "--timeout", "60"], docker_env, 300, logs / "down.log")
        left = {kind: run(["docker", kind, "ls", "--quiet", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                          docker_env, 30).split()
                for kind in ("container", "network", "volume")}  # fmt: skip
        say(f"torn down: containers, networks and volumes left {left}")
        assert not any(left.values()), left


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
        exited = {name: c["State"]["Status"] for name, c in running.items() if c["State"]["Status"] != "running"}
        assert not exited, f"containers not running: {exited}"
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


def test_the_stack_comes_up_in_docker_and_serves_a_burst_and_an_experiment(stack, tmp_path):
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
