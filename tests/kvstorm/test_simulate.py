"""``kvstorm simulate`` as a user runs it: a profile fitted to a real ``kvstorm serve`` of the bundled model on this
machine, a simulated run with faults written as the results file and report of a real run, and clear errors for what
it cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources

import pytest

from loadgen.plan import plan_run
from loadgen.records import Outcome
from loadgen.results import RunResult


def run_kvstorm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstorm", *args], capture_output=True, text=True, timeout=600, check=False
    )


LOAD = ("--arrival", "poisson:rate=40", "--duration", "30s", "--input-len", "uniform:200-2000")


def test_a_simulated_run_with_faults_writes_a_real_runs_results_and_report(tmp_path):
    result = run_kvstorm(
        "simulate", "run", "--profile", "h200-llama-3-8b", *LOAD, "--output-len", "uniform:100-600",
        "--num-kv-blocks", "3000", "--fault", '5s-15s kv_cap={"fraction": 0.3}', "--fault", "20s-22s kill",
        "--slo", "ttft_p99=2s", "--ttft-slo", "off", "--results-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (results_path,) = tmp_path.glob("simulate-*.json")
    run = RunResult.read(results_path)
    # The same plan as `kvstorm bench serve` with these options: every planned request, at its planned instant.
    planned = plan_run(run.config).requests
    assert [r.scheduled_s for r in run.records] == [p.offset_s for p in planned]
    assert [r.requested_output_tokens for r in run.records] == [p.max_tokens for p in planned]
    outcomes = run.summary.outcomes
    assert outcomes[Outcome.BROKEN_STREAM] > 0, "the kill at 20 s must break the streams in the engine"
    assert outcomes[Outcome.REJECTED] > 0, "requests arriving while it is down are refused"
    assert all(r.output_tokens == r.requested_output_tokens for r in run.records if r.outcome is Outcome.OK)
    assert all(20.0 <= r.sent_s <= 22.0 for r in run.records if r.outcome is Outcome.REJECTED)
    series = {s.name: s.points for s in run.prometheus}
    assert max(v for _, v in series["preemptions/s"]) > 0, "a 30% cap on 3000 blocks under this load preempts"
    assert [w.name for w in run.fault_windows] == ["kv_cap", "kill"]
    assert "Simulated, not measured" in run.advisories[0]
    assert run.summary.slos[0].met is not None
    assert "preemptions" in result.stdout
    (report,) = tmp_path.glob("simulate-*.html")
    assert "Simulated, not measured" in report.read_text()


def test_a_fleet_with_a_kv_cap_on_some_replicas_reports_the_fleet(tmp_path):
    result = run_kvstorm(
        "simulate", "run", "--profile", "h200-llama-3-8b", "--arrival", "poisson:rate=200", "--duration", "20s",
        "--input-len", "uniform:200-2000", "--output-len", "uniform:100-600", "--num-kv-blocks", "1500",
        "--replicas", "8", "--router", "least-outstanding", "--fault", '5s-15s@0-1 kv_cap={"fraction": 0.2}',
        "--ttft-slo", "off", "--results-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = RunResult.read(next(tmp_path.glob("simulate-*.json")))
    assert [w.name for w in run.fault_windows] == ["kv_cap on 2 of 8 replicas"]
    assert any("8 replicas" in note and "least-outstanding" in note for note in run.advisories)
    assert len(run.records) == len(plan_run(run.config).requests)
    series = {s.name: s.points for s in run.prometheus}
    assert max(v for _, v in series["running"]) > 30, "requests summed over the fleet"
    assert max(v for _, v in series["preemptions/s"]) > 0


def test_admission_sheds_an_overload_as_the_server_would_and_the_admitted_meet_the_objective(tmp_path):
    args = (
        "simulate", "run", "--profile", "h200-llama-3-8b", "--arrival", "poisson:rate=40", "--duration", "20s",
        "--input-len", "uniform:200-2000", "--output-len", "uniform:100-600", "--num-kv-blocks", "3000",
    )  # fmt: skip
    runs = {}
    for name, options in (
        ("2s", ("--ttft-slo", "2s")),
        ("off", ("--ttft-slo", "off")),
        ("retries", ("--ttft-slo", "2s", "--retries", "2")),
    ):
        result = run_kvstorm(*args, *options, "--results-dir", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        runs[name] = RunResult.read(next((tmp_path / name).glob("simulate-*.json")))
    guarded, unguarded, retrying = runs["2s"], runs["off"], runs["retries"]
    assert unguarded.summary.outcomes[Outcome.REJECTED] == 0
    assert unguarded.summary.ttft.p99 > 10.0, "the load must overload the engine"
    refused = [r for r in guarded.records if r.outcome is Outcome.REJECTED]
    assert len(refused) > 100
    assert all(r.http_status == 429 and "server busy" in r.error for r in refused)
    assert guarded.summary.outcomes[Outcome.OK] > 100
    assert guarded.summary.ttft.p99 <= 2.0, "the admitted requests meet the objective"
    assert "TTFT objective 2 s" in guarded.advisories[0]
    assert "Admission off" in unguarded.advisories[0]
    # Clients that send a refused request again after its Retry-After, twice at most, as OpenAI's SDK does: more end
    # ok, and their TTFT runs from the first send (the objective holds from each admitted send only).
    came_back = [r for r in retrying.records if r.attempts > 1]
    assert {r.attempts for r in retrying.records} <= {1, 2, 3}
    assert retrying.summary.outcomes[Outcome.OK] > guarded.summary.outcomes[Outcome.OK]
    assert any(r.outcome is Outcome.OK and r.ttft_s > 2.0 for r in came_back)
    assert "up to 2 times" in retrying.advisories[0]


def test_the_same_seed_simulates_the_same_run(tmp_path):
    # Admission on (kvstorm serve's default objective): its decisions are part of what must repeat.
    args = (
        "simulate", "run", "--profile", "h100x8-llama-3-70b", "--arrival", "poisson:rate=40", "--duration", "15s",
        "--input-len", "uniform:200-2000", "--num-kv-blocks", "2000",
    )  # fmt: skip
    first = run_kvstorm(*args, "--results-dir", str(tmp_path / "a"))
    second = run_kvstorm(*args, "--results-dir", str(tmp_path / "b"))
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    records = [
        [r.model_dump() for r in RunResult.read(next((tmp_path / d).glob("*.json"))).records] for d in ("a", "b")
    ]
    assert records[0] == records[1]
    assert any(r["outcome"] == Outcome.REJECTED for r in records[0]), "the load must meet admission"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--fault", "10s-5s kill"), "start < end"),
        (("--fault", '1s-2s kv_cap={"fraction": 3}'), "fraction"),
        (("--fault", "1s-2s step_delay=forever"), "fault '1s-2s step_delay=forever'"),
        (("--fault", "soon kill"), "not a fault window"),
        (("--workload", "chat"), "token ids"),
        (("--workload", "multiturn:turns=2,system_len=100", "--tokenizer", "/no/such.gguf"), "no such file"),
        (("--profile", "no-such-profile"), "no profile"),
        (("--replicas", "4", "--fault", "1s-2s@9 kill"), "not among 0-3"),
        (("--fault", "1s-2s@x kill"), "not a fault window"),
        (("--num-kv-blocks", "100000000000"), "less than or equal to 10000000"),
        (("--replicas", "100000"), "not a number of replicas"),
        (("--retries", "99"), "must be in 0-10"),
    ],
)
def test_what_it_cannot_do_is_refused_with_a_clear_error(tmp_path, args, message):
    base = ["simulate", "run", "--profile", "h200-llama-3-8b", "--num-requests", "5", "--results-dir", str(tmp_path)]
    result = run_kvstorm(*base, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_profile_whose_memory_derives_too_many_blocks_is_refused_before_any_is_made(tmp_path):
    # 1e18 bytes of GPU memory: 429 billion blocks of Llama-3-8B, which the simulator once tried to allocate.
    profile = json.loads((resources.files("kvstorm.simulate") / "profiles/h200-llama-3-8b.json").read_text())
    profile["gpu"]["memory_bytes"] = 1e18
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(profile))
    result = run_kvstorm("simulate", "run", "--profile", str(path), "--num-requests", "5",
                         "--results-dir", str(tmp_path / "results"))  # fmt: skip
    assert result.returncode == 2
    assert "429,153,433,771 KV blocks" in result.stderr
    assert "1 to 10,000,000 (MAX_BLOCKS" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "results").exists()
    # The pool given outright takes the place of the derived one.
    given = run_kvstorm("simulate", "run", "--profile", str(path), "--num-requests", "5", "--num-kv-blocks", "3000",
                        "--results-dir", str(tmp_path / "results"))  # fmt: skip
    assert given.returncode == 0, given.stderr


def test_a_multi_turn_run_sends_each_turn_after_its_answer_with_the_conversation_cached(tmp_path, real_source):
    result = run_kvstorm(
        "simulate", "run", "--profile", "h200-llama-3-8b", "--workload", "multiturn:turns=3,system_len=200,think_s=2",
        "--arrival", "poisson:rate=1", "--num-requests", "10", "--input-len", "uniform:30-90",
        "--output-len", "uniform:20-60", "--tokenizer", str(real_source.path), "--results-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = RunResult.read(next(tmp_path.glob("simulate-*.json")))
    assert run.summary.sessions.completed == 10
    assert [turn.num_ok for turn in run.summary.turns] == [10, 10, 10]
    sessions = {}
    for record in run.records:
        sessions.setdefault(record.session, {})[record.turn] = record
    for turns in sessions.values():
        for turn in (2, 3):
            previous, record = turns[turn - 1], turns[turn]
            assert record.scheduled_s == pytest.approx(previous.end_s + 2.0), "sent the think time after the answer"
            # The conversation so far (the previous prompt and answer) leads the prompt, and is found cached: every
            # full block of it whose KV was computed (all but the answer's last token's).
            assert record.shared_prefix_tokens == previous.prompt_tokens + previous.output_tokens
            assert record.prompt_tokens > record.shared_prefix_tokens
            assert record.cached_tokens == (record.shared_prefix_tokens - 1) // 16 * 16
    # Counted with the model's own chat template: the system prompt, the user message and SmolLM2's framing.
    tokenizer = real_source.load_tokenizer()
    first = next(r for r in run.records if r.session == 0 and r.turn == 1)
    plan = plan_run(run.config).sessions
    messages = [
        {"role": "system", "content": plan.system_prompt},
        {"role": "user", "content": plan.sessions[0].user_messages[0]},
    ]
    assert first.prompt_tokens == len(tokenizer.apply_chat_template(messages))
    assert any("chat template and tokenizer of SmolLM2" in note for note in run.advisories)


def test_a_profile_fitted_on_the_real_engine_drives_a_simulated_run(tmp_path):
    profile_path = tmp_path / "profile.json"
    fitted = run_kvstorm(
        "simulate", "profile", "--server-args", "--num-kv-blocks 256 --swap-space 64MiB", "--concurrency", "1,4,8",
        "--out", str(profile_path),
    )  # fmt: skip
    assert fitted.returncode == 0, fitted.stderr
    profile = json.loads(profile_path.read_text())
    assert profile["kind"] == "fitted"
    assert profile["engine"]["num_kv_blocks"] == 256
    assert profile["fit"]["num_steps"] > 50
    # Least squares over relative errors: the steps' summed time is what a throughput prediction rests on.
    assert profile["fit"]["total_relative_error"] < 0.25
    assert profile["cost"]["per_step_s"] + profile["cost"]["per_decode_s"] > 0
    assert all(value >= 0 for value in profile["cost"].values())
    assert "smollm2" in profile["measured_on"]["model"]
    assert 0 <= profile["token_latency_s"] < 1.0
    simulated = run_kvstorm(
        "simulate", "run", "--profile", str(profile_path), "--arrival", "poisson:rate=2", "--num-requests", "20",
        "--results-dir", str(tmp_path),
    )  # fmt: skip
    assert simulated.returncode == 0, simulated.stderr
    run = RunResult.read(next(tmp_path.glob("simulate-*.json")))
    assert run.summary.outcomes[Outcome.OK] == 20
    assert run.config.model == "smollm2-135m"
