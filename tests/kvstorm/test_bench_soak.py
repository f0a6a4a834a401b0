"""``kvstorm bench soak``: what it judges a leak (from readings made up to show each), and a short soak of the real
server with every fault of its cycle, to its verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

from kvstorm.bench.soak import MAX_RSS_GROWTH_MB, MAX_THREAD_GROWTH, SoakSample, judge
from loadgen.analysis import summarize
from loadgen.records import Outcome, RequestRecord
from loadgen.results import RunConfig, RunResult
from tests.loadgen.conftest import REPO_ROOT, child_env

IDLE = SoakSample(0, "idle", 1000.0, 7, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, "")


def readings(rss_mb: list[float], threads: int = 12) -> list[SoakSample]:
    """An idle reading, one under load every 10 s with these RSS values, and a settled one."""
    loaded = [
        replace(IDLE, t_s=10.0 * (i + 1), phase="load", rss_mb=rss, threads=threads) for i, rss in enumerate(rss_mb)
    ]
    return [IDLE, *loaded, replace(loaded[-1], phase="settled")]


def load_result(outcomes: list[Outcome], cut_short: str | None = None) -> RunResult:
    records = [
        RequestRecord(index=i, request_id=str(i), scheduled_s=i, sent_s=i, outcome=outcome, e2e_s=1.0)
        for i, outcome in enumerate(outcomes)
    ]
    config = RunConfig(base_url="http://127.0.0.1:1", model="m", arrival="poisson:rate=1", workload="random",
                       input_len="fixed:1", output_len="fixed:1", num_requests=None, duration_s=60.0,
                       max_concurrency=None, request_timeout_s=60, stall_timeout_s=30, exact_output=True, seed=0,
                       slo=None)  # fmt: skip
    return RunResult(run_id="r", start_unix=0, start_ts=0, config=config, summary=summarize(records, 60.0),
                     records=records, cut_short=cut_short)  # fmt: skip


FLAT = [1100.0 + (i % 3) for i in range(30)]
GOOD = load_result([Outcome.OK] * 5 + [Outcome.REJECTED])


def test_a_flat_soak_holds():
    assert judge(readings(FLAT), 60.0, GOOD, 1.0, Counter({"400": 3})) == []


def test_memory_that_keeps_growing_after_the_warm_up_is_a_leak():
    growing = [1100.0 + 4 * i for i in range(30)]  # 4 MB every 10 s: the last fifth 96 MB above the first
    (failure,) = judge(readings(growing), 60.0, GOOD, 1.0, Counter())
    assert "resident memory grew by" in failure
    assert MAX_RSS_GROWTH_MB < 96


def test_growth_during_the_warm_up_alone_is_not():
    warming = [1000.0 + 20 * min(i, 6) for i in range(30)]  # 120 MB in the first minute, then flat
    assert judge(readings(warming), 70.0, GOOD, 1.0, Counter()) == []


def test_a_soak_too_short_to_judge_is_unmeasured_not_fine():
    (failure,) = judge(readings(FLAT[:7]), 60.0, GOOD, 1.0, Counter())
    assert failure.startswith("unmeasured")


def test_threads_open_files_and_held_blocks_each_fail_it():
    samples = readings(FLAT, threads=12)
    samples[2] = replace(samples[2], threads=15)  # a pool grown during the warm-up: not a leak
    samples[-5:-1] = [replace(s, threads=16 + MAX_THREAD_GROWTH) for s in samples[-5:-1]]
    samples[-1] = replace(samples[-1], open_files=40, used_blocks=3)
    failures = judge(samples, 60.0, GOOD, None, Counter())
    assert any(f"threads grew by {1 + MAX_THREAD_GROWTH}" in f for f in failures)
    assert any("40 open files at the end, 7 idle" in f for f in failures)
    assert any("not settled" in f and "3 device" in f for f in failures)


def test_a_lost_request_a_cut_run_and_a_5xx_to_a_hostile_client_each_fail_it():
    lossy = load_result([Outcome.OK, Outcome.BROKEN_STREAM, Outcome.CLIENT_TIMEOUT], cut_short="interrupted")
    failures = judge(readings(FLAT), 60.0, lossy, 1.0, Counter({"500": 2, "400": 9}))
    assert any("2 requests of the load lost (1 broken streams, 1 timeouts)" in f for f in failures)
    assert any("cut short: interrupted" in f for f in failures)
    assert any("2 of the hostile client's faults were answered with a 5xx" in f for f in failures)


def test_a_short_soak_of_the_real_server_runs_every_fault_to_its_verdict(tmp_path):
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "soak", "--duration", "75s", "--warmup", "31s"]
    command += ["--cycle", "30s", "--sample-every", "3s", "--rate", "1", "--burst-rate", "2"]
    command += ["--results-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=child_env(), cwd=REPO_ROOT,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "**HELD**" in result.stdout
    (details_path,) = tmp_path.glob("soak-*[0-9].json")
    details = json.loads(details_path.read_text())
    assert details["kv_caps"] == 2
    assert len(details["storms"]) == 2
    assert details["hostile_attempts"]["reset"] > 0
    assert details["hostile_attempts"]["idle_socket"] > 0
    assert {"400", "401"} <= set(details["hostile_answers"]), details["hostile_answers"]
    phases = [sample["phase"] for sample in details["samples"]]
    assert (phases[0], phases[-1]) == ("idle", "settled")
    assert phases.count("load") >= 20
    assert any(sample["faults"] == "kv_cap 0.5" for sample in details["samples"])
