"""Real trace formats replayed as arrivals: their times, windows, speed, scaled and clipped lengths (each said in
words), failed rows skipped and counted, and Mooncake's prefix blocks turned into prompts that share what the trace
shares."""

from __future__ import annotations

import json

import pytest

from loadgen.arrivals import make_arrivals
from loadgen.records import Outcome
from loadgen.results import RunResult
from loadgen.traces import replay
from loadgen.workloads import build_plan
from tests.loadgen.conftest import run_bench_serve, scripted_server


def arrivals_of(spec: str):
    return make_arrivals(spec, num_requests=None, duration_s=None)


def test_mooncake_blocks_become_prompts_that_share_exactly_the_blocks_the_trace_shares(tmp_path):
    trace = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 1000, "output_length": 20, "hash_ids": [0, 2]},
        {"timestamp": 1000, "input_length": 1400, "output_length": 30, "hash_ids": [0, 1, 3]},
    ]
    trace.write_text("\n".join(json.dumps(row) for row in rows))
    spec = f"trace:path={trace},speedup=2,length_scale=0.25,max_len=1000"
    arrivals = arrivals_of(spec)
    assert [(a.offset_s, a.prompt_len, a.output_len, a.block_len) for a in arrivals] == [
        (0.0, 250, 2, 128),
        (0.25, 250, 5, 128),
        (0.5, 350, 8, 128),
    ]
    plan = build_plan(arrivals, "random", input_len="fixed:1", output_len="fixed:1")
    first, second, third = (p.body["prompt"] for p in plan)
    assert [len(first), len(second), len(third)] == [250, 250, 350]
    assert second[:128] == first[:128]
    assert second[128:] != first[128:250]
    assert third[:250] == first
    assert [p.shared_prefix_tokens for p in plan] == [0, 128, 250]
    assert plan == build_plan(arrivals, "random", input_len="fixed:1", output_len="fixed:1")  # seeded
    description = replay(spec).description
    assert "(mooncake): 3 of its 3 requests" in description
    assert "replayed 2x as fast" in description
    assert "lengths scaled by 0.25 (prefix blocks of 128 tokens)" in description
    with pytest.raises(ValueError, match="needs --workload random"):
        build_plan(arrivals, "chat", input_len="fixed:1", output_len="fixed:1")


def test_azure_wall_clock_times_a_window_and_clipping_to_a_context(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:56.6805900,3000,200\n"
        "2023-11-16 18:16:46.6805900,100,10\n"
    )
    spec = f"trace:path={trace},start_s=4,duration_s=20,max_len=1024"
    arrivals = arrivals_of(spec)
    assert [(round(a.offset_s, 6), a.prompt_len, a.output_len) for a in arrivals] == [
        (0.314579, 396, 109),
        (6.0, 824, 200),  # clipped: its prompt gives way, its output stays
    ]
    description = replay(spec).description
    assert "(azure): 2 of its 4 requests" in description
    assert "window 4 s + 20 s of its time" in description
    assert "1 requests clipped to 1024 tokens (prompt + output)" in description


def test_burstgpt_failed_rows_are_skipped_and_counted(tmp_path):
    trace = tmp_path / "burst.csv"
    trace.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "10,ChatGPT,1087,0,1087,Conversation log\n"
        "13,GPT-4,417,276,693,Conversation log\n"
    )
    spec = f"trace:path={trace}"
    assert [(a.offset_s, a.prompt_len, a.output_len) for a in arrivals_of(spec)] == [(0.0, 472, 18), (8.0, 417, 276)]
    assert "(burstgpt): 2 of its 2 requests (1 failed rows skipped), at its own pace." in replay(spec).description


def test_a_trace_of_no_known_format_or_an_empty_window_is_refused(tmp_path):
    trace = tmp_path / "other.csv"
    trace.write_text("when,tokens\n1,2\n")
    with pytest.raises(ValueError, match="none of the formats"):
        arrivals_of(f"trace:path={trace}")
    good = tmp_path / "good.csv"
    good.write_text("timestamp,prompt_len,output_len\n1,4,2\n")
    with pytest.raises(ValueError, match="no request in the window"):
        arrivals_of(f"trace:path={good},start_s=10")
    with pytest.raises(ValueError, match="format='vidur'"):
        arrivals_of(f"trace:path={good},format=vidur")
    # A scale makes lengths the trace never had: the longest the run sends is said with it.
    with pytest.raises(ValueError, match="length_scale=100 needs max_len=N"):
        arrivals_of(f"trace:path={good},length_scale=100")
    assert [a.prompt_len for a in arrivals_of(f"trace:path={good},length_scale=100,max_len=300")] == [100]


def test_the_results_say_how_the_trace_was_replayed(tmp_path):
    trace = tmp_path / "burst.csv"
    trace.write_text("Timestamp,Request tokens,Response tokens\n0,16,4\n0.5,16,0\n1,16,4\n")
    with scripted_server("--ttft-ms", "5", "--gap-ms", "1") as server:
        json_path = run_bench_serve(server.base_url, tmp_path / "results", "--arrival", f"trace:path={trace},speedup=4")
    result = RunResult.read(json_path)
    assert [r.outcome for r in result.records] == [Outcome.OK, Outcome.OK]
    assert result.advisories[0] == (
        "Trace burst.csv (burstgpt): 2 of its 2 requests (1 failed rows skipped), replayed 4x as fast."
    )
