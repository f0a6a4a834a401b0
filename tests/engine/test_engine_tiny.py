"""LLMEngine end to end on a tiny random model: rejection, abort, swap content, knobs, invariants."""

from __future__ import annotations

import pytest
import torch

from engine.attention.kv_cache import kv_cache_bytes_per_block
from engine.core.config import CacheConfig, EngineConfig, PreemptionMode, SchedulerConfig
from engine.core.interface import InvalidRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.config import PRESETS
from engine.model.packed_linear import packing_applies
from kernels.cpu_matmul import tile_matmul_isa

BLOCK_SIZE = 4
BYTES_PER_BLOCK = kv_cache_bytes_per_block(PRESETS["tiny"], BLOCK_SIZE, torch.float32)


def make_engine(num_blocks: int = 24, num_host_blocks: int = 16, **scheduler: object) -> LLMEngine:
    config = EngineConfig(
        model="random:tiny",
        device="cpu",
        dtype="float32",  # BYTES_PER_BLOCK's
        cache=CacheConfig(
            block_size=BLOCK_SIZE,
            kv_cache_memory=num_blocks * BYTES_PER_BLOCK,
            swap_space=num_host_blocks * BYTES_PER_BLOCK,
            watermark=0.0,
        ),
        scheduler=SchedulerConfig(**{"max_num_batched_tokens": 32, **scheduler}),
        debug_invariants=True,
    )
    return LLMEngine.from_config(config)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pool_given_in_blocks_has_that_many_whatever_a_block_weighs(dtype):
    config = EngineConfig(
        model="random:tiny", device="cpu", dtype=dtype, cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=20)
    )
    engine = LLMEngine.from_config(config)
    assert engine.stats().num_device_blocks == 20
    assert engine.info.bytes_per_block == kv_cache_bytes_per_block(PRESETS["tiny"], BLOCK_SIZE, getattr(torch, dtype))
    with pytest.raises(ValueError, match="num_kv_blocks must be >= 1, got 0"):
        CacheConfig(num_kv_blocks=0)


@pytest.mark.parametrize("matmul_kernel", ["auto", "onednn"])
def test_the_engine_multiplies_bfloat16_with_the_kernel_asked_for_and_says_which(matmul_kernel):
    config = EngineConfig(model="random:tiny", device="cpu", dtype="bfloat16", matmul_kernel=matmul_kernel)
    engine = LLMEngine.from_config(config)
    if matmul_kernel == "auto" and tile_matmul_isa():  # every layer of the tiny model fits the tiles
        assert engine.info.matmul == f"kvstorm-{tile_matmul_isa()}, batch-invariant at any row count"
    elif packing_applies(torch.device("cpu"), torch.bfloat16):
        assert engine.info.matmul.startswith("onednn-packed, batch-invariant in calls of ")
    else:
        assert engine.info.matmul == "torch"
    engine.add_request([1, 2, 3], greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="matmul_kernel must be one of"):
        EngineConfig(matmul_kernel="mkl")


def test_requests_that_can_never_fit_are_the_clients_fault_with_the_numbers():
    """InvalidRequest, which the server answers with a 400; any other error of the engine's is a 500."""
    engine = make_engine(num_blocks=8)
    with pytest.raises(InvalidRequest, match=r"needs 9 KV blocks but the whole KV pool has 8"):
        engine.add_request(list(range(1, 31)), greedy(5))
    with pytest.raises(InvalidRequest, match=r"exceeds the model's context of 1024 tokens"):
        engine.add_request([1] * 1000, greedy(30))
    with pytest.raises(InvalidRequest, match=r"token ids must be integers in \[0, 512\)"):
        engine.add_request([1, 512], greedy(2))
    with pytest.raises(InvalidRequest, match="at least one token"):
        engine.add_request([], greedy(2))
    assert not engine.has_unfinished_requests()


def test_unchunked_engine_rejects_what_cannot_fit_one_step():
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=16, max_num_seqs=4)
    with pytest.raises(InvalidRequest, match="exceeds max_num_batched_tokens"):
        engine.add_request(list(range(1, 15)), greedy(5))


