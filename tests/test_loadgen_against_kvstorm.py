"""The load generator against the real kvstorm server: every stream arrives whole and the numbers agree.

``loadgen`` knows nothing of the engine; this is the one place where the two meet, as a user would run them:
``kvstorm serve``'s app on a loopback port with the real model, ``kvstorm bench serve`` in its own process.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import requests

from engine.core.admission import AdmissionLimits
from loadgen.arrivals import Arrival
from loadgen.client import StreamingClient
from loadgen.records import Outcome
from loadgen.results import RunResult
from loadgen.sessions import Conversation, build_sessions
from tests.engine.serving.conftest import make_engine, metric_value, running_server
from tests.loadgen.conftest import run_bench_serve, run_bench_serve_with_output

OUTPUT_TOKENS = 6


def test_bench_serve_streams_exact_outputs_from_kvstorm(real_model, real_tokenizer, tmp_path):
    with running_server(make_engine(real_model, real_tokenizer, max_num_seqs=8)) as server:
        for workload, input_len in (("random:low=1000,high=30000", "uniform:8-64"), ("chat", "uniform:16-48")):
            results_dir = tmp_path / workload.split(":")[0]
            json_path = run_bench_serve(
                server.url,
                results_dir,
                "--model", "smollm2-135m", "--workload", workload, "--input-len", input_len,
                "--output-len", f"fixed:{OUTPUT_TOKENS}", "--arrival", "poisson:rate=20", "--num-requests", "10",
                "--request-timeout", "60s", "--stall-timeout", "30s",
            )  # fmt: skip
            result = RunResult.read(json_path)
            assert [r.outcome for r in result.records] == [Outcome.OK] * 10, [r.error for r in result.records]
            # ignore_eos + min_tokens made every output exactly as long as asked; the client counted every token.
            assert {r.output_tokens for r in result.records} == {OUTPUT_TOKENS}
            assert all(r.finish_reason == "length" for r in result.records)
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        assert metric_value(metrics, "vllm:request_success_total", finished_reason="length") == 20
        assert metric_value(metrics, "vllm:generation_tokens_total") == 20 * OUTPUT_TOKENS


def test_multiturn_sessions_send_the_conversation_back_and_the_prefix_cache_serves_it(
    real_model, real_tokenizer, tmp_path
):
    """Three sessions of three turns: each turn's prompt holds the previous turn's prompt and streamed answer (its
    prompt grows by more than the answer), leaves after that answer, and is served mostly from kvstorm's prefix
    cache; per-turn results and session counts come out."""
    with running_server(make_engine(real_model, real_tokenizer, max_num_seqs=8)) as server:
        json_path = run_bench_serve(
            server.url, tmp_path,
            "--model", "smollm2-135m", "--workload", "multiturn:turns=3,system_len=60", "--input-len", "fixed:8",
            "--output-len", "fixed:4", "--arrival", "poisson:rate=5", "--num-requests", "3",
            "--extra-body", '{"temperature": 0}', "--request-timeout", "60s",
        )  # fmt: skip
    result = RunResult.read(json_path)
    assert [(r.session, r.turn) for r in result.records] == [(s, t) for s in range(3) for t in (1, 2, 3)]
    assert all(r.outcome is Outcome.OK for r in result.records), [r.error for r in result.records]
    for session in range(3):
        turns = [r for r in result.records if r.session == session]
        for before, after in itertools.pairwise(turns):
            assert after.scheduled_s >= before.end_s
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
            assert after.shared_prefix_tokens == before.prompt_tokens + before.output_tokens
            assert after.cached_tokens >= (before.prompt_tokens + before.output_tokens) // 16 * 16 - 16
    summary = result.summary
    sessions = summary.sessions
    assert (sessions.num_sessions, sessions.num_turns, sessions.completed, sessions.cut_short) == (3, 3, 3, 0)
    session_spans = [
        max(r.end_s for r in result.records if r.session == s) - min(r.sent_s for r in result.records if r.session == s)
        for s in range(3)
    ]
    assert sessions.duration.max == max(session_spans)
    assert [(t.turn, t.num_sent, t.num_ok) for t in summary.turns] == [(1, 3, 3), (2, 3, 3), (3, 3, 3)]
    assert summary.prefix_reuse.measured_fraction > 0.5
    assert "TTFT by turn (ms)" in json_path.with_suffix(".html").read_text()


def test_each_turn_sends_exactly_the_conversation_so_far_with_its_answers_as_they_streamed(real_model, real_tokenizer):
    """Turn k's prompt as the server counts it (its usage) is the chat template over the system prompt, every earlier
    question with its answer as it streamed, and the new question: nothing dropped, nothing added."""
    plan = build_sessions([Arrival(0.0)], "multiturn:turns=4,system_len=40", input_len="fixed:8", output_len="fixed:5")
    conversation = Conversation(plan, plan.sessions[0])

    async def converse(url: str) -> list:
        sent = []
        async with StreamingClient(
            url, "smollm2-135m", request_timeout_s=60, stall_timeout_s=30, extra_body={"temperature": 0}
        ) as client:
            for turn in range(plan.num_turns):
                request = conversation.request(turn, 0.0)
                record, answer = await client.send_for_text(
                    request, request_id=f"turn-{turn}", run_start_ts=time.perf_counter()
                )
                assert record.outcome is Outcome.OK, record.error
                sent.append((record, request.body["messages"], answer))
                conversation.add_answer(record, answer)
        return sent

    with running_server(make_engine(real_model, real_tokenizer)) as server:
        sent = asyncio.run(converse(server.url))
    for turn, (record, messages, _) in enumerate(sent):
        assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * turn + ["user"]
        assert [m["content"] for m in messages[2::2]] == [answer for _, _, answer in sent[:turn]]
        assert record.prompt_tokens == len(real_tokenizer.apply_chat_template(messages))
        assert record.output_tokens == 5
    for (before, _, _), (after, _, _) in itertools.pairwise(sent):
        assert after.prompt_tokens > before.prompt_tokens + before.output_tokens


def test_a_turn_the_server_refuses_ends_its_session(real_model, real_tokenizer, tmp_path):
    """A context so short that every session's third turn is refused (HTTP 400): no session sends a fourth."""
    args = (
        "--model", "smollm2-135m", "--workload", "multiturn:turns=4,system_len=60", "--input-len", "fixed:8",
        "--output-len", "fixed:4", "--arrival", "poisson:rate=5", "--num-requests", "2",
        "--extra-body", '{"temperature": 0}', "--request-timeout", "60s",
    )  # fmt: skip
    with running_server(make_engine(real_model, real_tokenizer)) as server:
        full = RunResult.read(run_bench_serve(server.url, tmp_path / "full", *args))
    second_turns = [r.prompt_tokens + r.output_tokens for r in full.records if r.turn == 2]
    with running_server(make_engine(real_model, real_tokenizer, max_model_len=max(second_turns))) as server:
        short = RunResult.read(run_bench_serve(server.url, tmp_path / "short", *args))
    assert [(r.turn, r.outcome, r.http_status) for r in short.records if r.session == 0] == [
        (1, Outcome.OK, 200),
        (2, Outcome.OK, 200),
        (3, Outcome.REJECTED, 400),
    ]
    sessions = short.summary.sessions
    assert (sessions.num_sessions, sessions.num_turns, sessions.completed, sessions.cut_short) == (2, 4, 0, 2)
    assert sessions.duration is None  # no session completed


