"""Factories for scheduler tests that need no model: a scheduler over tiny pools and a fake runner."""

from __future__ import annotations

import itertools

from engine.core.block_pool import BlockPool
from engine.core.config import PreemptionMode, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import SchedulerOutput
from engine.core.preemption import PreemptionPolicy
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.stopping import check_stop

BLOCK_SIZE = 4
FAKE_TOKEN = 7
_arrivals = itertools.count()


def make_scheduler(
    num_blocks: int = 11,
    num_host_blocks: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    enable_chunked_prefill: bool = True,
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
    watermark: float = 0.0,
    enable_prefix_caching: bool = False,
    max_prefill_tokens_beside_decodes: int = SchedulerConfig.max_prefill_tokens_beside_decodes,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        max_prefill_tokens_beside_decodes=max_prefill_tokens_beside_decodes,
        preemption_mode=preemption_mode,
    )
    kv = KVCacheManager(
        BlockPool(num_blocks, "device"), BlockPool(num_host_blocks, "host"), BLOCK_SIZE, enable_prefix_caching
    )
    return Scheduler(config, kv, PreemptionPolicy(preemption_mode, bytes_per_block=1024), watermark)


def make_request(
    prompt_len: int,
    max_tokens: int = 8,
    request_id: str | None = None,
    prompt_token_ids: list[int] | None = None,
    **params: object,
) -> Request:
    """A request of ``prompt_len`` tokens of its own (or ``prompt_token_ids``), hashed for prefix caching."""
    arrival = next(_arrivals)
    return Request(
        request_id=request_id or f"r{arrival}",
        prompt_token_ids=prompt_token_ids or [(arrival + i) % 100 + 1 for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        arrival_ts=float(arrival),
        block_size=BLOCK_SIZE,
    )


def make_requests(n: int, prompt_len: int, max_tokens: int = 8) -> list[Request]:
    return [make_request(prompt_len, max_tokens) for _ in range(n)]


def fake_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    """One step with a runner that 'samples' FAKE_TOKEN for every request that needs a token, and the engine's
    stop decision (no text: the fake model has no tokenizer). Returns the requests that got a token."""
    output = scheduler.schedule()
    sampled = {s.request_id: FAKE_TOKEN for s in output.scheduled if s.needs_sample}
    advanced = scheduler.update_from_output(output, sampled)
    for request in advanced:
        stop = check_stop(request, num_new_chars=0)
        if stop is not None:
            request.stop_reason = stop.reason
            scheduler.finish_request(request.request_id, stop.finish_reason)
    return output, advanced


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    steps = []
    while scheduler.has_unfinished_requests():
        if len(steps) >= max_steps:
            raise AssertionError(f"not finished after {max_steps} steps")
        output, _ = fake_step(scheduler)
        scheduler.check_invariants()
        steps.append(output)
    return steps
