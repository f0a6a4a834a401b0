"""Prefix caching under random operations: requests whose prompts share prefixes arrive, are aborted, preempted by
swap and by recompute under device and host caps, and the cache is reset, while a fake KV cache records the token
each step writes into each slot. After every step every block is empty, evictable or held exactly as ref-counted,
no request writes into a block another holds, and every scheduled request reads its own tokens in every position
it has computed, whether it computed them, found them cached, or got them back from the host."""

from __future__ import annotations

import itertools
import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import PreemptionMode
from engine.core.outputs import SchedulerOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.stopping import check_stop
from tests.engine.core.factories import BLOCK_SIZE, make_request, make_scheduler

NUM_BLOCKS = 24
NUM_HOST_BLOCKS = 12
# Shared prompt beginnings: a request takes the first few tokens of one, then tokens of its own.
FAMILIES = [[100 + 7 * family + i for i in range(40)] for family in range(3)]


class SlotRecorder:
    """What the model runner would leave in each (pool, block, offset) slot: the token whose K/V it wrote."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, int, int], int] = {}

    def run(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        for pairs, src, dst in (
            (output.blocks_to_swap_out, "device", "host"),
            (output.blocks_to_swap_in, "host", "device"),
        ):
            for src_block, dst_block in pairs:
                for offset in range(BLOCK_SIZE):
                    token = self.slots.get((src, src_block, offset))
                    self.slots[(dst, dst_block, offset)] = token
        for scheduled in output.scheduled:
            request = scheduler.requests[scheduled.request_id]
            start, table = scheduled.num_computed_tokens, scheduled.block_ids
            read = [self.slots.get(("device", table[p // BLOCK_SIZE], p % BLOCK_SIZE)) for p in range(start)]
            assert read == request.token_ids(0, start), f"{request.request_id} reads KV that is not its own"
            for position, token in enumerate(scheduled.token_ids, start):
                block = table[position // BLOCK_SIZE]
                assert scheduler.kv.device_pool.ref_count(block) == 1, f"{request.request_id} writes a shared block"
                self.slots[("device", block, position % BLOCK_SIZE)] = token


def step(scheduler: Scheduler, recorder: SlotRecorder) -> None:
    output = scheduler.schedule()
    recorder.run(scheduler, output)
    # Each request "samples" its own tokens, so outputs differ between requests with equal prompts.
    sampled = {
        s.request_id: 200
        + zlib.crc32(f"{s.request_id}/{len(scheduler.requests[s.request_id].output_token_ids)}".encode()) % 50
        for s in output.scheduled
        if s.needs_sample
    }
    for request in scheduler.update_from_output(output, sampled):
        stop = check_stop(request, num_new_chars=0)
        if stop is not None:
            scheduler.finish_request(request.request_id, stop.finish_reason)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 40), st.integers(1, 12), st.integers(1, 16)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("cap"), st.integers(0, NUM_BLOCKS), st.integers(0, NUM_HOST_BLOCKS), st.just(0), st.just(0)),
        st.tuples(st.just("reset"), st.just(0), st.just(0), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    mode=st.sampled_from(list(PreemptionMode)),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    watermark=st.sampled_from([0.0, 0.1]),
)
def test_shared_blocks_hold_the_right_tokens_and_the_books_balance(ops, mode, budget, max_num_seqs, watermark):
    scheduler = make_scheduler(
        num_blocks=NUM_BLOCKS,
        num_host_blocks=NUM_HOST_BLOCKS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        watermark=watermark,
        enable_prefix_caching=True,
    )
    recorder, own_tokens, added = SlotRecorder(), itertools.count(1000), []
    for op, a, b, c, d in ops:
        if op == "add":
            prompt = FAMILIES[a][:b] + [next(own_tokens) for _ in range(c)]
            if -(-(len(prompt) + d) // BLOCK_SIZE) <= NUM_BLOCKS:  # the engine rejects what can never fit
                request = make_request(len(prompt), max_tokens=d, prompt_token_ids=prompt)
                scheduler.add_request(request)
                added.append(request)
        elif op == "abort" and added:
            scheduler.abort_request(added[a % len(added)].request_id)
        elif op == "cap":
            scheduler.kv.device_pool.set_capacity(a)
            scheduler.kv.host_pool.set_capacity(b)
        elif op == "reset":
            scheduler.kv.device_pool.forget_cache()
        else:
            step(scheduler, recorder)
            assert scheduler.kv.device_pool.num_over_capacity == 0
        scheduler.check_invariants()
    scheduler.kv.device_pool.set_capacity(NUM_BLOCKS)
    scheduler.kv.host_pool.set_capacity(NUM_HOST_BLOCKS)
    for _ in range(10_000):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, recorder)
        scheduler.check_invariants()
    assert all(r.is_finished for r in added)
    assert scheduler.kv.device_pool.num_used_blocks == 0
    assert scheduler.kv.device_pool.num_free_blocks == NUM_BLOCKS
    assert scheduler.kv.host_pool.num_free_blocks == NUM_HOST_BLOCKS
    assert not scheduler.kv.device_tables
    assert not scheduler.kv.host_tables


def test_a_request_with_a_cached_prefix_computes_only_the_rest_and_shares_the_blocks():
    scheduler = make_scheduler(num_blocks=20, max_num_batched_tokens=64, enable_prefix_caching=True)
    recorder = SlotRecorder()
    first = make_request(0, max_tokens=2, prompt_token_ids=FAMILIES[0][:18])  # 4 full blocks and 2 tokens
    scheduler.add_request(first)
    step(scheduler, recorder)
    second = make_request(0, max_tokens=2, prompt_token_ids=[*FAMILIES[0][:16], 999])
    scheduler.add_request(second)
    output = scheduler.schedule()
    (scheduled,) = [s for s in output.scheduled if s.request_id == second.request_id]
    assert (scheduled.num_computed_tokens, scheduled.token_ids) == (16, [999])
    assert scheduled.block_ids[:4] == scheduler.kv.block_ids(first.request_id)[:4]
    assert second.num_cached_tokens == 16
    assert scheduler.stats().prefix_cache_hit_tokens == 16


def test_the_last_prompt_token_is_computed_even_when_the_whole_prompt_is_cached():
    scheduler = make_scheduler(num_blocks=20, max_num_batched_tokens=64, enable_prefix_caching=True)
    recorder = SlotRecorder()
    for _ in range(2):
        request = make_request(0, max_tokens=1, prompt_token_ids=FAMILIES[1][:16])
        scheduler.add_request(request)
        output = scheduler.schedule()
        recorder.run(scheduler, output)
        scheduler.update_from_output(output, {request.request_id: 5})
        scheduler.finish_request(request.request_id, check_stop(request, 0).finish_reason)
    (scheduled,) = output.scheduled
    assert (scheduled.num_computed_tokens, len(scheduled.token_ids)) == (12, 4)  # 3 blocks hit, the 4th computed
    assert scheduler.kv.device_pool.num_evictable_blocks == 4


def test_a_cap_evicts_cached_blocks_before_it_preempts_and_eviction_takes_the_tail_of_a_chain_first():
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=64, enable_prefix_caching=True)
    recorder = SlotRecorder()
    done = make_request(0, max_tokens=1, prompt_token_ids=FAMILIES[2][:24])  # 6 blocks, cached once it is done
    scheduler.add_request(done)
    step(scheduler, recorder)
    pool = scheduler.kv.device_pool
    assert (pool.num_used_blocks, pool.num_evictable_blocks) == (0, 6)
    running = make_request(8, max_tokens=20)
    scheduler.add_request(running)
    step(scheduler, recorder)
    pool.set_capacity(7)  # 2 used + 6 evictable > 7: the cache gives up its last block
    assert (pool.num_used_blocks, pool.num_evictable_blocks, pool.num_evictions) == (2, 5, 1)
    assert scheduler.kv.cached_prefix(make_request(0, prompt_token_ids=FAMILIES[2][:24])) == [
        pool.cached_block(h) for h in done.block_hashes[:5]
    ]
    step(scheduler, recorder)  # the running request's 9th token needs a third block: the cache gives another
    assert (pool.num_used_blocks, pool.num_evictable_blocks, pool.num_evictions) == (3, 4, 2)
    assert scheduler.num_preemptions == 0


def test_a_flood_of_prompts_that_share_nothing_evicts_its_own_blocks_before_a_hot_prefix():
    scheduler = make_scheduler(num_blocks=NUM_BLOCKS, max_num_batched_tokens=64, enable_prefix_caching=True)
    recorder, own_tokens = SlotRecorder(), itertools.count(1000)
    hot_prefix = FAMILIES[0][:16]  # 4 blocks

    def serve(prompt: list[int]) -> Request:
        request = make_request(0, max_tokens=1, prompt_token_ids=prompt)
        scheduler.add_request(request)
        while not request.is_finished:
            step(scheduler, recorder)
        return request

    for _ in range(2):  # computed once, then found cached: a hot prefix
        serve([*hot_prefix, next(own_tokens)])
    serve([next(own_tokens) for _ in range(40)])  # the flood: 10 blocks, freed after the hot prefix's
    pool = scheduler.kv.device_pool
    num_empty = pool.num_free_blocks - pool.num_evictable_blocks
    second_flood = serve([next(own_tokens) for _ in range(4 * (num_empty + 4))])  # 4 blocks more than are empty
    assert pool.num_evictions >= 4  # plain LRU would have taken the hot prefix: the least recently freed
    assert second_flood.num_cached_tokens == 0
    assert serve([*hot_prefix, next(own_tokens)]).num_cached_tokens == 16
    scheduler.check_invariants()
