"""The scheduler run ahead in time: when would a new request get its first token?

The forecast builds a ``Scheduler`` of its own from an engine's snapshot (the same queues, the same block tables in
pools of the same sizes and caps, the same cached prefixes, the same configuration, preemption costs and batch limit)
over lightweight requests, and runs its steps (``Scheduler.plan_step``: the scheduler's own phases, so every rule, a KV
cap included, is written once) with durations from a step-time model, until the new request has its first token and a
few decodes. A request finishes when it has produced all its ``max_tokens``: the forecast cannot know a stop token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import EngineInfo, EngineSnapshot, RemainingWork
from engine.core.preemption import PreemptionPolicy
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_back_off import BatchLimit
from engine.core.virtual_run import DecodeRun, VirtualRequest, advance

# Seconds one step takes, given its prefill tokens and its decodes.
StepTime = Callable[[int, int], float]

# How far a forecast looks ahead at most: a request predicted later than this is refused anyway.
FORECAST_HORIZON_S = 120.0
FORECAST_MAX_STEPS = 5000
# Decode steps of the new request over which its TPOT is predicted (when a TPOT objective asks for it).
TPOT_DECODES = 8


@dataclass(frozen=True)
class Forecast:
    """When a new request would be first scheduled and get its first token, in seconds from now (``math.inf``:
    not within the forecast's horizon), and the mean step time over its first decodes (None if not reached)."""

    queue_s: float
    ttft_s: float
    tpot_s: float | None


def scheduler_from_snapshot(snapshot: EngineSnapshot, info: EngineInfo) -> Scheduler:
    """An empty scheduler shaped as the engine's is at ``snapshot``: its pools, caps, costs and batch limit."""
    stats = snapshot.stats
    device_pool = BlockPool(stats.num_physical_device_blocks, "device")
    device_pool.set_capacity(stats.num_device_blocks)
    host_pool = BlockPool(stats.num_physical_host_blocks, "host")
    host_pool.set_capacity(stats.num_host_blocks)
    config = info.scheduler_config
    policy = PreemptionPolicy(
        config.preemption_mode, info.bytes_per_block, snapshot.copy_bytes_per_s, snapshot.prefill_tokens_per_s
    )
    kv = KVCacheManager(device_pool, host_pool, info.block_size, info.enable_prefix_caching)
    scheduler = Scheduler(config, kv, policy, info.watermark)
    scheduler.back_off.limit = BatchLimit(stats.max_num_seqs_now, stats.max_num_batched_tokens_now)
    return scheduler


def forecast(
    snapshot: EngineSnapshot,
    info: EngineInfo,
    in_engine: Sequence[RemainingWork],
    arriving: Sequence[RemainingWork],
    new: RemainingWork,
    step_time: StepTime,
    elapsed_s: float = 0.0,
    horizon_s: float = FORECAST_HORIZON_S,
    tpot_decodes: int = TPOT_DECODES,
    fast_forward: bool = True,
) -> Forecast:
    """Run the scheduler from ``snapshot``: a step on the snapshot's queues and ``in_engine`` (requests the engine
    took since the snapshot) started ``elapsed_s`` ago; ``arriving`` (submitted, not taken yet) and the ``new``
    request join the waiting queue from the next step on, each at its place in line. The TPOT is predicted over the
    new request's first ``tpot_decodes`` decodes (0: not predicted, the forecast ends at its first token).

    Where every running request only decodes, steps go in a ``DecodeRun``: the same decisions and times at a cost per
    request rather than per request per step (``fast_forward`` off: every step planned on its own, for tests)."""
    scheduler = scheduler_from_snapshot(snapshot, info)
    names = (str(index) for index in range(1 << 62))
    for status, works in (
        (RequestStatus.RUNNING, snapshot.running_work),
        (RequestStatus.SWAPPED, snapshot.swapped_work),
        (RequestStatus.WAITING, (*snapshot.waiting_work, *in_engine)),
    ):
        for work in works:
            scheduler.restore_request(VirtualRequest(next(names), work), status, work.num_blocks, work.table_hashes)
    scheduler.kv.restore_cache(snapshot.evictable_block_hashes, snapshot.reused_block_hashes)
    later = [VirtualRequest(next(names), work) for work in arriving]
    new_request = VirtualRequest(next(names), new)
    later.append(new_request)
    if not scheduler.has_unfinished_requests():  # an idle engine runs no step now: the new one is in the next
        _add_all(scheduler, later)
    t = -elapsed_s if later else 0.0
    queue_s = ttft_s = None
    decode_steps: list[float] = []
    run: DecodeRun | None = None
    for step in range(FORECAST_MAX_STEPS):
        if step == 1 and later:
            _add_all(scheduler, later)
            t = max(t, 0.0)  # the step in progress may be late
        if run is None and fast_forward and DecodeRun.can_start(scheduler):
            run = DecodeRun(scheduler)
        planned = run.plan() if run is not None else None
        if planned is not None:
            batch, num_prefill_tokens, num_decodes = (
                planned.batch,
                planned.shape.num_prefill_tokens,
                planned.shape.num_decodes,
            )
        else:
            if run is not None:
                run.close()
                run = None
            plan = scheduler.plan_step()
            batch = plan.batch
            num_decodes = sum(1 for _, num_new in batch if num_new == 1)
            num_prefill_tokens = plan.num_batched_tokens - num_decodes
        duration_s = step_time(num_prefill_tokens, num_decodes)
        if queue_s is None and any(request is new_request for request, _ in batch):
            queue_s = max(t, 0.0)
        t += duration_s
        if run is not None:
            decoding = new_request in run.applied  # a row of the run's step
            outcome = run.commit(planned, t)
            if outcome.must_close:
                run.close()
                run = None
            sampled_new = decoding or new_request in outcome.sampled
        else:
            sampled_new = new_request in advance(scheduler, plan)
        if sampled_new:
            if ttft_s is None:
                ttft_s = t
            else:
                decode_steps.append(duration_s)
        new_finished = new_request.status is RequestStatus.FINISHED
        if (ttft_s is not None and (len(decode_steps) >= tpot_decodes or new_finished)) or t > horizon_s:
            break
    return Forecast(
        queue_s=math.inf if queue_s is None else queue_s,
        ttft_s=math.inf if ttft_s is None else ttft_s,
        tpot_s=sum(decode_steps) / len(decode_steps) if decode_steps else None,
    )


def _add_all(scheduler: Scheduler, requests: list[VirtualRequest]) -> None:
    for request in requests:
        scheduler.add_request(request)
    requests.clear()
