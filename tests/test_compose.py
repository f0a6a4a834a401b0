"""The compose stack (compose.yaml, compose.gpu.yaml, compose.local.yaml, Dockerfile) without a Docker engine (the
containers themselves run in tests/test_compose_up.py, CI's own step): what needs no engine is validated (the Compose
spec's JSON schema, hadolint, promtool, the files every service mounts, its command against the image's entry
points, ports and healthchecks against the code's defaults, compose.target.yaml's stack without the bundled engine),
and what runs as a process does: every service but Grafana as a plain process on loopback, with the command and
environment compose.yaml gives it, one bounded Locust burst and one chaos experiment through the controller.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import requests
import yaml

from chaos.injectors.processes import ManagedServer, free_port
from dashboards.build import COMPOSE_CONTROLLER_TARGETS, COMPOSE_ENGINE_TARGETS, COMPOSE_PROMETHEUS_URL, GENERATED_DIR
from kvstorm.cli import build_parser
from tests.chaos.test_controller import events_until_end
from tests.chaos.test_experiments import SHORT

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"
GPU_OVERRIDE = REPO / "compose.gpu.yaml"
LOCAL_OVERRIDE = REPO / "compose.local.yaml"
TARGET_OVERRIDE = REPO / "compose.target.yaml"  # a server you run instead of the bundled engine
TARGET_URL_ENV = "KVSTORM_TARGET_URL"
SCHEMA = Path(sys.prefix) / "share" / "compose-spec.json"  # the Makefile extracts it
BIN = Path(sys.executable).parent
IMAGE_WORKDIR = "/app"  # the Dockerfile's WORKDIR: the repository root
# The image's entry points: the console scripts pip installs from pyproject.toml and its dependencies, and its python.
ENTRY_POINTS = ("kvstorm", "locust", "python")
BIND_ADDRESS_ENV = "KVSTORM_BIND_ADDRESS"  # opens the engine's, the controller's and Locust's published ports


def compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())


def services() -> dict[str, dict]:
    return compose()["services"]


def kvstorm_services() -> dict[str, dict]:
    return {name: service for name, service in services().items() if service.get("image") == "kvstorm:local"}


def substitute(text: str, variables: dict[str, str] | None = None) -> str:
    """Compose's interpolation of ``${NAME:-default}`` (and ``${NAME}``), from ``variables`` (none: the defaults),
    and of ``$$`` (a ``$`` of the text itself, e.g. a shell's)."""

    def value(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        given = (variables or {}).get(match["name"], "")
        if match["default"] is None and not given:
            raise AssertionError(f"${{{match['name']}}} has no default: compose would warn and use ''")
        return given or match["default"] or ""

    return re.sub(r"(?P<escaped>\$\$)|\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}", value, text)


def env_of(service: dict, variables: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment: its env files, then ``environment`` interpolated from ``variables``."""
    env = {}
    for env_file in service.get("env_file", []):
        for line in (REPO / env_file).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                key, value = line.split("=", 1)
                env[key] = value
    environment = {key: substitute(str(value), variables) for key, value in (service.get("environment") or {}).items()}
    return {**env, **environment}


def published_address_and_port(service: dict, variables: dict[str, str] | None = None) -> tuple[str, int]:
    (mapping,) = service["ports"]
    address, host, container = substitute(mapping, variables).split(":")
    assert host == container, "published on the same port as inside"
    return address, int(container)


def published_port(service: dict) -> int:
    return published_address_and_port(service)[1]


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# ---- what cannot run here: validated ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE, LOCAL_OVERRIDE, TARGET_OVERRIDE], ids=lambda p: p.name)
def test_compose_files_validate_against_the_compose_spec(path):
    assert SCHEMA.exists(), f"{SCHEMA} is missing: run `make setup`"
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft201909Validator(schema).iter_errors(compose(path)), key=str)
    assert errors == [], [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_the_schema_refuses_what_compose_refuses():
    schema = json.loads(SCHEMA.read_text())
    broken = compose()
    broken["services"]["engine"]["healthcheck"]["intervall"] = "5s"
    assert not jsonschema.Draft201909Validator(schema).is_valid(broken)


def test_every_kvstorm_command_parses_with_the_images_entry_points():
    parser = build_parser()
    for name, service in kvstorm_services().items():
        command = service["command"]
        assert command[0] in ENTRY_POINTS, name
        if command[0] == "kvstorm":
            parser.parse_args(command[1:])  # exits (SystemExit) on an unknown option
        elif command[0] == "python":
            assert command[1] == "-m", name
            importlib.import_module(command[2]).build_parser().parse_args(command[3:])
        else:
            locustfile = option(command, "-f")
            assert (REPO / locustfile).is_file(), f"{name}: {locustfile} is not in the image's {IMAGE_WORKDIR}"
    gpu = compose(GPU_OVERRIDE)["services"]["engine"]
    parser.parse_args(gpu["command"][1:])
    # kill-and-restart asks the engine to exit, and compose's restart policy starts it again, on CPU and GPU alike.
    assert "--admin-exit" in services()["engine"]["command"]
    assert "--admin-exit" in gpu["command"]
    assert services()["engine"]["restart"] == "unless-stopped"
    assert "--supervised-target" in services()["chaos"]["command"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert option(gpu["command"], "--dtype") == "bfloat16"
    assert option(gpu["command"], "--attention-backend") == "triton"


def test_every_mounted_file_and_env_file_exists():
    for name, service in services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name} mounts {source}, which is not in the repository"
            else:
                assert source in compose()["volumes"], f"{name}: {source} is not a declared named volume"
        for env_file in service.get("env_file", []):
            assert (REPO / env_file).is_file(), env_file
    assert {"KVSTORM_ADMIN_TOKEN", "KVSTORM_CHAOS_TOKEN"} <= set(env_of(services()["engine"]))


def test_ports_healthchecks_and_targets_agree_with_the_code():
    all_services = services()
    engine, chaos, prometheus = all_services["engine"], all_services["chaos"], all_services["prometheus"]
    engine_port = published_port(engine)
    assert int(option(engine["command"], "--port")) == engine_port
    assert f"127.0.0.1:{engine_port}/ready" in engine["healthcheck"]["test"][-1]
    assert int(option(chaos["command"], "--port")) == published_port(chaos)
    assert f"127.0.0.1:{published_port(chaos)}/health" in chaos["healthcheck"]["test"][-1]
    assert substitute(option(chaos["command"], "--target")) == f"http://engine:{engine_port}"
    # What Prometheus scrapes (the file scrape-target writes into the volume Prometheus reads) and where Grafana and
    # the controller find Prometheus: the build's defaults.
    scrape_target = all_services["scrape-target"]
    volume, data_dir = scrape_target["volumes"][0].split(":")
    (targets_dir,) = [v.split(":")[1] for v in prometheus["volumes"] if v.split(":")[0] == volume]
    assert Path(scrape_target["command"][-1].replace(data_dir, targets_dir, 1)) == COMPOSE_ENGINE_TARGETS
    assert (f"chaos:{published_port(chaos)}",) == COMPOSE_CONTROLLER_TARGETS
    assert f"http://prometheus:{published_port(prometheus)}" == COMPOSE_PROMETHEUS_URL
    assert option(chaos["command"], "--prometheus-url") == COMPOSE_PROMETHEUS_URL
    master, worker = all_services["locust-master"], all_services["locust-worker"]
    assert substitute(option(master["command"], "--host")) == f"http://engine:{engine_port}"
    assert int(option(master["command"], "--web-port")) == published_port(master)
    assert option(worker["command"], "--master-host") == "locust-master"
    assert option(worker["command"], "--master-port") == option(master["command"], "--master-bind-port")
    # The defaults the code gives a user who starts the same programs by hand.
    defaults = build_parser()
    assert defaults.parse_args(["serve"]).port == engine_port
    assert defaults.parse_args(["chaos", "serve", "--target", "x"]).port == published_port(chaos)
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"127.0.0.1:{engine_port}/ready" in dockerfile
    assert f'"--port", "{engine_port}"' in dockerfile


def test_chaos_locust_and_prometheus_follow_one_target_url():
    """The server under test is one variable: the bundled engine unless KVSTORM_TARGET_URL names another; the
    controller, Locust and the scrape target take the same value, ask the server for its model, and nothing waits on
    the engine service itself (compose.target.yaml leaves it out)."""
    all_services = services()
    given = [
        option(all_services["chaos"]["command"], "--target"),
        option(all_services["locust-master"]["command"], "--host"),
        all_services["scrape-target"]["command"][3],
    ]
    assert set(given) == {f"${{{TARGET_URL_ENV}:-http://engine:8000}}"}
    elsewhere = "http://gpu-box:8000"
    assert {substitute(value, {TARGET_URL_ENV: elsewhere}) for value in given} == {elsewhere}
    for name in ("chaos", "locust-master"):
        assert "--model" not in all_services[name]["command"], f"{name} asks the target for its model"
    for name, service in all_services.items():
        assert "engine" not in (service.get("depends_on") or {}), f"{name} waits on the engine service itself"
    for name in ("prometheus", "chaos", "locust-master"):
        assert all_services[name]["depends_on"]["scrape-target"] == {"condition": "service_completed_successfully"}
    assert all_services["scrape-target"]["restart"] == "no", "a one-shot"


def test_the_target_override_leaves_the_engine_out_and_changes_nothing_else():
    override = compose(TARGET_OVERRIDE)["services"]
    assert override["engine"] == {"profiles": ["bundled-engine"]}
    reaching = {name for name, s in override.items() if "host.docker.internal:host-gateway" in s.get("extra_hosts", [])}
    assert reaching == set(services()) - {"engine", "grafana"}, "every service that talks to the target"
    # No port, command or bind address: compose.yaml's loopback publishing and its refusals stand.
    for name, service in override.items():
        assert set(service) <= {"profiles", "extra_hosts", "environment"}, name
    required = override["scrape-target"]["environment"][TARGET_URL_ENV]
    assert required.startswith(f"${{{TARGET_URL_ENV}:?"), "compose stops at once when it is unset"


def test_prometheus_files_pass_promtool():
    mount = next(v for v in services()["prometheus"]["volumes"] if v.endswith(":/etc/prometheus:ro"))
    directory = REPO / mount.split(":")[0]
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "kvstorm-rules.yml"]):
        result = subprocess.run(["promtool", *args], cwd=directory, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_points_at_the_dashboards_the_build_produces():
    grafana = services()["grafana"]
    mounts = dict(reversed(v.removesuffix(":ro").split(":")) for v in grafana["volumes"])
    provisioning = REPO / mounts["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvstorm.yml").read_text())["providers"]
    dashboards_dir = REPO / mounts[provider["options"]["path"]]
    assert dashboards_dir == GENERATED_DIR / "grafana" / "dashboards"
    uids = {json.loads(p.read_text())["uid"] for p in dashboards_dir.glob("*.json")}
    assert uids == {"kvstorm-engine", "kvstorm-slo", "kvstorm-chaos"}
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert json.loads((dashboards_dir / Path(home).name).read_text())["uid"] == "kvstorm-slo"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == COMPOSE_PROMETHEUS_URL
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_the_dockerfile_passes_hadolint_and_copies_only_what_exists():
    result = subprocess.run(
        [str(BIN / "hadolint"), "Dockerfile"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = [source for line in re.findall(r"^COPY (.+)$", dockerfile, re.M) for source in line.split()[:-1]]
    assert copied
    kept = {line[1:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert source in kept, f"COPY {source}: .dockerignore leaves it out of the build context"
    packages = re.search(r"include = \[(.*?)\]", (REPO / "pyproject.toml").read_text())[1]
    assert {p.strip('" *') for p in packages.split(",")} <= set(copied), "every package the install needs"


def test_the_images_install_carries_every_data_file_the_code_reads(tmp_path):
    """The image installs kvstorm with ``pip install .`` from its build context, not editable: the C++ sources the
    CPU kernels are built from on first use, the chat corpus, the experiments and the promtool rules must be in
    the wheel built from that context."""
    context = tmp_path / "context"
    for kept in (line[1:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")):
        source = REPO / kept
        if source.is_dir():
            shutil.copytree(source, context / kept, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (context / kept).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, context / kept)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=context, check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("kvstorm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = set(archive.namelist())
    needed = [
        *(REPO / "kernels" / "csrc").glob("*.cpp"),
        REPO / "loadgen" / "corpus.txt",
        *(REPO / "chaos" / "experiments").glob("*.yaml"),
        *(REPO / "dashboards" / "promtool").glob("*.yml"),
    ]
    assert len(needed) > 6
    missing = [str(path.relative_to(REPO)) for path in needed if str(path.relative_to(REPO)) not in packaged]
    assert not missing, f"not in the wheel: {missing}"


# ---- what can run here: the services as processes -----------------------------------------------------------------


class Stack:
    """compose.yaml's services on loopback: each container port gets a free port, each service name 127.0.0.1."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {published_port(s): free_port() for s in services().values() if "ports" in s}
        master = services()["locust-master"]["command"]
        self.ports[int(option(master, "--master-bind-port"))] = free_port()
        self.processes: list[ManagedServer] = []

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[published_port(services()[service])]}"

    def translate(self, name: str) -> list[str]:
        """The service's command with addresses, ports and mounted paths as they are outside a container."""
        service = services()[name]
        mounts = {target: self._mount_source(name, source) for source, target, *_ in
                  (volume.split(":") for volume in service.get("volumes", []))}  # fmt: skip
        mounts[IMAGE_WORKDIR] = REPO
        out = []
        for index, token in enumerate(service["command"]):
            token = substitute(token).replace("0.0.0.0", "127.0.0.1")
            token = re.sub(r"//[a-z-]+:(\d+)", lambda m: f"//127.0.0.1:{self.ports[int(m[1])]}", token)
            token = re.sub(r"^(127\.0\.0\.1):(\d+)$", lambda m: f"{m[1]}:{self.ports[int(m[2])]}", token)
            token = re.sub(r"=127\.0\.0\.1:(\d+)$", lambda m: f"=127.0.0.1:{self.ports[int(m[1])]}", token)
            previous = service["command"][index - 1] if index else ""
            if token in services() and "host" in previous:
                token = "127.0.0.1"
            elif "port" in previous and token.isdigit():
                token = str(self.ports[int(token)])
            elif previous == "-f":
                token = str(REPO / token)
            for target, source in mounts.items():
                token = re.sub(rf"(^|=){re.escape(target)}(?=/|$)", lambda m, s=source: m[1] + str(s), token)
            out.append(token)
        return out

    def start(self, name: str, ready_path: str) -> None:
        service = services()[name]
        command = self.translate(name)
        executable = shutil.which("prometheus") if name == "prometheus" else str(BIN / command[0])
        command = [executable, *command] if name == "prometheus" else [executable, *command[1:]]
        ready = f"{self.url(name)}{ready_path}" if "ports" in service else f"{self.url('locust-master')}/"
        process = ManagedServer(command, ready, self.tmp / f"{name}.log", env=env_of(service))
        self.processes.append(process)
        process.start(timeout_s=240)

    def run_once(self, name: str) -> None:
        """A one-shot service, run to its exit, which must be 0 (what ``service_completed_successfully`` waits for)."""
        command = self.translate(name)
        result = subprocess.run([str(BIN / command[0]), *command[1:]], capture_output=True, text=True, timeout=300)
        (self.tmp / f"{name}.log").write_text(result.stdout + result.stderr)
        assert result.returncode == 0, result.stdout + result.stderr

    def _mount_source(self, name: str, source: str) -> Path:
        """A named volume: a folder of its own, the same for every service that mounts it. A bind mount: the
        repository's files, where Prometheus' config has the service names as loopback addresses (what compose's
        network resolves) and the paths of its volumes as they are here."""
        if not source.startswith("."):
            folder = self.tmp / "volumes" / source
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        if name != "prometheus":
            return REPO / source
        copy = self.tmp / "prometheus-config"
        shutil.copytree(REPO / source, copy)
        config = copy / "prometheus.yml"
        text = re.sub(r"\b(?:engine|chaos):(\d+)", lambda m: f"127.0.0.1:{self.ports[int(m[1])]}", config.read_text())
        for volume_source, target, *_ in (volume.split(":") for volume in services()[name]["volumes"]):
            if not volume_source.startswith("."):
                text = text.replace(f"{target}/", f"{self._mount_source(name, volume_source)}/")
        config.write_text(text)
        return copy

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def test_the_stack_runs_as_compose_wires_it(tmp_path):
    stack = Stack(tmp_path)
    try:
        # In depends_on order, each waited for as its healthcheck would (the one-shot scrape-target to its exit).
        stack.start("engine", "/ready")
        stack.run_once("scrape-target")
        stack.start("prometheus", "/-/ready")
        stack.start("chaos", "/health")
        stack.start("locust-master", "/")
        stack.start("locust-worker", "/")
        exercise_stack(stack.url, env_of(services()["chaos"])["KVSTORM_CHAOS_TOKEN"])
    finally:
        stack.stop()


@dataclass
class Exercised:
    locust_rows: dict[str, dict]  # Locust's stats rows by method (TTFT, ITL, ...)
    verdict: dict
    run_id: str
    up: dict[str, str]  # Prometheus' `up` by job


def locust_rows(locust: str) -> dict[str, dict]:
    """Locust's stats rows by method (TTFT, ITL, POST, ...)."""
    return {row["method"]: row for row in requests.get(f"{locust}/stats/requests", timeout=5).json()["stats"]}


def exercise_stack(url: Callable[[str], str], chaos_token: str, num_streams: int = 4) -> Exercised:
    """What a user does with the stack, to its results: a bounded Locust burst from the web UI's own API, an
    experiment through the controller with the token compose gives it, and Prometheus' scrapes of both.
    ``url(service)`` is where a service's published port answers."""
    locust = url("locust-master")
    wait_for(lambda: requests.get(f"{locust}/stats/requests", timeout=5).json()["worker_count"] == 1, "a worker")
    swarm = requests.post(f"{locust}/swarm", data={"user_count": 4, "spawn_rate": 4}, timeout=10)
    assert swarm.json()["success"], swarm.text
    # Until ``num_streams`` streams have finished (seconds on an idle 2-core machine, more on a busy one), then stopped.
    wait_for(lambda: locust_rows(locust)["TTFT"]["num_requests"] >= num_streams, "streams through Locust",
             timeout_s=180)  # fmt: skip
    stop = requests.post(f"{locust}/stop", timeout=10)  # POST, as the web UI sends it: Locust 2.47 answers a GET 405
    assert stop.ok, stop.text
    wait_for(lambda: requests.get(f"{locust}/stats/requests", timeout=5).json()["state"] == "stopped", "the stop")
    rows = locust_rows(locust)
    assert rows["TTFT"]["num_requests"] > 0
    assert rows["ITL"]["num_requests"] > rows["TTFT"]["num_requests"]
    assert rows["TTFT"]["num_failures"] == 0
    controller = url("chaos")
    auth = {"Authorization": f"Bearer {chaos_token}"}
    body = {"experiment": "burst-with-vram-cap", "overrides": SHORT}
    run = requests.post(f"{controller}/runs", json=body, headers=auth, timeout=30)
    assert run.status_code == 201, run.text
    events = events_until_end(controller, run.json()["id"], auth)
    (verdict,) = [event for event in events if event["type"] == "verdict"]
    assert verdict["status"] == "held", verdict
    # Prometheus scraped both, as configured by the files compose mounts.
    prometheus = url("prometheus")
    up = {r["metric"]["job"]: r["value"][1] for r in instant(prometheus, "up")}
    assert up == {"engine": "1", "chaos-controller": "1"}
    assert instant(prometheus, "sum(vllm:request_success_total) > 0")
    held = 'kvstorm_chaos_runs_total{experiment="burst-with-vram-cap", result="held"} == 1'
    wait_for(lambda: instant(prometheus, held), "the run's result in Prometheus", timeout_s=20)
    return Exercised(rows, verdict, run.json()["id"], up)


def instant(prometheus_url: str, expr: str) -> list[dict]:
    return requests.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10).json()["data"]["result"]


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (requests.RequestException, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout_s:g} s")