def test_abort_mid_decode_returns_every_block_at_once():
    engine = make_engine()
    keep = engine.add_request(list(range(1, 10)), greedy(12))
    drop = engine.add_request(list(range(20, 35)), greedy(12))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.block_ids(drop.request_id)
    assert engine.abort_request(drop.request_id)
    assert not engine.kv_cache_manager.block_ids(drop.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert keep.num_output_tokens == 12
    assert engine.kv_cache_manager.device_pool.num_free_blocks == 24


def test_swap_out_and_in_keeps_kv_bit_identical():
    engine = make_engine()
    runner = engine.runner
    torch.manual_seed(0)
    runner.device_cache.data.normal_()
    original = runner.device_cache.data[:, :, [3, 7, 11]].clone()
    runner.swap_out([(3, 0), (7, 1), (11, 2)])
    runner.device_cache.data[:, :, [3, 7, 11]] = 0.0
    runner.swap_in([(0, 20), (1, 5), (2, 9)])
    assert torch.equal(runner.device_cache.data[:, :, [20, 5, 9]], original)


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_greedy_tokens_do_not_depend_on_preemption(mode):
    prompts = [list(range(1 + i, 10 + 2 * i)) for i in range(6)]
    ample = make_engine(num_blocks=64)
    tight = make_engine(num_blocks=12, num_host_blocks=12, preemption_mode=mode)
    results = []
    for engine in (ample, tight):
        requests = [engine.add_request(p, greedy(14)) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        results.append([r.output_token_ids for r in requests])
    assert tight.scheduler.num_preemptions > 0
    assert results[0] == results[1]


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list:
    requests = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            assert output.finish_reason in (None, "length"), output.error
    return [r.output_token_ids for r in requests]


def test_a_step_that_runs_out_of_memory_changes_nothing_and_the_next_steps_are_smaller():
    prompts = [list(range(1 + i, 10 + 2 * i)) for i in range(6)]
    expected = run_to_completion(make_engine(num_blocks=64), prompts, 14)
    engine = make_engine(num_blocks=64)
    engine.update_faults(oom_above_batched_tokens=12)  # the 6 prompts need 78 tokens in all
    sizes = []
    requests = [engine.add_request(p, greedy(14)) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        sizes.append((engine.last_step.num_batched_tokens, engine.last_step.error))
    assert [r.output_token_ids for r in requests] == expected
    failed = [tokens for tokens, error in sizes if error is not None]
    assert failed
    assert all(tokens > 12 for tokens in failed)
    assert {error for _, error in sizes} == {None, "OutOfMemoryError"}
    assert all(tokens <= 12 for tokens, error in sizes if error is None)
    assert engine.scheduler.back_off.num_failures == len(failed)
    assert engine.kv_cache_manager.device_pool.num_free_blocks == 64


def test_a_request_that_fails_alone_in_the_smallest_step_ends_with_an_error_and_the_engine_goes_on():
    engine = make_engine(num_blocks=64)
    engine.update_faults(fail_next_steps=10**6)  # every step fails
    doomed = [engine.add_request(list(range(1, 9 + i)), greedy(5)) for i in range(3)]
    finished = {}
    for _ in range(100):
        for output in engine.step().outputs:
            finished[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == sorted(r.request_id for r in doomed)
    for output in finished.values():
        assert output.finish_reason == "error"
        assert "gave up on this request after 3 failed steps in which it ran alone" in output.error
        assert "OutOfMemoryError: injected: out of memory in a step of 1 tokens" in output.error
    assert engine.kv_cache_manager.device_pool.num_free_blocks == 64
    engine.update_faults(fail_next_steps=0)
    assert (
        run_to_completion(engine, [list(range(1, 12))], 6)[0]
        == run_to_completion(make_engine(), [list(range(1, 12))], 6)[0]
    )
    assert engine.scheduler.back_off.is_backing_off  # a fresh request started small ...
    for _ in range(64):
        engine.scheduler.back_off.on_success()
    assert not engine.scheduler.back_off.is_backing_off  # ... and successes grow the batch back


def test_faults_refuse_unknown_names_and_bad_values_and_nothing_of_a_refused_update_applies():
    engine = make_engine()
    for changes, message in (
        ({"oom": 1}, "unknown fault 'oom'"),
        ({"fail_next_steps": -1}, r"fail_next_steps must be an integer in \[0, 1000000000\], got -1"),
        ({"fail_next_steps": 10**9 + 1}, r"fail_next_steps must be an integer in \[0, 1000000000\]"),
        ({"oom_above_batched_tokens": "8", "fail_next_steps": 2}, r"oom_above_batched_tokens must be an integer in \["),
        ({"kv_cap": {"fraction": 0.5}, "step_delay": -1}, r"step_delay must be a number of seconds in \[0, 60\]"),
        ({"kv_cap": {"fraction": 1.5}}, r"kv_cap.fraction must be a number in \[0, 1\]"),
        ({"kv_cap": {"blocks": 3, "fraction": 0.5}}, 'kv_cap must be {"blocks": N} or {"fraction": F} or null'),
        ({"swap_cap": 0.5}, "swap_cap must be"),
        ({"memory_hog": 1 << 20}, "memory_hog takes device memory outside the engine and needs a CUDA device"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.update_faults(**changes)
    assert engine.update_faults() == engine.clear_faults()  # nothing of a refused update applied
    assert engine.stats().num_device_blocks == engine.stats().num_physical_device_blocks


def test_kv_cap_and_swap_cap_shrink_the_pools_and_clearing_gives_the_blocks_back():
    engine = make_engine()
    physical = engine.stats().num_physical_device_blocks
    values = engine.update_faults(kv_cap={"fraction": 0.25}, swap_cap={"blocks": 0})
    assert (values["kv_cap"], values["swap_cap"]) == ({"fraction": 0.25}, {"blocks": 0})
    assert engine.stats().num_device_blocks == physical // 4
    assert engine.stats().num_host_blocks == 0
    assert engine.snapshot().active_faults["kv_cap"]
    engine.clear_faults()
    assert engine.stats().num_device_blocks == physical
    assert not any(engine.snapshot().active_faults.values())
