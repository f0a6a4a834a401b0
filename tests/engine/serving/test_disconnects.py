"""20 concurrent streams on the real model; 6 clients hang up at chosen phases, the other 14 are untouched.

The engine is paused and walked one step at a time (``/admin/step``), so each hang-up lands
exactly in the phase it is meant for: before the next step, the victim's connection is
closed and the test waits until the server has queued its abort.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import pytest
import requests

from tests.engine.serving.conftest import make_engine, metric_value, running_server

MODEL = "smollm2-135m"
TEXT = (
    "The history of computing is a story of memory. Early machines stored a few thousand words in "
    "mercury delay lines and magnetic drums; programmers counted every cell. Virtual memory freed them "
    "from that accounting by splitting memory into pages and mapping them on demand, so that a program "
    "saw one contiguous address space while its pages lived wherever the system found room."
)
NUM_STREAMS = 20
NUM_BLOCKS, NUM_HOST_BLOCKS = 16, 64  # 256 tokens for 8 running requests of up to ~100: preemption by swap
# Which live request each hang-up picks, from the engine's own view of it (/admin/stats).
VICTIMS: dict[str, Callable[[dict], bool]] = {
    "queued": lambda r: r["phase"] == "queued" and r["num_computed_tokens"] == 0,
    "prefill chunk": lambda r: r["phase"] == "prefill" and 0 < r["num_computed_tokens"] < r["num_prompt_tokens"],
    "first token": lambda r: r["phase"] == "decode" and r["num_output_tokens"] == 1,
    "mid-decode": lambda r: r["phase"] == "decode" and 3 <= r["num_output_tokens"] <= r["max_tokens"] - 3,
    "swapped": lambda r: r["phase"] == "swapped",
    "last token": lambda r: r["phase"] == "decode" and r["num_output_tokens"] == r["max_tokens"] - 1,
}
EXPECTED_ABORTS_BY_PHASE = {"queued": 1, "prefill": 1, "decode": 3, "swapped": 1}


@dataclass
class Stream:
    body: dict
    request_id: str | None = None
    text: str = ""
    finish_reason: str | None = None
    saw_done: bool = False
    task: asyncio.Task | None = None


async def consume(url: str, stream: Stream) -> None:
    """Read one SSE stream to [DONE]; cancelling the task closes its connection (a client hanging up)."""
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=stream.body) as response:
        stream.request_id = response.headers["X-Request-Id"]
        async for raw in response.content:
            line = raw.decode().strip()
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                stream.saw_done = True
                return
            choice = json.loads(data)["choices"][0]
            stream.text += choice["text"]
            stream.finish_reason = choice["finish_reason"]


class Admin:
    def __init__(self, session: aiohttp.ClientSession, server) -> None:
        self.session, self.url, self.headers = session, server.url, server.admin_headers

    async def stats(self) -> dict:
        async with self.session.get(f"{self.url}/admin/stats", headers=self.headers) as response:
            return await response.json()

    async def post(self, path: str) -> None:
        async with self.session.post(f"{self.url}/admin/{path}", headers=self.headers) as response:
            assert response.status == 200, await response.text()

    async def until(self, condition: Callable[[dict], bool], what: str) -> dict:
        for _ in range(6000):
            stats = await self.stats()
            if condition(stats):
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError(f"gave up waiting for {what}")


async def run_with_hang_ups(server, streams: list[Stream]) -> dict[str, Stream]:
    """Walk the engine step by step; before each step, hang up on a request in a phase not yet covered."""
    victims: dict[str, Stream] = {}
    async with aiohttp.ClientSession() as session:
        admin = Admin(session, server)
        await admin.post("pause")
        for stream in streams:
            stream.task = asyncio.create_task(consume(server.url, stream))
        await admin.until(lambda s: len(s["pending_adds"]) == NUM_STREAMS, "every request to arrive")
        by_id = {s.request_id: s for s in streams}
        for _ in range(2000):
            stats = await admin.stats()
            if not stats["requests"] and not stats["pending_adds"]:
                break
            cut = []
            for label, wanted in VICTIMS.items():
                taken = {v.request_id for v in victims.values()}
                candidates = [rid for rid, r in sorted(stats["requests"].items()) if rid not in taken and wanted(r)]
                if label not in victims and candidates:
                    victims[label] = by_id[candidates[0]]
                    victims[label].task.cancel()
                    cut.append(candidates[0])
            await admin.until(lambda s, cut=cut: set(cut) <= set(s["pending_aborts"]), f"aborts of {cut}")
            await admin.post("step")
        await admin.post("resume")
        await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
    return victims


def greedy_body(prompt_ids: list[int], max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    engine = make_engine(
        real_model,
        real_tokenizer,
        num_blocks=NUM_BLOCKS,
        num_host_blocks=NUM_HOST_BLOCKS,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        preemption_mode="swap",
        watermark=0.0,
    )
    with running_server(engine) as running:
        yield running


def test_hang_ups_in_every_phase_free_their_blocks_and_leave_the_other_streams_intact(server, real_tokenizer):
    rng = random.Random(5)
    ids = real_tokenizer.encode(TEXT + " " + TEXT)
    streams = []
    for _ in range(NUM_STREAMS):
        length = rng.randint(8, 90)
        start = rng.randint(0, len(ids) - length)
        streams.append(Stream(greedy_body(ids[start : start + length], rng.randint(6, 12)) | {"stream": True}))

    victims = asyncio.run(run_with_hang_ups(server, streams))

    assert sorted(victims) == sorted(VICTIMS), f"phases never seen: {set(VICTIMS) - set(victims)}"
    stats = requests.get(f"{server.url}/admin/stats", headers=server.admin_headers).json()
    assert stats["num_in_flight"] == 0
    assert stats["stats"]["num_free_device_blocks"] == NUM_BLOCKS
    assert stats["stats"]["num_free_host_blocks"] == NUM_HOST_BLOCKS
    assert stats["stats"]["num_preemptions"] > 0
    metrics = requests.get(f"{server.url}/metrics").text
    assert metric_value(metrics, "vllm:request_success_total", finished_reason="abort") == 6
    assert metric_value(metrics, "vllm:request_success_total", finished_reason="length") == 14
    for phase, count in EXPECTED_ABORTS_BY_PHASE.items():
        assert metric_value(metrics, "kvstorm:aborted_requests_total", phase=phase, reason="client") == count, phase
    assert metric_value(metrics, "kvstorm:free_blocks", pool="device") == NUM_BLOCKS
    swapped_out = metric_value(metrics, "kvstorm:swap_blocks_total", direction="out")
    assert swapped_out > 0
    bytes_per_block = server.async_engine.engine.info.bytes_per_block
    assert metric_value(metrics, "kvstorm:swap_bytes_total", direction="out") == swapped_out * bytes_per_block
    assert metric_value(metrics, "kvstorm:swap_latency_seconds_count") > 0
    assert metric_value(metrics, "kvstorm:preemptions_total", mode="swap", reason="requested") == (
        metric_value(metrics, "vllm:num_preemptions_total")
    )
    assert metric_value(metrics, "kvstorm:request_preemptions_count") == NUM_STREAMS
    assert metric_value(metrics, "kvstorm:request_preemptions_sum") == stats["stats"]["num_preemptions"]

    survivors = [s for s in streams if s not in victims.values()]
    assert len(survivors) == 14
    for stream in survivors:
        assert (stream.finish_reason, stream.saw_done) == ("length", True)
        alone = requests.post(f"{server.url}/v1/completions", json={**stream.body, "stream": False}).json()
        assert stream.text == alone["choices"][0]["text"], stream.request_id
