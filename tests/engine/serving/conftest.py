"""Real servers for the server tests: the aiohttp app on a free loopback port, its event loop in a thread.

The test's own thread stays free for synchronous clients (the official ``openai`` client, httpx).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.attention.kv_cache import kv_cache_bytes_per_block
from engine.core.admission import AdmissionLimits
from engine.llm_engine import LLM, LLMEngine
from engine.serving.async_engine import AsyncEngine
from engine.serving.metrics import EngineMetrics
from engine.serving.server import ServerConfig, create_app, start_server

ADMIN_TOKEN = "test-admin-token"
BLOCK_SIZE = 16


class RunningServer:
    """A server listening on 127.0.0.1; ``stop()`` shuts down the app and its engine loop."""

    def __init__(self, async_engine: AsyncEngine, config: ServerConfig) -> None:
        self.async_engine = async_engine
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        app = create_app(async_engine, config)
        self.runner, port = asyncio.run_coroutine_threadsafe(start_server(app, "127.0.0.1", 0), self.loop).result(60)
        self.url = f"http://127.0.0.1:{port}"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.admin_token}"}

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def make_engine(model, tokenizer, num_blocks: int = 256, num_host_blocks: int = 64, **options) -> LLMEngine:
    """An engine over an already loaded model; pools sized in blocks of ``BLOCK_SIZE`` tokens."""
    bytes_per_block = kv_cache_bytes_per_block(model.config, BLOCK_SIZE, torch.float32)
    return LLM(
        tokenizer=tokenizer,
        loaded_model=model,
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * bytes_per_block,
        swap_space=num_host_blocks * bytes_per_block,
        debug_invariants=True,
        **options,
    ).engine


@contextmanager
def running_server(
    engine: LLMEngine,
    name: str = "smollm2-135m",
    limits: AdmissionLimits | None = None,
    admin_token: str | None = ADMIN_TOKEN,
    **config: object,
) -> Iterator[RunningServer]:
    async_engine = AsyncEngine(engine, EngineMetrics(name), limits)
    server = RunningServer(async_engine, ServerConfig(served_model_name=name, admin_token=admin_token, **config))
    try:
        yield server
    finally:
        server.stop()


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    for line in exposition.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        sample, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in sample for key, val in labels.items()):
            return float(value)
    return 0.0


def make_tiny_engine(**options) -> LLMEngine:
    """The tiny random-weight model (no tokenizer: prompts are token ids), for tests where text does not matter; in
    float32, whose block sizes the tests' byte budgets count."""
    options = {"kv_cache_memory": 8 << 20, "swap_space": 0, "dtype": "float32", **options}
    return LLM("random:tiny", device="cpu", block_size=BLOCK_SIZE, **options).engine


def wait_until(condition, what: str, timeout_s: float = 60.0, interval_s: float = 0.01):
    """Poll ``condition`` until it returns something truthy (a hang guard, not a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
