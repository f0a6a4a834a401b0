"""A plan's size is known before it is built: the estimate against real plans of every workload, the issue's plans
refused without building them, and ``kvstorm bench serve`` refusing one before it sends anything unless --force."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import pytest

import loadgen.plan
from kvstorm.cli import main as kvstorm_main
from loadgen.arrivals import make_arrivals
from loadgen.plan import MAX_PLAN_TOKENS, PlanTooLarge, estimate_plan_size
from loadgen.workloads import build_plan
from tests.loadgen.conftest import child_env, scripted_server


def built_tokens(arrival: str, workload: str, input_len: str, output_len: str, duration_s: float) -> int:
    """Prompt tokens sent plus output tokens asked for, over the plan ``plan_run`` builds."""
    arrivals = make_arrivals(arrival, num_requests=None, duration_s=duration_s)
    plan = build_plan(arrivals, workload, input_len=input_len, output_len=output_len)
    return sum(len(request.body["prompt"]) + request.max_tokens for request in plan)


@pytest.mark.parametrize(
    ("arrival", "workload", "input_len", "output_len"),
    [
        ("constant:rate=5", "random", "fixed:100", "fixed:20"),
        ("constant:rate=5", "shared-prefix:num_prefixes=3,prefix_len=50", "fixed:10", "fixed:4"),
        ("poisson:rate=20", "random", "uniform:10-90", "normal:mean=30,std=10"),
        ("onoff:base=2,burst=20,burst_s=2,period_s=10", "random", "lognormal:median=40,sigma=0.5", "fixed:8"),
    ],
)
def test_the_estimate_is_the_size_of_the_plan_built(arrival, workload, input_len, output_len):
    size = estimate_plan_size(arrival, workload, input_len=input_len, output_len=output_len, duration_s=300)
    built = built_tokens(arrival, workload, input_len, output_len, duration_s=300)
    # Prefixes are held once beside the prompts that repeat them; the built prompts already count each repeat.
    held_once = size.num_prefixes * size.prefix_len
    if arrival.startswith("constant"):
        assert size.num_tokens - held_once == built
    else:
        assert size.num_tokens == pytest.approx(built, rel=0.05)


def test_a_trace_is_sized_by_its_own_count_and_lengths(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": index, "prompt_len": 100 * (index + 1), "output_len": 10} for index in range(5)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    size = estimate_plan_size(f"trace:path={trace}", "random", input_len="fixed:1", output_len="fixed:1")
    assert (size.num_requests, size.num_tokens) == (5, built_tokens(f"trace:path={trace}", "random", "fixed:1",
                                                                    "fixed:1", duration_s=1e9))  # fmt: skip


def test_multi_turn_sessions_count_every_turn_with_the_conversation_before_it():
    size = estimate_plan_size(
        "constant:rate=1", "multiturn:turns=4,system_len=64", input_len="fixed:32", output_len="fixed:16", duration_s=10
    )
    # Turn k of 4 sends the system prompt, k user messages of 32 and the k - 1 answers of 16 before it.
    per_session = sum(64 + 32 * k + 16 * (k - 1) for k in range(1, 5))
    assert size.num_requests == 10 * 4
    assert size.num_tokens == 10 * (per_session + 4 * 16)


def test_the_issues_plans_are_refused_by_their_product_without_being_built():
    tracemalloc.start()
    try:
        with pytest.raises(PlanTooLarge) as hour:
            estimate_plan_size(
                "poisson:rate=200", "random", input_len="fixed:32768", output_len="fixed:64", duration_s=3600
            ).check()
        with pytest.raises(PlanTooLarge) as prefixes:
            estimate_plan_size(
                "poisson:rate=1",
                "shared-prefix:num_prefixes=10000,prefix_len=32768",
                input_len="fixed:128",
                output_len="fixed:64",
                duration_s=60,
            ).check()
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 13 GB and 944 GB plans, sized in what a few lists of a spec's numbers take.
    assert peak_bytes < 10_000_000
    assert "720,001 requests x (32,768 prompt + 64 output tokens)" in str(hour.value)
    assert "10,000 prefixes x 32,768 tokens" in str(prefixes.value)
    assert f"{MAX_PLAN_TOKENS:,} tokens" in str(hour.value)
    estimate_plan_size("poisson:rate=20", "random", input_len="fixed:1024", output_len="fixed:256",
                       duration_s=600).check()  # fmt: skip


def test_bench_serve_refuses_a_plan_above_the_bound_before_it_sends_anything(tmp_path):
    with scripted_server() as server:
        command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", server.base_url,
                   "--model", "m", "--results-dir", str(tmp_path), "--no-progress", "--arrival", "poisson:rate=200",
                   "--duration", "3600s", "--input-len", "fixed:32768"]  # fmt: skip
        refused = subprocess.run(command, capture_output=True, text=True, timeout=120, env=child_env(), check=False)
        assert refused.returncode == 2, refused.stderr
        assert "720,001 requests x (32,768 prompt + 128 output tokens)" in refused.stderr
        assert "--force runs it anyway" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert server.script_log() == {}, "nothing was sent"
    assert not list(tmp_path.iterdir()), "no results file of a run that never started"


def test_bench_serve_force_runs_a_plan_above_the_bound(tmp_path, monkeypatch, capsys):
    # The bound lowered to 1,000 tokens, so that a plan above it is five small requests rather than 4 GB of them.
    monkeypatch.setattr(loadgen.plan, "MAX_PLAN_TOKENS", 1_000)
    with scripted_server("--gap-ms", "1") as server:
        argv = ["bench", "--no-docs", "serve", "--base-url", server.base_url, "--model", "m", "--no-progress",
                "--results-dir", str(tmp_path), "--arrival", "constant:rate=50", "--num-requests", "5",
                "--input-len", "fixed:200", "--output-len", "fixed:8"]  # fmt: skip
        assert kvstorm_main(argv) == 2
        assert "5 requests x (200 prompt + 8 output tokens) = 1,040 tokens" in capsys.readouterr().err
        assert server.script_log() == {}
        assert kvstorm_main([*argv, "--force"]) == 0
        assert len(server.script_log()) == 5
