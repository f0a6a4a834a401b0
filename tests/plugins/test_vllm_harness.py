"""The harness in front of the plugin's contract at a URL of its own (``--var faults_url=``): an experiment whose
faults vLLM cannot have, or a plugin that refused its vLLM version, ends NOT APPLICABLE with the plugin's reason
before anything is sent. The target is the scripted OpenAI-compatible server (it has no ``/admin`` of its own, as
vLLM has none); the contract is the plugin's real HTTP server and fault service, without an engine behind it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests
from kvstorm_vllm_faults.http_server import start_server
from kvstorm_vllm_faults.service import FaultService, Refusal, not_applicable_faults

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from tests.loadgen.conftest import scripted_server

TOKEN = "test-faults-token"


@pytest.fixture
def contract(request) -> Iterator[str]:
    """The URL of a plugin's contract: a working one, or (``indirect`` "refused") one that refused its vLLM."""
    if getattr(request, "param", "") == "refused":
        service = Refusal("this plugin was written for vLLM 0.32.0; this is vLLM 9.9")
    else:
        service = FaultService(not_applicable_faults(None), wake=lambda: None)
    server = start_server(service, TOKEN, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def chaos_run(experiment: str, target_url: str, faults_url: str, tmp_path) -> tuple[int, str]:
    command = [sys.executable, "-m", "kvstorm", "chaos", "run", experiment, "--target", target_url, "--model", "m",
               "--results-dir", str(tmp_path), f"--var=faults_url={faults_url}"]  # fmt: skip
    env = {**os.environ, ADMIN_TOKEN_ENV: TOKEN}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    (run_dir,) = tmp_path.iterdir()
    return result.returncode, (run_dir / "verdict.md").read_text().splitlines()[0]


@pytest.mark.parametrize(
    ("experiment", "reason"),
    [
        ("swap-pressure-slow-host-link", "sets swap_delay_per_block, which this engine cannot have: vLLM v1"),
        ("disconnect-storm-while-swapped", "aims at swapped requests, and this engine has no swap to cap: vLLM v1"),
    ],
)
def test_a_fault_vllm_cannot_have_is_not_applicable_with_the_plugins_reason(contract, experiment, reason, tmp_path):
    with scripted_server() as server:
        code, headline = chaos_run(experiment, server.base_url, contract, tmp_path)
        received = requests.get(f"{server.base_url}/script-log", timeout=10).json()
    assert code == 2
    assert "NOT APPLICABLE" in headline
    assert reason in headline
    assert "has no swap: it preempts by recompute" in headline
    assert received == []  # no baseline, no load


@pytest.mark.parametrize("contract", ["refused"], indirect=True)
def test_a_plugin_that_refused_its_vllm_makes_every_engine_fault_experiment_not_applicable(contract, tmp_path):
    with scripted_server() as server:
        code, headline = chaos_run("burst-with-vram-cap", server.base_url, contract, tmp_path)
        received = requests.get(f"{server.base_url}/script-log", timeout=10).json()
    assert code == 2
    assert f"the fault contract at {contract}/admin/faults refuses: this plugin was written for vLLM 0.32.0" in headline
    assert received == []
