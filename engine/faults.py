"""Faults the chaos harness turns on at run time (``/admin/faults``), each raised where the real one happens.

=========================  ===============================  ==========================================================
fault                      value                            what a real system would see
=========================  ===============================  ==========================================================
``kv_cap``                 ``{"blocks": N}`` or             VRAM taken by a co-tenant or a fragmented allocator: the
                           ``{"fraction": F}``              usable device KV pool shrinks; blocks in use above the cap
                                                            are reclaimed by preemption in the next steps
``swap_cap``               the same                         less pinned host memory: the usable swap pool shrinks, and
                                                            a swap that no longer fits falls back to recompute
``swap_delay_per_block``   seconds, [0, 60]                 a congested host link: each block moved takes longer (one
                                                            move waits 60 s at most, however many blocks it moves)
``step_delay``             seconds, [0, 60]                 a slow or throttled device: each step takes longer
``oom_above_batched_tokens``  tokens, [0, 10**9]            activations that no longer fit: a larger step raises
                                                            ``torch.OutOfMemoryError`` before its forward pass
``fail_next_steps``        count, [0, 10**9]                the next N steps raise ``torch.OutOfMemoryError``
``memory_hog``             bytes, [0, 2**40]                device memory held outside the engine (CUDA only)
=========================  ===============================  ==========================================================

Out-of-memory errors are raised from the model runner just before a step's forward pass, where a device that ran
out of memory raises them, so the engine's recovery (``engine.core.step_back_off``) is the code a real one meets.
``null`` (or 0) turns a fault off. An update is validated whole before any of it applies; every value is finite and
bounded, so none can overflow a sleep or a timer. The delays sleep in slices of ``DELAY_SLICE_S`` and re-read their
fault between slices: ``cut_delays`` (from any thread, without the engine's lock) ends one within a slice, so a
clear or a lease expiry is not stuck behind a long sleep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.fault_limits import FaultValues, sleep_while_wanted
from engine.core.outputs import SchedulerOutput


@dataclass
class EngineFaults(FaultValues):
    """The faults' values, and where the model runner raises them."""

    def cut_delays(self) -> None:
        """End the delays now, a sleep in progress included (within a slice). Safe from any thread: two float
        stores, which the sleeping thread re-reads."""
        self.step_delay = 0.0
        self.swap_delay_per_block = 0.0

    def before_forward(self, output: SchedulerOutput) -> None:
        """The step's slowness, then its out-of-memory faults."""
        if self.step_delay:
            sleep_while_wanted(lambda: self.step_delay)
        failure = self.take_step_failure(output.num_batched_tokens)
        if failure is not None:
            raise torch.OutOfMemoryError(failure)

    def delay_block_moves(self, num_blocks: int) -> None:
        if self.swap_delay_per_block and num_blocks:
            sleep_while_wanted(lambda: self.block_moves_delay_s(num_blocks))
