"""The size of the server an experiment meets, measured before its load, so the load is sized from the target and
not from constants tuned for one pool on one machine.

- **KV size** in tokens, read from ``vllm:cache_config_info`` (vLLM's series; kvstorm exports the same labels):
  ``kv_cache_size_tokens``, else ``num_gpu_blocks`` x ``block_size``. A server without the series has no known KV
  size, and a load sized from it fails with that reason instead of guessing.
- **Capacity** in requests/s: the experiment's own request shapes, ``concurrency`` streams at a time (a closed loop)
  for ``num_requests`` requests; completed requests over the span. It is the throughput at that concurrency, not
  a latency-bounded capacity (``kvstorm bench goodput`` searches for that, in minutes instead of seconds). With
  ``num_requests`` 0 only the KV size is read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from chaos.run.load import load_config
from chaos.run.metrics import MetricsSample, scrape
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.runner import run_event_loop
from loadgen.workloads import mean_length

CACHE_CONFIG_SERIES = "vllm:cache_config_info"


@dataclass(frozen=True)
class TargetSize:
    kv_tokens: int | None
    # None: not measured (num_requests 0).
    capacity_rps: float | None = None
    output_tokens_per_s: float | None = None
    concurrency: int = 0
    num_requests: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def kv_tokens_of(sample: MetricsSample) -> int | None:
    """The server's KV cache in tokens, from ``vllm:cache_config_info``'s labels; None when it does not say."""
    for label_set in sample.values.get(CACHE_CONFIG_SERIES, {}):
        labels = dict(label_set)
        if (tokens := _whole(labels.get("kv_cache_size_tokens"))) is not None:
            return tokens
        blocks, block_size = _whole(labels.get("num_gpu_blocks")), _whole(labels.get("block_size"))
        if blocks is not None and block_size is not None:
            return blocks * block_size
    return None


def _whole(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def measure_target(
    target_url: str, model: str, *, shapes: dict[str, str], concurrency: int, num_requests: int
) -> TargetSize:
    """Measure ``target_url`` with the experiment's request ``shapes`` (workload, input_len, output_len)."""
    kv_tokens = kv_tokens_of(scrape(target_url))
    if num_requests == 0:
        return TargetSize(kv_tokens)
    if concurrency < 1 or num_requests < concurrency:
        raise ValueError(f"need 1 <= concurrency <= num_requests, got {concurrency} and {num_requests}")
    config = load_config(
        target_url, model, "constant:rate=1000", num_requests=num_requests, max_concurrency=concurrency, **shapes
    )
    summary = run_event_loop(run_benchmark(config, show_progress=False)).summary
    num_ok = summary.outcomes.get(Outcome.OK, 0)
    if num_ok == 0:
        raise RuntimeError(f"no request of the capacity measurement completed: {summary.outcomes}")
    return TargetSize(
        kv_tokens,
        capacity_rps=round(num_ok / summary.duration_s, 3),
        output_tokens_per_s=round(summary.output_token_throughput, 1),
        concurrency=concurrency,
        num_requests=num_requests,
    )


def requests_for_kv(size: TargetSize, kv_multiple: float, input_len: str, output_len: str) -> int:
    """How many requests of these lengths hold ``kv_multiple`` times the target's KV cache once fully generated."""
    if size.kv_tokens is None:
        raise RuntimeError(
            f"the server does not export {CACHE_CONFIG_SERIES}: its KV size is unknown, so no load can be sized from it"
        )
    return math.ceil(kv_multiple * size.kv_tokens / (mean_length(input_len) + mean_length(output_len)))
