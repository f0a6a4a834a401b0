"""Faults the chaos harness turns on through ``/admin/faults``, raised where the real ones would be.

Both raise ``torch.OutOfMemoryError`` from the model runner just before a step's forward pass, the point where a
device that ran out of memory raises it, so the engine's recovery (``engine.core.step_back_off``) is the same code a
real out-of-memory error meets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.outputs import SchedulerOutput


@dataclass
class StepFaults:
    # A VRAM cap: a step of more tokens than this runs out of memory (None: no cap).
    oom_above_batched_tokens: int | None = None
    # The next N steps run out of memory, whatever their size.
    fail_next_steps: int = 0

    def update(self, **changes: object) -> None:
        """Set some fields; ``ValueError`` names a field that does not exist or a value that is not allowed."""
        for name, value in changes.items():
            if name not in self.__dataclass_fields__:
                raise ValueError(f"unknown fault {name!r}; faults: {', '.join(self.__dataclass_fields__)}")
            allows_none = self.__dataclass_fields__[name].default is None  # off is None, not 0
            if not (value is None and allows_none) and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be an integer >= 0{' or null' if allows_none else ''}, got {value!r}")
        for name, value in changes.items():
            setattr(self, name, value)

    def active(self) -> dict[str, bool]:
        return {name: getattr(self, name) not in (None, 0) for name in self.__dataclass_fields__}

    def check(self, output: SchedulerOutput) -> None:
        if self.fail_next_steps > 0:
            self.fail_next_steps -= 1
            raise torch.OutOfMemoryError(f"injected: out of memory in a step of {output.num_batched_tokens} tokens")
        cap = self.oom_above_batched_tokens
        if cap is not None and output.num_batched_tokens > cap:
            raise torch.OutOfMemoryError(
                f"injected VRAM cap: a step of {output.num_batched_tokens} tokens, room for {cap}"
            )
