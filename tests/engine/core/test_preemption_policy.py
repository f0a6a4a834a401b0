"""Auto preemption follows what swaps and prefills really cost."""

from __future__ import annotations

from engine.core.config import PreemptionMode
from engine.core.preemption import PreemptionPolicy

BLOCK_BYTES = 720 << 10  # one block of the real model, float32


def test_auto_turns_to_recompute_within_a_few_swaps_once_the_host_link_slows_down():
    policy = PreemptionPolicy(PreemptionMode.AUTO, BLOCK_BYTES, copy_bytes_per_s=10e9, prefill_tokens_per_s=800)
    victim = {"num_blocks": 8, "num_computed_tokens": 120, "host_has_room": True}
    assert policy.choose(**victim) == (PreemptionMode.SWAP, "cheaper")
    choices = []
    for _ in range(5):
        policy.observe_swap(num_blocks=8, seconds=8 * 0.03)  # 30 ms a block: about 25 MB/s
        choices.append(policy.choose(**victim)[0])
    assert choices[-1] is PreemptionMode.RECOMPUTE
    assert choices.index(PreemptionMode.RECOMPUTE) <= 2
    for _ in range(20):
        policy.observe_swap(num_blocks=8, seconds=8 * 1e-4)  # the link recovers
    assert policy.choose(**victim) == (PreemptionMode.SWAP, "cheaper")


def test_forced_modes_and_a_full_host_pool_need_no_estimate():
    policy = PreemptionPolicy(PreemptionMode.SWAP, BLOCK_BYTES)
    assert policy.choose(8, 120, host_has_room=True) == (PreemptionMode.SWAP, "requested")
    assert policy.choose(8, 120, host_has_room=False) == (PreemptionMode.RECOMPUTE, "host_pool_full")
    recompute = PreemptionPolicy(PreemptionMode.RECOMPUTE, BLOCK_BYTES)
    assert recompute.choose(1, 10_000, host_has_room=True) == (PreemptionMode.RECOMPUTE, "requested")
