"""One step's decision: who runs, how many tokens each, which blocks move, who is preempted.

No prefill or decode phase: every request needs ``num_tokens`` tokens in the
cache and has ``num_computed_tokens``; a step hands out the token budget in
three phases, after giving back what a cap took away:

0. while running requests hold more device blocks than the pool's capacity (a
   VRAM cap fault lowered it), the newest is preempted;
1. running requests, oldest first (a decode is 1 token, an unfinished prompt
   its next chunk); when one cannot get a block, the newest running request is
   preempted (swap or recompute) until it can;
2. swapped-out requests come back, oldest first (only in a step without
   preemption);
3. waiting requests are admitted, oldest first (only once nothing is swapped
   out), their prompts chunked to the budget, while free blocks stay above the
   watermark; with prefix caching, a request starts from the longest prefix of
   its prompt that is cached (those tokens count as computed, and its blocks
   are shared, not allocated).

With chunked prefill, a step in which a running request decodes gives requests that compute more than one token
(prompts, recomputes) at most ``max_prefill_tokens_beside_decodes`` of its budget, oldest first; one that finds none
left waits for the next step while the decodes younger than it still run (a step with no decode gives them the whole
budget): every stream's next token waits for one short step, not for a long prompt.

A request is admitted or swapped back in only if all it may ever need (prompt
plus ``max_tokens``) fits the pool's capacity: under a cap, one that cannot fit
waits for the cap to lift instead of running until it preempts itself, again and
again.

A step is decided as a ``StepPlan`` (which request runs how many tokens, which blocks move, who was preempted)
over anything that has the fields of ``SchedulableRequest``: the admission forecast (``engine.core.forecast``) runs
these same phases over lightweight requests to see ahead in time. ``schedule`` writes the plan out as plain data
(``SchedulerOutput``) for the model runner. After a step fails, the steps that follow are smaller
(``engine.core.step_back_off``).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.block_hash import BlockHash
from engine.core.config import PreemptionMode, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager, num_blocks_for
from engine.core.outputs import (
    CpuShare,
    EngineSnapshot,
    FinishReason,
    PreemptionEvent,
    RemainingWork,
    RequestSnapshot,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepStats,
)
from engine.core.preemption import PreemptionPolicy
from engine.core.request import Request, RequestStatus
from engine.core.step_back_off import StepBackOff


class SchedulableRequest(Protocol):
    """What the scheduler reads and writes of a request (``engine.core.request.Request`` has it all)."""

    request_id: str
    num_computed_tokens: int
    status: RequestStatus
    finish_reason: FinishReason | None
    submission_index: int
    num_preemptions: int
    first_scheduled_ts: float | None
    # Prefix caching: the hash of each full block of its tokens so far; prompt tokens found cached at its first
    # admission (None until then).
    block_hashes: Sequence[BlockHash]
    num_cached_tokens: int | None

    @property
    def num_tokens(self) -> int:
        """Tokens it needs in the KV cache now: prompt and outputs so far."""
        ...

    @property
    def max_num_tokens(self) -> int:
        """All it may ever need: prompt + max_tokens."""
        ...

    @property
    def place_in_line_ts(self) -> float: ...


@dataclass
class StepPlan:
    """One step's decision: ``batch`` holds each scheduled request with its number of new tokens, in batch order;
    block moves in the order the model runner makes them (out, then in)."""

    batch: list[tuple[SchedulableRequest, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preemptions: list[PreemptionEvent] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(num_new for _, num_new in self.batch)


@dataclass
class StepBudget:
    """Tokens and batch seats still to hand out in this step, and how many of the tokens requests that compute more
    than one may still take (prompts, recomputes: ``SchedulerConfig.max_prefill_tokens_beside_decodes``); each
    phase spends from them."""

    tokens: int
    seats: int
    prefill_tokens: int


class Scheduler:
    """Owns the waiting, running and swapped queues (each ordered by arrival).

    Finished or aborted requests leave every queue and return their blocks at
    once (``finish_request``, ``abort_request``).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        preemption_policy: PreemptionPolicy,
        watermark: float = 0.01,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.preemption_policy = preemption_policy
        self.watermark = watermark
        self.requests: dict[str, SchedulableRequest] = {}
        self.waiting: list[SchedulableRequest] = []
        self.running: list[SchedulableRequest] = []
        self.swapped: list[SchedulableRequest] = []
        self.num_preemptions = 0
        self.back_off = StepBackOff(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            # Unchunked, a prompt must fit one step: the token budget cannot shrink.
            min_num_batched_tokens=1 if config.enable_chunked_prefill else config.max_num_batched_tokens,
        )
        self._submissions = itertools.count()

    # ---- requests in and out ------------------------------------------------------------------

    def add_request(self, request: SchedulableRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.submission_index = next(self._submissions)
        request.status = RequestStatus.WAITING
        _insert_in_order(self.waiting, request)

    def restore_request(
        self,
        request: SchedulableRequest,
        status: RequestStatus,
        num_blocks: int,
        table_hashes: Sequence[BlockHash | None] = (),
    ) -> None:
        """Take a request over in the state an engine's snapshot shows it in: waiting, running with ``num_blocks``
        device blocks (cached under ``table_hashes``), or swapped with ``num_blocks`` host blocks (how the forecast
        starts from a snapshot)."""
        self.add_request(request)
        if status is RequestStatus.WAITING:
            return
        self.waiting.remove(request)
        queue = self.running if status is RequestStatus.RUNNING else self.swapped
        self.kv.restore_table(request, num_blocks, status is RequestStatus.RUNNING, table_hashes)
        request.status = status
        _insert_in_order(queue, request)

    def abort_request(self, request_id: str) -> bool:
        """Drop the request from every queue and free its blocks now; False if it is unknown or done."""
        if request_id not in self.requests:
            return False
        self.finish_request(request_id, FinishReason.ABORT)
        return True

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request the engine decided is done: it leaves its queue and its blocks are free."""
        self._finish(self.requests[request_id], reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step, for the model runner."""
        plan = self.plan_step()
        return SchedulerOutput(
            scheduled=[self._scheduled(request, num_new) for request, num_new in plan.batch],
            blocks_to_swap_out=plan.blocks_to_swap_out,
            blocks_to_swap_in=plan.blocks_to_swap_in,
            preemptions=plan.preemptions,
        )

    def plan_step(self) -> StepPlan:
        """Decide the next step: the queues and block tables change as it says; no request advances yet."""
        plan = StepPlan()
        limit = self.back_off.limit
        decoding = any(r.num_computed_tokens == r.num_tokens - 1 for r in self.running)
        budget = StepBudget(limit.max_num_batched_tokens, limit.max_num_seqs, self._prefill_tokens(decoding))
        self._reclaim_over_capacity(plan)
        self._schedule_running(budget, plan)
        if not plan.preemptions:
            self._schedule_swapped(budget, plan)
            if not self.swapped:
                self._schedule_waiting(budget, plan)
        return plan

    def plan_run_step(
        self, num_decodes: int, growing: list[str], prefilling: SchedulableRequest | None
    ) -> StepPlan | None:
        """The next step as ``plan_step`` plans it, for a run of decode steps that keeps the running requests'
        progress itself (``engine.core.virtual_run``), with nothing swapped out or over capacity: ``num_decodes``
        running requests decode one token each (those in ``growing`` need another block for it), then
        ``prefilling``, the newest running request, computes what the budget leaves of its prompt, then waiting
        requests come in. The plan's batch holds ``prefilling`` and those; None, changing nothing, when the pool
        lacks the running requests' blocks (``plan_step`` would preempt)."""
        plan = StepPlan()
        limit = self.back_off.limit
        budget = StepBudget(
            limit.max_num_batched_tokens - num_decodes,
            limit.max_num_seqs - num_decodes,
            self._prefill_tokens(num_decodes > 0),
        )
        num_new = 0
        if prefilling is not None and budget.tokens > 0 and budget.seats > 0:
            num_new = self._num_new_tokens(prefilling.num_tokens - prefilling.num_computed_tokens, budget)
        kv = self.kv
        if num_new:
            total = num_blocks_for(prefilling.num_computed_tokens + num_new, kv.block_size)
            if len(growing) + total - len(kv.block_ids(prefilling.request_id)) > kv.device_pool.num_free_blocks:
                return None
        if growing and not kv.append_blocks(growing):
            return None
        if num_new:
            kv.allocate_slots(prefilling.request_id, prefilling.num_computed_tokens + num_new)
            self._schedule(prefilling, num_new, budget, plan)
        self._schedule_waiting(budget, plan)
        return plan

    def step_failed(self, output: SchedulerOutput) -> Request | None:
        """The step ``output`` raised and changed nothing: back off. Returns the request the back-off gives up on
        (it failed alone in the smallest step too often), if any; the engine finishes it."""
        if not self.back_off.on_failure(len(output.scheduled), output.num_batched_tokens):
            return None
        return self.requests[output.scheduled[0].request_id]

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance every scheduled request and append its sampled token; returns the requests that got one, in
        batch order. Whether one of them is done is the engine's decision (``engine.core.stopping``)."""
        self.back_off.on_success()
        now = time.monotonic()
        advanced = []
        for scheduled in output.scheduled:
            request = self.requests[scheduled.request_id]
            self.record_computed(request, scheduled.num_new_tokens)
            if not scheduled.needs_sample:
                continue
            request.append_output(sampled[request.request_id])
            if request.first_token_ts is None:
                request.first_token_ts = now
            advanced.append(request)
        return advanced

    def record_computed(self, request: SchedulableRequest, num_new_tokens: int) -> None:
        """The step computed ``num_new_tokens`` more of the request's tokens: the full blocks among them are
        offered to the prefix cache."""
        request.num_computed_tokens += num_new_tokens
        self.kv.register_computed_blocks(request)

    def stats(self) -> SchedulerStats:
        device_pool = self.kv.device_pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_free_device_blocks=device_pool.num_free_blocks,
            num_device_blocks=device_pool.capacity,
            num_used_device_blocks=device_pool.num_used_blocks,
            num_physical_device_blocks=device_pool.num_blocks,
            num_free_host_blocks=self.kv.host_pool.num_free_blocks,
            num_host_blocks=self.kv.host_pool.capacity,
            num_used_host_blocks=self.kv.host_pool.num_used_blocks,
            num_physical_host_blocks=self.kv.host_pool.num_blocks,
            num_preemptions=self.num_preemptions,
            max_num_seqs_now=self.back_off.limit.max_num_seqs,
            max_num_batched_tokens_now=self.back_off.limit.max_num_batched_tokens,
            num_reserved_device_blocks=int(self.watermark * device_pool.capacity),
            num_cached_device_blocks=device_pool.num_cached_blocks,
            num_evictable_device_blocks=device_pool.num_evictable_blocks,
            prefix_cache_queried_tokens=self.kv.prefix_cache_counts.queried_tokens,
            prefix_cache_hit_tokens=self.kv.prefix_cache_counts.hit_tokens,
            prefix_cache_evictions=device_pool.num_evictions,
        )

    def snapshot(
        self,
        active_faults: dict[str, bool],
        last_step: StepStats | None = None,
        requests: tuple[RequestSnapshot, ...] | None = None,
        cpu_share: CpuShare | None = None,
    ) -> EngineSnapshot:
        """The engine between two steps, as the serving layer and the admission forecast see it: its queues' remaining
        work in scheduling order, its pools, its cached prefixes and its preemption costs."""
        kv = self.kv
        return EngineSnapshot(
            stats=self.stats(),
            prefill_tokens_per_s=self.preemption_policy.prefill_tokens_per_s,
            copy_bytes_per_s=self.preemption_policy.copy_bytes_per_s,
            active_faults=active_faults,
            last_step=last_step,
            running_work=self._remaining_work(self.running, kv.device_tables, on_device=True),
            swapped_work=self._remaining_work(self.swapped, kv.host_tables),
            waiting_work=self._remaining_work(self.waiting, {}),
            requests=requests,
            evictable_block_hashes=kv.device_pool.evictable_hashes() if kv.enable_prefix_caching else (),
            reused_block_hashes=kv.device_pool.reused_hashes() if kv.enable_prefix_caching else frozenset(),
            cpu_share=cpu_share,
        )

    def _remaining_work(
        self, requests: list[SchedulableRequest], block_tables: dict[str, list[int]], on_device: bool = False
    ) -> tuple[RemainingWork, ...]:
        kv = self.kv
        caching = kv.enable_prefix_caching
        return tuple(
            RemainingWork(
                num_tokens=r.num_tokens,
                num_computed_tokens=r.num_computed_tokens,
                num_remaining_outputs=r.max_num_tokens - r.num_tokens,
                place_in_line_ts=r.place_in_line_ts,
                num_blocks=len(block_tables.get(r.request_id, ())),
                block_hashes=tuple(r.block_hashes) if caching else (),
                table_hashes=kv.table_hashes(r.request_id) if caching and on_device else (),
            )
            for r in requests
        )

    # ---- phases -------------------------------------------------------------------------------

    def _reclaim_over_capacity(self, plan: StepPlan) -> None:
        while self.kv.device_pool.num_over_capacity and self.running:
            self._preempt_newest(plan)

    def _schedule_running(self, budget: StepBudget, plan: StepPlan) -> None:
        # Every step runs this for every running request: the calls it makes are looked up once.
        running, allocate_slots, num_new_tokens = self.running, self.kv.allocate_slots, self._num_new_tokens
        index = 0
        while index < len(running) and budget.tokens > 0 and budget.seats > 0:
            request = running[index]
            num_new = num_new_tokens(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                if budget.prefill_tokens:  # unchunked, its prompt does not fit what is left: no one younger first
                    break
                index += 1  # its next chunk waits for a step with prefill tokens left; younger decodes still run
                continue
            while allocate_slots(request.request_id, request.num_computed_tokens + num_new) is None:
                # The newest arrival: never one already scheduled this step, since those come first.
                if self._preempt_newest(plan) is request:
                    return
            self._schedule(request, num_new, budget, plan)
            index += 1

    def _schedule_swapped(self, budget: StepBudget, plan: StepPlan) -> None:
        self._admit(self.swapped, self._swap_in, budget, plan)

    def _schedule_waiting(self, budget: StepBudget, plan: StepPlan) -> None:
        self._admit(self.waiting, self._allocate_for_admission, budget, plan)

    def _admit(
        self,
        queue: list[SchedulableRequest],
        make_room: Callable[[SchedulableRequest, StepBudget, StepPlan], int],
        budget: StepBudget,
        plan: StepPlan,
    ) -> None:
        """Move requests from the head of ``queue`` into the batch while budget, seats and ``make_room`` allow
        (it returns how many tokens the request computes in this step, 0 if it cannot come in)."""
        while queue and budget.tokens > 0 and budget.seats > 0 and len(self.running) < self.config.max_num_seqs:
            request = queue[0]
            num_new = make_room(request, budget, plan)
            if num_new == 0:
                break
            queue.pop(0)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_ts is None:
                request.first_scheduled_ts = time.monotonic()
            _insert_in_order(self.running, request)
            self._schedule(request, num_new, budget, plan)

    def _swap_in(self, request: SchedulableRequest, budget: StepBudget, plan: StepPlan) -> int:
        """Bring a swapped request's blocks back, plus room for its new tokens, if that keeps the watermark."""
        num_new = self._num_new_tokens(request.num_tokens - request.num_computed_tokens, budget)
        num_total_tokens = request.num_computed_tokens + num_new
        swapped = self.kv.num_swapped_blocks(request.request_id)
        num_blocks = max(swapped, num_blocks_for(num_total_tokens, self.kv.block_size))
        if (
            num_new == 0
            or not self._fits_capacity(request)
            or self.kv.device_pool.num_free_blocks - num_blocks < self._num_reserved_blocks()
        ):
            return 0
        plan.blocks_to_swap_in.extend(self.kv.swap_in(request.request_id))
        self.kv.allocate_slots(request.request_id, num_total_tokens)
        return num_new

    def _allocate_for_admission(self, request: SchedulableRequest, budget: StepBudget, plan: StepPlan) -> int:
        """Admit a waiting request (new, or preempted to be recomputed) from its longest cached prefix."""
        if not self._fits_capacity(request):
            return 0
        cached_block_ids = self.kv.cached_prefix(request)
        num_cached_tokens = len(cached_block_ids) * self.kv.block_size
        num_new = self._num_new_tokens(request.num_tokens - num_cached_tokens, budget)
        if num_new == 0 or (
            self.kv.allocate_slots(
                request.request_id, num_cached_tokens + num_new, self._num_reserved_blocks(), cached_block_ids
            )
            is None
        ):
            return 0
        request.num_computed_tokens = num_cached_tokens
        self.kv.count_admission(request.num_tokens, num_cached_tokens)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached_tokens
        return num_new

    # ---- helpers ------------------------------------------------------------------------------

    def _num_reserved_blocks(self) -> int:
        """Blocks new work must leave free: the watermark, which exists for running requests to grow into."""
        return int(self.watermark * self.kv.device_pool.capacity) if self.running else 0

    def _fits_capacity(self, request: SchedulableRequest) -> bool:
        """Whether all the request may ever need (prompt + max_tokens) fits the device pool's capacity."""
        return num_blocks_for(request.max_num_tokens, self.kv.block_size) <= self.kv.device_pool.capacity

    def _prefill_tokens(self, decoding: bool) -> int:
        """The tokens a step may give requests that compute more than one: fewer when it also decodes."""
        config = self.config
        if decoding and config.enable_chunked_prefill:
            return config.max_prefill_tokens_beside_decodes
        return config.max_num_batched_tokens

    def _num_new_tokens(self, remaining: int, budget: StepBudget) -> int:
        """Tokens a request that lacks ``remaining`` gets now: all of them, or (chunked prefill) as many as the
        budget allows."""
        allowed = budget.tokens if remaining == 1 else min(budget.tokens, budget.prefill_tokens)
        if remaining <= allowed:
            return remaining
        return allowed if self.config.enable_chunked_prefill else 0

    def _schedule(self, request: SchedulableRequest, num_new: int, budget: StepBudget, plan: StepPlan) -> None:
        plan.batch.append((request, num_new))
        budget.tokens -= num_new
        if num_new > 1:
            budget.prefill_tokens -= num_new
        budget.seats -= 1

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """A planned share of the step as the model runner takes it (only a real ``Request`` has tokens)."""
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids(start, start + num_new),
            num_computed_tokens=start,
            block_ids=list(self.kv.block_ids(request.request_id)),
            needs_sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            banned_token_ids=request.banned_token_ids(),
            **(
                {"prompt_token_ids": request.prompt_token_ids, "output_token_ids": request.output_token_ids}
                if request.sampling_params.has_penalties
                else {}
            ),
        )

    def _preempt_newest(self, plan: StepPlan) -> SchedulableRequest:
        victim = self.running.pop()
        num_blocks = len(self.kv.block_ids(victim.request_id))
        num_computed_tokens = victim.num_computed_tokens
        mode, reason = self.preemption_policy.choose(
            num_blocks, num_computed_tokens, self.kv.can_swap_out(victim.request_id)
        )
        if mode is PreemptionMode.SWAP:
            plan.blocks_to_swap_out.extend(self.kv.swap_out(victim.request_id))
            victim.status = RequestStatus.SWAPPED
            _insert_in_order(self.swapped, victim)
        else:
            self.kv.free(victim.request_id)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            _insert_in_order(self.waiting, victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        plan.preemptions.append(
            PreemptionEvent(
                request_id=victim.request_id,
                mode=mode,
                num_blocks=num_blocks,
                num_computed_tokens=num_computed_tokens,
                ts=time.monotonic(),
                reason=reason,
            )
        )
        return victim

    def _finish(self, request: SchedulableRequest, reason: FinishReason) -> None:
        queues = {
            RequestStatus.WAITING: self.waiting,
            RequestStatus.RUNNING: self.running,
            RequestStatus.SWAPPED: self.swapped,
        }
        queues[request.status].remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        queued = _ids(self.waiting) | _ids(self.running) | _ids(self.swapped)
        if queued != set(self.requests):
            raise AssertionError(f"queues hold {sorted(queued)} but live requests are {sorted(self.requests)}")
        owners = set(self.kv.device_tables) | set(self.kv.host_tables)
        if not owners <= _ids(self.running) | _ids(self.swapped):
            raise AssertionError(f"blocks held by requests that are not running or swapped: {sorted(owners)}")


def _insert_in_order(queue: list[SchedulableRequest], request: SchedulableRequest) -> None:
    """Every queue is ordered by arrival (a retry's first attempt, ``Request.place_in_line_ts``); requests that
    arrived at the same instant keep submission order."""
    bisect.insort(queue, request, key=lambda r: (r.place_in_line_ts, r.submission_index))


def _ids(requests: Iterable[SchedulableRequest]) -> set[str]:
    return {r.request_id for r in requests}
