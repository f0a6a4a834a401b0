"""Every engine fault on the real model under concurrent streaming load, set and cleared through /admin/faults.

Each case streams the same greedy requests as a fault-free reference run: every stream must end cleanly with the
reference's text (bit-identical with swap; with recompute a divergence is allowed only where the reference's top-2
log-probabilities are within MARGIN), every block must be free after the drain, and the counters that the fault
should move must have moved.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import requests

from tests.engine.serving.conftest import make_engine, metric_value, running_server, wait_until

MODEL = "smollm2-135m"
TEXT = (
    "Virtual memory freed programmers from counting every cell by splitting memory into pages and mapping them on "
    "demand, so that a program saw one contiguous address space while its pages lived wherever the system found "
    "room. The same idea came back to serve language models, whose attention cache grows token by token."
)
NUM_STREAMS = 6
MAX_TOKENS = 24
NUM_BLOCKS = 40  # enough for every stream at once: the reference run needs no preemption
MARGIN = 1e-4


@dataclass
class Stream:
    tokens: list[str]
    top_logprobs: list[dict[str, float]]
    finish_reason: str | None
    saw_done: bool

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def stream_all(url: str, prompts: list[list[int]]) -> list[Stream]:
    """Every prompt as a concurrent greedy stream with the top-2 logprobs of each token."""
    streams: list[Stream | None] = [None] * len(prompts)

    def read(index: int) -> None:
        body = {"model": MODEL, "prompt": prompts[index], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 2, "stream": True}  # fmt: skip
        stream = Stream([], [], None, False)
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as response:
            assert response.status_code == 200, response.text
            for line in response.iter_lines():
                if not line:
                    continue
                data = line.decode().removeprefix("data: ")
                if data == "[DONE]":
                    stream.saw_done = True
                    continue
                choice = json.loads(data)["choices"][0]
                stream.finish_reason = choice["finish_reason"] or stream.finish_reason
                if choice["logprobs"]:
                    stream.tokens += choice["logprobs"]["tokens"]
                    stream.top_logprobs += choice["logprobs"]["top_logprobs"]
        streams[index] = stream

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return streams


def assert_same_as_reference(streams: list[Stream], reference: list[Stream], allow_near_ties: bool) -> None:
    for ours, expected in zip(streams, reference, strict=True):
        assert (ours.finish_reason, ours.saw_done, len(ours.tokens)) == ("length", True, MAX_TOKENS)
        if ours.tokens == expected.tokens:
            continue
        position = next(i for i, (a, b) in enumerate(zip(ours.tokens, expected.tokens, strict=True)) if a != b)
        best, second = sorted(expected.top_logprobs[position].values(), reverse=True)[:2]
        print(f"diverged at output position {position}: reference top-2 margin {best - second:.2e}")
        assert allow_near_ties, "with swap (or no preemption) the output must be bit-identical"
        assert best - second < MARGIN, f"diverged at {position} with a clear margin {best - second:.2e}"


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    # Swap, so that preemption under a cap keeps outputs bit-identical; recompute only when the host pool is capped.
    engine = make_engine(real_model, real_tokenizer, num_blocks=NUM_BLOCKS, num_host_blocks=64, preemption_mode="swap")
    with running_server(engine, MODEL, stall_timeout_s=1.0) as running:
        yield running


@pytest.fixture(scope="module")
def prompts(real_tokenizer) -> list[list[int]]:
    ids = real_tokenizer.encode(TEXT)
    return [ids[i * 3 : i * 3 + 40 + 4 * i] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def reference(server, prompts) -> list[Stream]:
    return stream_all(server.url, prompts)


def set_faults(server, faults: dict) -> dict:
    response = requests.post(f"{server.url}/admin/faults", json=faults, headers=server.admin_headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def clear_faults(server) -> dict:
    return requests.delete(f"{server.url}/admin/faults", headers=server.admin_headers, timeout=60).json()


def scrape(server) -> str:
    return requests.get(f"{server.url}/metrics", timeout=30).text


def moved(before: str, after: str, name: str, **labels: str) -> float:
    return metric_value(after, name, **labels) - metric_value(before, name, **labels)


CAP = {"kv_cap": {"fraction": 0.3}}  # 12 of 40 blocks: two streams at a time


@pytest.mark.parametrize(
    ("faults", "allow_near_ties", "counters_moved"),
    [
        pytest.param(
            CAP,
            False,
            lambda b, a: (
                moved(b, a, "kvstorm:preemptions_total", mode="swap", reason="requested") > 0
                and moved(b, a, "kvstorm:swap_blocks_total", direction="out") > 0
            ),
            id="kv_cap",
        ),
        pytest.param(
            {**CAP, "swap_cap": {"blocks": 0}},
            True,
            lambda b, a: (
                moved(b, a, "kvstorm:preemptions_total", mode="recompute", reason="host_pool_full") > 0
                and moved(b, a, "kvstorm:swap_blocks_total", direction="out") == 0
            ),
            id="swap_cap",
        ),
        pytest.param(
            {**CAP, "swap_delay_per_block": 0.005},
            False,
            # Every swapped block took at least 5 ms more: the swap latency histogram says so.
            lambda b, a: (
                moved(b, a, "kvstorm:swap_latency_seconds_sum") >= 0.005 * moved(b, a, "kvstorm:swap_blocks_total")
            ),
            id="swap_delay_per_block",
        ),
        pytest.param(
            {"step_delay": 0.05},
            False,
            lambda b, a: (
                moved(b, a, "kvstorm:step_duration_seconds_sum")
                >= 0.05 * moved(b, a, "kvstorm:step_duration_seconds_count")
                > 0
            ),
            id="step_delay",
        ),
    ],
)
def test_streams_survive_each_engine_fault_with_reference_outputs_and_the_counters_move(
    server, prompts, reference, faults, allow_near_ties, counters_moved: Callable[[str, str], bool]
):
    before = scrape(server)
    values = set_faults(server, {**faults, "lease_s": 120})
    assert all(values[name] is not None for name in faults)
    during = scrape(server)
    for name in faults:
        assert metric_value(during, "kvstorm:active_faults", fault=name) == 1
    streams = stream_all(server.url, prompts)
    after = scrape(server)
    clear_faults(server)
    assert_same_as_reference(streams, reference, allow_near_ties)
    assert counters_moved(before, after)
    drained = scrape(server)
    for pool in ("device", "host"):
        assert metric_value(drained, "kvstorm:free_blocks", pool=pool) == metric_value(
            drained, "kvstorm:total_blocks", pool=pool
        )
    assert metric_value(drained, "kvstorm:kv_cap_fraction", pool="device") == 1
    assert not any(metric_value(drained, "kvstorm:active_faults", fault=name) for name in faults)


def test_a_freeze_stalls_health_while_streams_wait_and_everything_resumes_by_itself(server, prompts, reference):
    results: list[list[Stream]] = []
    reader = threading.Thread(target=lambda: results.append(stream_all(server.url, prompts)))
    reader.start()
    wait_until(lambda: requests.get(f"{server.url}/admin/stats", headers=server.admin_headers).json()["requests"],
               "the streams to start")  # fmt: skip
    frozen = set_faults(server, {"freeze": 3})
    assert frozen["freeze"] > 2
    assert frozen["active"] == ["freeze"]  # the server's word on which faults are on, which the harness reads
    health = f"{server.url}/health"
    stalled = wait_until(lambda: requests.get(health).status_code == 503, "/health to report the stall (1 s)")
    assert stalled
    assert metric_value(scrape(server), "kvstorm:active_faults", fault="freeze") == 1
    wait_until(lambda: requests.get(health).status_code == 200, "the freeze to end by itself", timeout_s=30)
    reader.join(300)
    assert_same_as_reference(results[0], reference, allow_near_ties=False)
    assert metric_value(scrape(server), "kvstorm:active_faults", fault="freeze") == 0


def test_a_kv_cap_on_a_full_pool_is_held_within_a_few_steps_by_preemption_and_loses_nothing(server, prompts):
    admin = server.admin_headers
    longer = [{"model": MODEL, "prompt": p, "max_tokens": 64, "ignore_eos": True, "stream": True} for p in prompts]
    finishes: list[str] = []

    def read(body: dict) -> None:
        with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=300) as response:
            lines = [line.decode() for line in response.iter_lines() if line]
        finishes.append(json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=read, args=(body,)) for body in longer]
    for thread in threads:
        thread.start()

    def stats() -> dict:
        return requests.get(f"{server.url}/admin/stats", headers=admin).json()["stats"]

    wait_until(lambda: stats()["num_used_device_blocks"] >= 0.9 * NUM_BLOCKS, "the pool to fill", timeout_s=120)
    requests.post(f"{server.url}/admin/pause", headers=admin)
    set_faults(server, {"kv_cap": {"fraction": 0.3}})
    full = stats()
    assert full["num_used_device_blocks"] > full["num_device_blocks"] == 12
    requests.post(f"{server.url}/admin/step?num_steps=2", headers=admin)
    capped = stats()
    assert capped["num_used_device_blocks"] <= 12
    assert capped["num_swapped"] + capped["num_waiting"] > 0, "the blocks were reclaimed by preemption"
    requests.post(f"{server.url}/admin/resume", headers=admin)
    for _ in range(20):
        assert stats()["num_used_device_blocks"] <= 12
        time.sleep(0.05)
    clear_faults(server)
    for thread in threads:
        thread.join(300)
    assert finishes == ["length"] * NUM_STREAMS


def test_memory_hog_is_refused_on_the_cpu_with_the_reason_and_what_to_use_instead(server):
    response = requests.post(
        f"{server.url}/admin/faults", json={"memory_hog": 1 << 30, "step_delay": 1}, headers=server.admin_headers
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "needs a CUDA device" in message
    assert "kv_cap" in message
    assert clear_faults(server)["step_delay"] == 0  # nothing of the refused body applied


def test_a_lease_that_is_not_renewed_clears_every_fault(server):
    values = set_faults(server, {"kv_cap": {"fraction": 0.5}, "step_delay": 0.01, "lease_s": 0.5})
    assert 0 < values["lease_s"] <= 0.5
    cleared = wait_until(
        lambda: (
            (faults := requests.get(f"{server.url}/admin/faults", headers=server.admin_headers).json())["kv_cap"]
            is None
            and faults
        ),
        "the lease to run out",
        timeout_s=10,
    )
    assert (cleared["step_delay"], cleared["lease_s"]) == (0, None)
    assert metric_value(scrape(server), "kvstorm:kv_cap_fraction", pool="device") == 1
