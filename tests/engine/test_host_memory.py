"""How a CPU engine holds host memory: its KV cache on memory advised for huge pages, and the memory its steps free
kept, so that a later step reuses it instead of faulting in fresh pages."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import torch

from engine.attention.kv_cache import PagedKVCache
from engine.host_memory import zeros_on_huge_pages

HUGE_PAGE = 2 << 20


def _vm_flags_at(address: int) -> set[str]:
    """The flags (/proc/self/smaps) of this process's mapping that holds address: "hg" once advised for huge pages."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: "start-end perms offset dev inode [path]"
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "VmFlags:":
            return set(fields[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_cpu_kv_cache_is_zeroed_memory_advised_for_huge_pages_and_outlives_its_builder():
    shape = SimpleNamespace(num_layers=4, num_kv_heads=3, head_dim=64)
    cache = PagedKVCache(shape, num_blocks=200, block_size=16, dtype=torch.bfloat16, device="cpu")  # 4.9 MB
    address = cache.data.data_ptr()
    assert address % HUGE_PAGE == 0
    assert "hg" in _vm_flags_at(address)
    assert cache.data.shape == (4, 2, 200, 16, 3, 64)
    assert cache.data.dtype == torch.bfloat16
    assert not cache.data.any()
    # The mapping lives as long as a view of it: written and read through a layer's view after a collection.
    gc.collect()
    cache.layers[3][1][199].fill_(1.5)
    assert cache.data[3, 1, 199].eq(1.5).all()
    assert cache.data.float().sum() == 1.5 * 16 * 3 * 64
    # The control: torch's own allocation of the same size is not advised.
    plain = torch.zeros(cache.data.shape, dtype=torch.bfloat16)
    assert "hg" not in _vm_flags_at(plain.data_ptr())
    # Less than a huge page is not worth a mapping of its own: plain zeros.
    small = zeros_on_huge_pages((1000,), torch.float32)
    assert small.shape == (1000,)
    assert not small.any()
    assert "hg" not in _vm_flags_at(small.data_ptr())


# In a fresh process (malloc's thresholds are process-wide and cannot be set back), the real model on a thread that
# is not the main one, as the server's engine loop is: the first 32 requests of the w1 benchmark, at most 16 tokens
# each. Prints the page faults of each step of that thread.
_STEPS_ON_A_THREAD = textwrap.dedent(
    """
    import resource, sys, threading
    import engine.model_runner
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLM
    from kvstorm.bench.w1 import w1_throughput

    if sys.argv[1] == "glibc-defaults":
        engine.model_runner.keep_freed_host_memory = lambda: None
    llm_engine = LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory=1 << 30, swap_space=0).engine
    workload = w1_throughput(32)

    def steps(faults):
        for prompt, output_len in zip(workload.prompts, workload.output_lens):
            params = SamplingParams(max_tokens=min(output_len, 16), temperature=0.0, ignore_eos=True)
            llm_engine.add_request(prompt, params)
        while llm_engine.has_unfinished_requests():
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            llm_engine.step()
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    faults = []
    thread = threading.Thread(target=steps, args=(faults,))
    thread.start()
    thread.join()
    print(*faults)
    """
)


def _faults_per_step(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS_ON_A_THREAD, mode], capture_output=True, text=True, timeout=300, check=True
    )
    return [int(faults) for faults in done.stdout.split()]


def test_a_cpu_engine_on_a_thread_reuses_the_memory_its_earlier_steps_freed():
    # The first two steps map their memory once, whatever the allocator does.
    kept = _faults_per_step("kept")
    assert sum(kept[2:]) < 1_000, kept
    # The control, measured rather than assumed: whether glibc's defaults fault the later steps' pages in again
    # depends on the machine (about 100,000 faults with AVX512-BF16's bfloat16 matmuls; none on an AVX2-only CPU,
    # whose kernels free their memory another way). Where they do, the engine's settings must remove nearly all of
    # that; nowhere may they cost faults the defaults do not.
    defaults = _faults_per_step("glibc-defaults")
    assert len(defaults) == len(kept)
    refaulted = sum(defaults[2:])
    print(f"later steps' page faults: {sum(kept[2:])} kept, {refaulted} with glibc's defaults")
    assert sum(kept[2:]) <= max(refaulted // 10, 1_000), (kept, defaults)