def test_a_shared_prefix_workload_says_what_reuse_it_offers_and_what_the_server_served(
    real_model, real_tokenizer, tmp_path
):
    """And a second run with the same seed into the same server, whose cache the first one warmed, is told so."""
    args = (
        "--model", "smollm2-135m", "--workload", "shared-prefix:num_prefixes=2,prefix_len=64",
        "--input-len", "fixed:16", "--output-len", "fixed:2", "--arrival", "constant:rate=4",
        "--num-requests", "8", "--request-timeout", "60s",
    )  # fmt: skip
    with running_server(make_engine(real_model, real_tokenizer, max_num_seqs=8)) as server:
        json_path, printed = run_bench_serve_with_output(server.url, tmp_path / "cold", *args)
        _, printed_again = run_bench_serve_with_output(server.url, tmp_path / "warm", *args)
    assert "the cache was warm from earlier traffic" not in printed
    assert "The run's first request was served 64 of its prompt tokens" in printed_again
    result = RunResult.read(json_path)
    reuse = result.summary.prefix_reuse
    assert reuse.prompt_tokens == 8 * 80
    assert reuse.shareable_tokens == 6 * 64  # every request but the first of each prefix
    assert f"{reuse.shareable_tokens} of its {reuse.prompt_tokens} prompt tokens" in printed
    # One request at a time: each after the first of its prefix finds its 4 blocks of 16 cached.
    assert reuse.cached_tokens == reuse.shareable_tokens
    assert f"Prefix reuse: {reuse.shareable_tokens / reuse.prompt_tokens:.1%} of 640 prompt tokens" in printed
    assert "the server says it served 60.0%" in printed


def test_a_client_that_retries_after_a_429_comes_back_when_told_and_is_admitted(real_model, real_tokenizer, tmp_path):
    """One request at a time, one more allowed to wait: of a burst of six, four are refused with 429 and a Retry-After.
    With retries each comes back after it and all six end ok, their TTFT from the first send; without, the four end
    refused."""
    args = (
        "--model", "smollm2-135m", "--input-len", "fixed:16", "--output-len", "fixed:4",
        "--arrival", "constant:rate=200", "--num-requests", "6", "--request-timeout", "60s",
    )  # fmt: skip
    limits = AdmissionLimits(max_waiting=1)
    with running_server(make_engine(real_model, real_tokenizer, max_num_seqs=1), limits=limits) as server:
        once = RunResult.read(run_bench_serve(server.url, tmp_path / "once", *args))
        json_path, printed = run_bench_serve_with_output(server.url, tmp_path / "retrying", *args, "--retries", "5")
        retrying = RunResult.read(json_path)
        metrics = requests.get(server.url + "/metrics", timeout=10).text
    refused = [r for r in once.records if r.outcome is Outcome.REJECTED]
    assert len(refused) >= 3
    assert {r.http_status for r in refused} == {429}
    assert {r.attempts for r in once.records} == {1}
    assert [r.outcome for r in retrying.records] == [Outcome.OK] * 6, [r.error for r in retrying.records]
    came_back = [r for r in retrying.records if r.attempts > 1]
    assert len(came_back) >= 3
    assert all(r.ttft_s >= 1.0 for r in came_back), "a retry waits its Retry-After (1 s at least), from the first send"
    assert metric_value(metrics, "kvstorm:rejected_requests_total", reason="max_waiting") == len(refused) + sum(
        r.attempts - 1 for r in retrying.records
    ), "every refusal the server counted is one the clients saw, and each retry followed one"
    assert f"{len(came_back)} requests were sent again after a 429 or 503" in printed
