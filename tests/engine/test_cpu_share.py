"""The engine's threads follow the CPU other processes leave (engine.cpu_share): the reading of /proc/stat, the
decision from it, and a real ``kvstorm serve`` beside a real busy process, whose answers stay the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import requests

from chaos.injectors.processes import kvstorm_server
from engine.cpu_share import CONFIRMATIONS, ThreadGovernor, read_cpu_busy_s, thread_levels
from tests.engine.serving.conftest import metric_value

STAT = """cpu  900 0 900 9000 0 0 0 0 0 0
cpu0 100 10 200 5000 70 3 4 5 0 0
cpu1 300 0 400 4000 0 0 0 0 0 0
intr 12345
"""


def test_busy_time_is_every_running_column_of_the_cpus_asked_for_steal_included(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    ticks = os.sysconf("SC_CLK_TCK")
    assert read_cpu_busy_s(frozenset({0}), str(stat)) == pytest.approx((100 + 10 + 200 + 3 + 4 + 5) / ticks)
    assert read_cpu_busy_s(frozenset({0, 1}), str(stat)) == pytest.approx((322 + 700) / ticks)
    assert read_cpu_busy_s(frozenset({0, 2}), str(stat)) is None  # a CPU the file does not list
    assert read_cpu_busy_s(frozenset({0}), str(tmp_path / "absent")) is None


def test_the_levels_are_every_count_up_to_four_then_the_ones_a_core_or_half_the_cores_leave():
    assert thread_levels(1) == (1,)
    assert thread_levels(2) == (2, 1)
    assert thread_levels(4) == (4, 3, 2, 1)
    assert thread_levels(16) == (16, 15, 8, 1)


class FakeCpu:
    """Two CPUs whose other processes' use the test sets, read at a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.others_cores = 0.0
        self.set_calls: list[int] = []

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy += self.others_cores * seconds

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(
            2,
            frozenset({0, 1}),
            read_busy=lambda cpus: self.busy,
            own_cpu_s=lambda: 0.0,
            clock=lambda: self.now,
            set_threads=self.set_calls.append,
        )


def test_a_core_taken_costs_a_thread_at_once_and_it_comes_back_only_after_reads_in_a_row_without_it():
    cpu = FakeCpu()
    governor = cpu.governor()
    assert governor.follow() == 2
    assert cpu.set_calls == [2]
    cpu.others_cores = 0.3  # under CORE_TAKEN_AT: a core is not taken
    cpu.advance(0.25)
    assert governor.sample() == 2
    cpu.others_cores = 1.0
    cpu.advance(0.25)
    assert governor.sample() == 1
    assert governor.share().co_tenant_cores == pytest.approx(1.0)
    assert governor.follow() == 1
    assert cpu.set_calls == [2, 1]
    assert governor.follow() == 1
    assert cpu.set_calls == [2, 1]
    cpu.others_cores = 0.05
    for _ in range(CONFIRMATIONS - 1):
        cpu.advance(0.25)
        assert governor.sample() == 1
    cpu.others_cores = 0.9  # back before the confirmations: the count stays down, and the count starts over
    cpu.advance(0.25)
    assert governor.sample() == 1
    cpu.others_cores = 0.0
    for _ in range(CONFIRMATIONS):
        cpu.advance(0.25)
        governor.sample()
    assert governor.follow() == 2
    assert cpu.set_calls == [2, 1, 2]


def test_each_thread_that_follows_gets_the_count_set_on_it():
    """torch's thread count is per thread: the loader's count is not the engine thread's."""
    cpu = FakeCpu()
    governor = cpu.governor()
    governor.follow()
    other = threading.Thread(target=governor.follow)
    other.start()
    other.join()
    assert cpu.set_calls == [2, 2]


def test_the_governor_never_goes_below_one_thread_nor_reads_a_window_of_no_time():
    cpu = FakeCpu()
    governor = cpu.governor()
    cpu.others_cores = 5.0
    cpu.advance(0.25)
    assert governor.sample() == 1
    assert governor.sample() == 1  # the clock did not move: nothing new to read


def test_a_server_beside_a_busy_process_runs_on_fewer_threads_with_the_same_answers_and_takes_them_back(tmp_path):
    """A real ``kvstorm serve`` (bfloat16 where the CPU multiplies it, else float32) and a process that keeps a core
    busy for at most 60 s: /metrics shows the threads fall while it runs and come back after, and a greedy answer
    with its log-probs is the same bits on either count (the gauges are read after a request: they move with the
    engine's steps)."""
    with kvstorm_server(("--num-kv-blocks", "64"), tmp_path / "server.log") as server:
        if len(os.sched_getaffinity(0)) < 2:  # nothing to give up: the start-up line says the count is fixed
            assert "1 CPU thread (fixed: no fewer to run on)" in (tmp_path / "server.log").read_text()
            return
        url = server.url

        def metric(name: str) -> float:
            return metric_value(requests.get(f"{url}/metrics", timeout=10).text, name)

        def threads() -> float:
            """As of a step just run (the gauges move with the engine's steps)."""
            answer()
            return metric("kvstorm:cpu_threads")

        def answer() -> dict:
            body = {"model": "smollm2-135m", "prompt": "The three primary colors are", "max_tokens": 24,
                    "temperature": 0, "logprobs": 3}  # fmt: skip
            choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
            return {"text": choice["text"], "logprobs": choice["logprobs"]}

        alone = answer()
        most = threads()
        assert most >= 2
        busy = subprocess.Popen(
            [sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"]
        )
        try:
            assert wait_for(lambda: threads() < most), f"still {threads()} threads beside a busy process"
            beside = answer()
        finally:
            busy.kill()
            busy.wait()
        assert wait_for(lambda: threads() == most), f"{threads()} threads, not {most}, once the process ended"
        assert beside == alone
        assert metric("kvstorm:cpu_co_tenant_cores") < 0.4


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False
