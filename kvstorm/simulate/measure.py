"""A fitted step-cost profile of this machine: steps of the real engine as it serves, measured and fitted
(``engine.core.step_cost.fit_linear_step_cost``).

A fresh ``kvstorm serve`` with the operator's engine options gets the measuring load over HTTP from the load
generator: bursts of random-token requests at growing concurrency (steps of prefill chunks alone, prefill mixed with
decodes, decodes of many rows to one at short and long contexts), then Poisson arrivals (small mixed batches). The
server's loop logs each busy iteration's step shape and the time to the next iteration (``/admin/steps``), with the
HTTP side and the streams contending for the CPU as they do in any served run; the fit sees that time less the
step's block moves, and a block move costs what the engine measures of its copies. What the clients' mean TTFT adds
to the server's own under the Poisson arrivals is the profile's token latency (the event loop delivering, the socket,
the client's parsing).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import secrets
from collections.abc import Sequence

import requests

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV, EngineAdmin
from chaos.injectors.processes import kvstorm_server
from chaos.run.metrics import scrape
from engine.core.step_cost import StepShape, fit_linear_step_cost
from kernels.cpu_isa import cpu_kind
from kvstorm.bench.peer import cpu_name
from kvstorm.simulate.profiles import EngineShape, Fit, FittedProfile, LinearCost
from kvstorm.simulate.run import open_loop_load
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.results import RunConfig
from loadgen.runner import run_event_loop

# A burst of each size in turn, then Poisson arrivals; prompts and outputs drawn in these ranges (tokens).
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)
POISSON_RATE, POISSON_S = 2.0, 20.0
PROMPT_LEN, OUTPUT_LEN = "uniform:16-1024", "uniform:8-96"
TTFT = "vllm:time_to_first_token_seconds"


def served_model(base_url: str) -> str:
    """The model name a server answers to (its first in /v1/models)."""
    return requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def measuring_loads(base_url: str, model: str, concurrency: Sequence[int], seed: int) -> list[RunConfig]:
    def load(arrival: str, num_requests: int | None, duration_s: float | None, offset: int) -> RunConfig:
        return open_loop_load(
            base_url,
            model,
            arrival,
            PROMPT_LEN,
            OUTPUT_LEN,
            num_requests=num_requests,
            duration_s=duration_s,
            seed=seed + offset,
        )

    bursts = [load("constant:rate=1000", count, None, index) for index, count in enumerate(concurrency)]
    return [*bursts, load(f"poisson:rate={POISSON_RATE:g}", None, POISSON_S, len(bursts))]


def fitted_profile(
    serve_args: Sequence[str], command: str, seed: int = 0, concurrency: Sequence[int] = CONCURRENCY
) -> FittedProfile:
    token = secrets.token_urlsafe(16)
    with kvstorm_server([*serve_args, "--ttft-slo", "off"], env={**os.environ, ADMIN_TOKEN_ENV: token}) as server:
        for config in measuring_loads(server.url, served_model(server.url), concurrency, seed):
            before = scrape(server.url)
            result = run_event_loop(run_benchmark(config, show_progress=False))
            if result.summary.outcomes[Outcome.OK] != len(result.records):
                raise RuntimeError(f"the measuring load {config.arrival!r} had requests that did not end ok")
        # The last load's: sparse arrivals, so no request waits on the server's HTTP side behind a burst of others.
        after = scrape(server.url)
        client_ttft_s = sum(record.ttft_s for record in result.records) / len(result.records)
        admin = EngineAdmin(server.url, token)
        steps = admin.steps()["steps"]
        described = admin.stats()
    shapes = [
        StepShape(s["num_prefill_tokens"], s["num_decodes"], s["num_context_tokens"], s["num_attended_pairs"])
        for s in steps
    ]
    durations = [s["wall_s"] - s["swap_s"] for s in steps]
    server_ttft_s = (after.total(f"{TTFT}_sum") - before.total(f"{TTFT}_sum")) / (
        after.total(f"{TTFT}_count") - before.total(f"{TTFT}_count")
    )
    info, stats, config = described["engine"], described["stats"], described["engine"]["scheduler_config"]
    cost, quality = fit_linear_step_cost(shapes, durations, info["bytes_per_block"] / described["copy_bytes_per_s"])
    return FittedProfile(
        name=f"{info['model']} {info['dtype']} served on {cpu_name()} ({cpu_kind()}), fitted",
        engine=EngineShape(
            num_kv_blocks=stats["num_physical_device_blocks"],
            num_swap_blocks=stats["num_physical_host_blocks"],
            block_size=info["block_size"],
            max_model_len=info["max_model_len"],
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            enable_chunked_prefill=config["enable_chunked_prefill"],
            max_prefill_tokens_beside_decodes=config["max_prefill_tokens_beside_decodes"],
            preemption_mode=config["preemption_mode"],
            watermark=info["watermark"],
            enable_prefix_caching=info["enable_prefix_caching"],
        ),
        bytes_per_block=info["bytes_per_block"],
        cost=LinearCost(**cost.to_json()),
        fit=Fit(**dataclasses.asdict(quality)),
        token_latency_s=max(0.0, client_ttft_s - server_ttft_s),
        measured_on={
            "cpu": f"{cpu_name()} ({cpu_kind()}), {os.cpu_count()} CPUs",
            "machine": platform.machine(),
            "model": info["model"],
            "dtype": info["dtype"],
            "command": command,
        },
    )
