"""The compose stack is closed by default (compose.yaml, kvstorm.env): every port published on loopback until the
operator opens it, and each service that can be opened refuses the secrets committed in kvstorm.env beyond loopback:
the engine and the controller their tokens (kvstorm/exposure.py), Locust's web UI wants a login, Grafana an admin
password of the operator's own (its entrypoint in compose.yaml, run here by a real shell before a stand-in for the
image's own entrypoint: no Grafana image can be had here).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests

from chaos.injectors.processes import ManagedServer
from kvstorm.exposure import COMMITTED_DEFAULTS, PUBLISHED_ON_ENV, committed_token_refusal, is_loopback
from tests.test_compose import (
    BIN,
    BIND_ADDRESS_ENV,
    COMPOSE,
    GPU_OVERRIDE,
    LOCAL_OVERRIDE,
    TARGET_OVERRIDE,
    Stack,
    compose,
    env_of,
    kvstorm_services,
    option,
    published_address_and_port,
    services,
    substitute,
)

DASHBOARDS_BIND_ADDRESS_ENV = "KVSTORM_DASHBOARDS_BIND_ADDRESS"  # opens Prometheus' and Grafana's published ports
DASHBOARDS = ("prometheus", "grafana")
OWN_SECRET = "3f9c2d7e8a1b4c6d9e0f1a2b3c4d5e6f"
# Stands in for the Grafana image's own entrypoint (/run.sh), which compose.yaml's entrypoint hands over to.
GRAFANA_STAND_IN = [sys.executable, "-c", "print('grafana starts')"]


def opening_variables(service_name: str) -> tuple[str, str]:
    """The variable that opens the service's published port, and the one that must not."""
    if service_name in DASHBOARDS:
        return DASHBOARDS_BIND_ADDRESS_ENV, BIND_ADDRESS_ENV
    return BIND_ADDRESS_ENV, DASHBOARDS_BIND_ADDRESS_ENV


@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE, LOCAL_OVERRIDE, TARGET_OVERRIDE], ids=lambda p: p.name)
def test_every_published_port_is_loopback_only_by_default(path):
    """Each port opens with its own variable: the engine's, the controller's and Locust's with KVSTORM_BIND_ADDRESS,
    Prometheus' and Grafana's with KVSTORM_DASHBOARDS_BIND_ADDRESS only."""
    published = {name: s for name, s in compose(path)["services"].items() if "ports" in s}
    if path == COMPOSE:
        assert set(published) == {"engine", "prometheus", "grafana", "locust-master", "chaos"}
    for name, service in published.items():
        opened_by, other = opening_variables(name)
        for mapping in service["ports"]:
            assert mapping.startswith(f"${{{opened_by}:-127.0.0.1}}:"), f"{name}: {mapping}"
        address, _ = published_address_and_port(service)
        assert is_loopback(address), f"{name} is published on {address}"
        assert published_address_and_port(service, {opened_by: "0.0.0.0"})[0] == "0.0.0.0"
        assert is_loopback(published_address_and_port(service, {other: "0.0.0.0"})[0]), f"{other} opens {name}"


def test_the_services_behind_tokens_know_where_their_ports_are_published():
    """Compose passes the published address into every kvstorm container that holds kvstorm.env's secrets; opened,
    the engine and the controller refuse the committed tokens, and Locust's web UI asks for a login. The one-shot
    scrape-target holds none of them and publishes nothing."""
    holding = {name: service for name, service in kvstorm_services().items() if "env_file" in service}
    assert set(kvstorm_services()) - set(holding) == {"scrape-target"}
    assert not {"env_file", "environment", "ports"} & set(services()["scrape-target"])
    for name, service in holding.items():
        assert env_of(service)[PUBLISHED_ON_ENV] == "127.0.0.1", name
        assert env_of(service, {BIND_ADDRESS_ENV: "0.0.0.0"})[PUBLISHED_ON_ENV] == "0.0.0.0", name
    engine, chaos = services()["engine"], services()["chaos"]
    checks = [
        ("kvstorm serve", engine, "KVSTORM_ADMIN_TOKEN", "--admin-token"),
        ("kvstorm chaos serve", chaos, "KVSTORM_CHAOS_TOKEN", "--token"),
    ]
    for program, service, env_var, flag in checks:
        host = option(service["command"], "--host")
        assert not is_loopback(host), "inside a container the service binds beyond loopback"
        for variables, refused in (({}, False), ({BIND_ADDRESS_ENV: "0.0.0.0"}, True)):
            env = env_of(service, variables)
            assert env[env_var] in COMMITTED_DEFAULTS.values()
            message = committed_token_refusal(program, host, env[env_var], flag, env_var, env)
            assert (message is not None) == refused, (program, variables)
        own = {**env_of(service, {BIND_ADDRESS_ENV: "0.0.0.0"}), env_var: OWN_SECRET}
        assert committed_token_refusal(program, host, own[env_var], flag, env_var, own) is None


