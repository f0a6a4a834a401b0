"""The scheduler run without a model: requests whose outputs are invented (``VirtualRequest``), a planned step
advanced as if it ran (``advance``), and runs of decode steps taken in one go (``DecodeRun``). The admission forecast
(``engine.core.forecast``) and the simulator (``engine.core.simulator``) both drive the scheduler this way.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from engine.core.block_hash import ROOT_HASH, hash_block
from engine.core.kv_cache_manager import KVCacheManager, num_blocks_for
from engine.core.outputs import FinishReason, RemainingWork
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler, StepPlan
from engine.core.step_cost import StepShape


class VirtualRequest:
    """A request whose outputs are invented (``engine.core.scheduler.SchedulableRequest``): what the forecast's
    scheduler and the simulator's run."""

    __slots__ = (
        "block_hashes",
        "finish_reason",
        "first_scheduled_ts",
        "max_num_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_remaining_outputs",
        "num_tokens",
        "place_in_line_ts",
        "request_id",
        "status",
        "submission_index",
    )

    def __init__(self, request_id: str, work: RemainingWork) -> None:
        self.request_id = request_id
        self.num_tokens = work.num_tokens
        self.num_computed_tokens = work.num_computed_tokens
        self.num_remaining_outputs = work.num_remaining_outputs
        self.max_num_tokens = work.num_tokens + work.num_remaining_outputs
        self.place_in_line_ts = work.place_in_line_ts
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.submission_index = 0
        self.num_preemptions = 0
        self.first_scheduled_ts: float | None = None
        self.block_hashes = list(work.block_hashes)
        self.num_cached_tokens: int | None = None

    def add_invented_outputs(self, count: int, block_size: int, hashed: bool) -> None:
        """``count`` more output tokens, whose values no one running the scheduler ahead can know. With ``hashed``
        (prefix caching on), a block they fill gets a hash of its own all the same: no other request shares it, but a
        recompute of this one finds it cached, as in the engine."""
        num_full_before = self.num_tokens // block_size
        self.num_tokens += count
        if not hashed or self.num_tokens // block_size == num_full_before:  # most calls: no block filled
            return
        for num_full in range(num_full_before + 1, self.num_tokens // block_size + 1):
            if len(self.block_hashes) == num_full - 1:
                parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
                self.block_hashes.append(hash_block(parent, (), f"invented {self.request_id}".encode()))


def advance(scheduler: Scheduler, plan: StepPlan) -> list[VirtualRequest]:
    """The step ran as planned: each request in it computed its tokens, and one that caught up sampled an output
    (finishing after its last). Returns those that sampled one, in batch order."""
    scheduler.back_off.on_success()
    record_computed, block_size, hashed = (
        scheduler.record_computed,
        scheduler.kv.block_size,
        scheduler.kv.enable_prefix_caching,
    )
    sampled = []
    for request, num_new in plan.batch:
        record_computed(request, num_new)
        if request.num_computed_tokens < request.num_tokens:
            continue
        sampled.append(request)
        request.add_invented_outputs(1, block_size, hashed)
        request.num_remaining_outputs -= 1
        if request.num_remaining_outputs <= 0:
            scheduler.finish_request(request.request_id, FinishReason.LENGTH)
    return sampled


class RunStep(NamedTuple):
    """A step a decode run planned: its shape, its decodes of the run's requests, and the rest of its batch (the
    request computing its prompt, then those taken in, with their tokens in it). A tuple: a run makes one a step."""

    shape: StepShape
    num_decodes: int
    batch: Sequence[tuple[VirtualRequest, int]] = ()


class RunStepOutcome(NamedTuple):
    """What a run's step did: requests that got their last token (out of the run, finished), requests of its batch
    that sampled their first token, and whether the run must close: one has more of its prompt to compute and is
    not the newest running request (a retry keeps its first attempt's place in line), so the scheduler gives it
    its next chunk before younger requests' decodes."""

    finished: Sequence[VirtualRequest] = ()
    sampled: Sequence[VirtualRequest] = ()
    must_close: bool = False


# Most steps of a run: nothing finished, nothing sampled its first token.
_NOTHING_HAPPENED = RunStepOutcome()


class DecodeRun:
    """Decode steps in one go, kept open across arrivals.

    While every running request decodes one token a step, a step's shape follows from two sums (the run's requests and
    the KV tokens they hold), and a request's own state matters to the scheduler only where it changes something:
    where its table needs another block (allocated in the step that needs it, so what is free is exact at every step)
    and where it gets its last token. A run keeps how many of its steps each request has applied to its own state, and
    brings a request up to date when it leaves the run or the run closes; waiting requests come in through the
    scheduler's own phases (``Scheduler.plan_run_step``). The same decisions as planning every step (tests
    compare them), at a cost per request instead of per request per step. Whatever reads the running requests'
    progress otherwise (a step the scheduler plans, a fault, an abort, a snapshot) must ``close`` the run first.

    Beside its decoding requests, a run carries one request that is computing its prompt in chunks, if it is the newest
    running (``prefilling``): the scheduler gives it what each step's budget leaves, as it gives the newest request.

    A request in the run needs another block every ``block_size`` steps: the run keeps it in the bucket of the steps
    that are equal to its next need modulo ``block_size``, so a step finds the requests that need a block at once.
    That holds for requests whose tables hold just the blocks their KV fills (``fits``).
    """

    def __init__(
        self, scheduler: Scheduler, record_tokens: Callable[[VirtualRequest, list[float]], None] | None = None
    ) -> None:
        """``record_tokens``: called with a request and the stamps of the steps that gave it a token, as it is
        brought up to date."""
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.record_tokens = record_tokens
        # Each step's stamp (``commit``), in order: a request's tokens are a slice of them.
        self.stamps: list[float] = []
        # Each request in the run: how many of the run's steps its own state has applied.
        self.applied: dict[VirtualRequest, int] = {}
        self.context = 0  # KV tokens the run's requests hold after its last step
        # The ids of the requests that need another block in a step, by the step modulo the block size.
        self.block_needs: list[list[str]] = [[] for _ in range(self.block_size)]
        self.block_need_of: dict[VirtualRequest, int] = {}
        # (step, order, request): the step in which a request gets its last token; ties in the order they joined
        # (the running queue's order: the order step by step would finish them in).
        self.last_tokens: list[tuple[int, int, VirtualRequest]] = []
        self.order = itertools.count()
        # The newest running request, while it computes its prompt (its state is always up to date).
        self.prefilling: VirtualRequest | None = None
        for request in scheduler.running:
            if DecodeRun.fits(request, scheduler.kv):
                self._join(request)
            else:
                self.prefilling = request

    @staticmethod
    def can_start(scheduler: Scheduler) -> bool:
        """Whether a run can start: every running request ``fits`` one (the newest may be computing its prompt from
        a table of just the blocks its KV fills), nothing is swapped out, and the batch limits hold every running
        request (with nothing backing off)."""
        running, limit = scheduler.running, scheduler.back_off.limit
        if (
            scheduler.swapped
            or scheduler.back_off.is_backing_off
            or len(running) > min(limit.max_num_seqs, limit.max_num_batched_tokens)
            or scheduler.kv.device_pool.num_over_capacity
        ):
            return False
        kv = scheduler.kv
        if not all(DecodeRun.fits(request, kv) for request in running[:-1]):
            return False
        if not running or DecodeRun.fits(running[-1], kv):
            return True
        newest = running[-1]
        return newest.num_computed_tokens < newest.num_tokens - 1 and DecodeRun._holds_just_its_kv(newest, kv)

    @staticmethod
    def fits(request: VirtualRequest, kv: KVCacheManager) -> bool:
        """Whether ``request`` decodes one token a step (its prompt done) from a table of just the blocks its KV
        fills: what a run needs of every request in it."""
        return request.num_computed_tokens == request.num_tokens - 1 and DecodeRun._holds_just_its_kv(request, kv)

    @staticmethod
    def _holds_just_its_kv(request: VirtualRequest, kv: KVCacheManager) -> bool:
        return len(kv.block_ids(request.request_id)) == num_blocks_for(request.num_computed_tokens, kv.block_size)

    @property
    def num_steps(self) -> int:
        return len(self.stamps)

    def decode_shape(self) -> StepShape:
        """The next step's shape if it takes no one in."""
        num_rows = len(self.applied)
        context = self.context + num_rows  # each decode attends to its whole context, its new token's key included
        return StepShape(0, num_rows, context, context)

    def plan(self) -> RunStep | None:
        """The next step (``Scheduler.plan_run_step``): the blocks it needs allocated, the prompt chunk and the
        waiting requests it takes in planned. None, changing nothing, when it cannot be a step of the run: a request
        needs a block the pool lacks (the scheduler then preempts), or nothing would run."""
        step, num_rows = len(self.stamps) + 1, len(self.applied)
        due = self.block_needs[step % self.block_size]
        if not self.scheduler.waiting and self.prefilling is None:  # most steps: decodes only
            if (due and not self.scheduler.kv.append_blocks(due)) or not num_rows:
                return None
            context = self.context + num_rows
            return RunStep(StepShape(0, num_rows, context, context), num_rows)
        plan = self.scheduler.plan_run_step(num_rows, due, self.prefilling)
        if plan is None or not (plan.batch or num_rows):
            return None
        shape = self.decode_shape()
        if plan.batch:
            prefill = StepShape.of_batch([(request.num_computed_tokens, n) for request, n in plan.batch])
            shape = StepShape(
                prefill.num_prefill_tokens,
                prefill.num_decodes + num_rows,
                prefill.num_context_tokens + shape.num_context_tokens,
                prefill.num_attended_pairs + shape.num_attended_pairs,
            )
        return RunStep(shape, num_rows, plan.batch)

    def commit(self, planned: RunStep, stamp: float) -> RunStepOutcome:
        """``planned`` (the last ``plan``) ran; ``stamp`` is what its tokens are recorded with. Requests that got
        their last token are finished in the scheduler; those taken in computed their share (a prompt done samples
        its first token and decodes in the run from the next step on)."""
        step = len(self.stamps) + 1
        self.stamps.append(stamp)
        self.context += planned.num_decodes
        if not planned.batch and self.last_tokens[0][0] != step:  # most steps (a run's requests decode)
            return _NOTHING_HAPPENED
        scheduler = self.scheduler
        finished = []
        if self.last_tokens and self.last_tokens[0][0] == step:
            finished = self._take_finished(step)
            for request in finished:
                scheduler.finish_request(request.request_id, FinishReason.LENGTH)
        sampled = advance(scheduler, StepPlan(batch=list(planned.batch))) if planned.batch else []
        for request in sampled:
            if request is self.prefilling:
                self.prefilling = None
            if request.num_remaining_outputs > 0:
                self._join(request)
        if len(sampled) < len(planned.batch):  # the last of the batch has more of its prompt to compute
            partial = planned.batch[-1][0]
            if scheduler.running[-1] is not partial:
                return RunStepOutcome(finished, sampled, must_close=True)
            self.prefilling = partial
        return RunStepOutcome(finished, sampled)

    def close(self) -> None:
        """Bring every request of the run up to date: the scheduler's state is whole again."""
        for request in self.applied:
            self._catch_up(request)

    def _join(self, request: VirtualRequest) -> None:
        """``request`` (up to date, and ``fits``) decodes in the run from its next step on."""
        step, block_size = len(self.stamps), self.block_size
        self.applied[request] = step
        self.context += request.num_computed_tokens
        last_step = step + request.num_remaining_outputs
        heapq.heappush(self.last_tokens, (last_step, next(self.order), request))
        # The step whose token its last block has no slot for (within the next block_size steps).
        first_need = step + 1 + (-request.num_computed_tokens) % block_size
        if first_need <= last_step:
            self.block_need_of[request] = first_need % block_size
            self.block_needs[first_need % block_size].append(request.request_id)

    def _take_finished(self, step: int) -> list[VirtualRequest]:
        """The requests that got their last token in ``step`` (the last), up to date and out of the run."""
        finished, last_tokens = [], self.last_tokens
        while last_tokens and last_tokens[0][0] == step:
            request = heapq.heappop(last_tokens)[2]
            self._catch_up(request)
            del self.applied[request]
            bucket = self.block_need_of.pop(request, None)
            if bucket is not None:
                self.block_needs[bucket].remove(request.request_id)
            self.context -= request.num_computed_tokens
            finished.append(request)
        return finished

    def _catch_up(self, request: VirtualRequest) -> None:
        """Apply the run's steps ``request`` has not applied yet: its tokens (recorded), and (prefix caching) the
        blocks they filled, registered as each step would have."""
        start = self.applied[request]
        steps = len(self.stamps) - start
        if not steps:
            return
        self.applied[request] = start + steps
        kv = self.scheduler.kv
        block_size, computed = kv.block_size, request.num_computed_tokens
        done = computed + steps
        if kv.enable_prefix_caching and (done + 1) // block_size != computed // block_size:
            # Hashes first: a block the run both fills with tokens and computes is registered, as step by step.
            request.add_invented_outputs(steps, block_size, True)
            self.scheduler.record_computed(request, steps)
        else:
            request.num_computed_tokens = done
            request.num_tokens += steps
        request.num_remaining_outputs -= steps
        if self.record_tokens is not None:
            self.record_tokens(request, self.stamps[start:])
