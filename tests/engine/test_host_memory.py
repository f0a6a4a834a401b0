"""A CPU engine keeps the host memory its steps free: a later step reuses it instead of faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
    # The control: with glibc's defaults, the same later steps (the prefill chunks' activations) fault their pages
    # in again, about 100,000 of them on this machine.
    defaults = _faults_per_step("glibc-defaults")
    assert len(defaults) == len(kept)
    assert sum(defaults[2:]) > 10_000, defaults