def test_grafana_takes_its_admin_password_from_the_env_file():
    grafana = services()["grafana"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in (grafana.get("environment") or {}), "not in compose.yaml itself"
    assert env_of(grafana)["GF_SECURITY_ADMIN_PASSWORD"] == COMMITTED_DEFAULTS["GF_SECURITY_ADMIN_PASSWORD"]
    assert env_of(grafana)["GF_AUTH_ANONYMOUS_ENABLED"] == "true"


def test_grafana_knows_where_its_port_is_published():
    grafana = services()["grafana"]
    for variables in ({}, {BIND_ADDRESS_ENV: "0.0.0.0"}, {DASHBOARDS_BIND_ADDRESS_ENV: "0.0.0.0"}):
        address, _ = published_address_and_port(grafana, variables)
        assert env_of(grafana, variables)[PUBLISHED_ON_ENV] == address, variables


def start_grafana(variables: dict[str, str], password: str | None = None) -> subprocess.CompletedProcess[str]:
    """Grafana's entrypoint as compose runs it, interpolated from ``variables``, with the container's environment
    (kvstorm.env's admin password, or ``password``)."""
    grafana = services()["grafana"]
    entrypoint = [substitute(part, variables) for part in grafana["entrypoint"]]
    env = env_of(grafana, variables) | {"PATH": os.environ["PATH"]}
    if password is not None:
        env["GF_SECURITY_ADMIN_PASSWORD"] = password
    return subprocess.run(
        [*entrypoint, *GRAFANA_STAND_IN], env=env, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.parametrize(
    "variables", [{}, {BIND_ADDRESS_ENV: "0.0.0.0"}, {DASHBOARDS_BIND_ADDRESS_ENV: "127.0.0.1"}], ids=str
)
def test_grafana_on_loopback_starts_with_the_committed_password(variables):
    """A laptop's `docker compose up`, and one that opens the engine, the controller and Locust only."""
    started = start_grafana(variables)
    assert started.returncode == 0, started.stderr
    assert started.stdout == "grafana starts\n"


@pytest.mark.parametrize("password", [*COMMITTED_DEFAULTS.values(), ""])
def test_grafana_opened_refuses_a_committed_or_empty_admin_password(password):
    refused = start_grafana({DASHBOARDS_BIND_ADDRESS_ENV: "0.0.0.0"}, password)
    assert refused.returncode == 2
    assert refused.stdout == "", "Grafana did not start"
    assert "grafana: refusing to start: published on 0.0.0.0" in refused.stderr
    assert "GF_SECURITY_ADMIN_PASSWORD" in refused.stderr
    assert "openssl rand -hex 16" in refused.stderr
    assert not password or password not in refused.stderr


def test_grafana_opened_starts_with_an_admin_password_of_the_operators_own():
    started = start_grafana({DASHBOARDS_BIND_ADDRESS_ENV: "0.0.0.0"}, OWN_SECRET)
    assert started.returncode == 0, started.stderr
    assert started.stdout == "grafana starts\n"


def test_locusts_web_ui_asks_for_a_login_when_compose_publishes_it_beyond_loopback(tmp_path):
    """The master as compose wires it, opened with KVSTORM_BIND_ADDRESS=0.0.0.0 (bound here on loopback): without a
    password it refuses to start; with one, nothing but the login page answers until the login."""
    stack = Stack(tmp_path)
    command = stack.translate("locust-master")
    command = [str(BIN / command[0]), *command[1:]]
    opened = env_of(services()["locust-master"], {BIND_ADDRESS_ENV: "0.0.0.0"})
    refused = subprocess.run(command, env={**os.environ, **opened}, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "KVSTORM_LOCUST_PASSWORD is empty" in refused.stderr
    password = OWN_SECRET
    locust = stack.url("locust-master")
    master = ManagedServer(command, f"{locust}/login", tmp_path / "locust.log",
                           env={**opened, "KVSTORM_LOCUST_PASSWORD": password})  # fmt: skip
    try:
        master.start(timeout_s=120)
        swarm = {"user_count": 1, "spawn_rate": 1, "run_time": "1s"}
        assert requests.post(f"{locust}/swarm", data=swarm, allow_redirects=False, timeout=10).status_code == 302
        assert requests.get(f"{locust}/stats/requests", allow_redirects=False, timeout=10).status_code == 302
        session = requests.Session()
        wrong = session.post(f"{locust}/kvstorm-login", data={"username": "kvstorm", "password": "local"}, timeout=10)
        assert wrong.url.endswith("/login")
        assert session.get(f"{locust}/stats/requests", allow_redirects=False, timeout=10).status_code == 302
        right = session.post(f"{locust}/kvstorm-login", data={"username": "kvstorm", "password": password}, timeout=10)
        assert right.status_code == 200
        assert not right.url.endswith("/login")
        assert session.get(f"{locust}/stats/requests", timeout=10).json()["state"] == "ready"
        assert password not in (tmp_path / "locust.log").read_text()
    finally:
        master.stop()
