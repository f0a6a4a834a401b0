"""Which way to preempt a victim: swap its blocks to host memory, or drop them and recompute later."""

from __future__ import annotations

from engine.core.config import PreemptionMode


class PreemptionPolicy:
    """Chooses swap or recompute per victim.

    ``auto`` compares estimated costs: moving the victim's blocks out and back
    at the copy bandwidth against re-running its computed tokens at the prefill
    throughput. Both start from a measurement at start-up and follow what the
    engine then observes (exponential moving averages of the cost per byte of its
    swaps and per token of its prefill-heavy steps), so a host link that slows
    down turns ``auto`` towards recompute within a few swaps. A swap that does not
    fit in the host pool falls back to recompute.
    """

    SMOOTHING = 0.2

    def __init__(
        self,
        mode: PreemptionMode,
        bytes_per_block: int,
        copy_bytes_per_s: float = 1e9,
        prefill_tokens_per_s: float = 1e3,
    ) -> None:
        self.mode = mode
        self.bytes_per_block = bytes_per_block
        # Costs per unit, averaged: an average of rates would let one fast start-up measurement hide a link that
        # became a hundred times slower for dozens of samples; an average of costs follows it within a few.
        self.seconds_per_byte = 1 / copy_bytes_per_s
        self.seconds_per_prefill_token = 1 / prefill_tokens_per_s

    @property
    def copy_bytes_per_s(self) -> float:
        return 1 / self.seconds_per_byte

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1 / self.seconds_per_prefill_token

    def swap_cost_s(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block * self.seconds_per_byte

    def recompute_cost_s(self, num_tokens: int) -> float:
        return num_tokens * self.seconds_per_prefill_token

    def choose(self, num_blocks: int, num_computed_tokens: int, host_has_room: bool) -> tuple[PreemptionMode, str]:
        """The mode for this victim and why."""
        if self.mode is PreemptionMode.RECOMPUTE:
            return PreemptionMode.RECOMPUTE, "requested"
        if not host_has_room:
            return PreemptionMode.RECOMPUTE, "host_pool_full"
        if self.mode is PreemptionMode.SWAP:
            return PreemptionMode.SWAP, "requested"
        if self.swap_cost_s(num_blocks) < self.recompute_cost_s(num_computed_tokens):
            return PreemptionMode.SWAP, "cheaper"
        return PreemptionMode.RECOMPUTE, "cheaper"

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.seconds_per_prefill_token = self._smoothed(self.seconds_per_prefill_token, seconds / num_tokens)

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0 and seconds > 0:
            sample = seconds / (num_blocks * self.bytes_per_block)
            self.seconds_per_byte = self._smoothed(self.seconds_per_byte, sample)

    def _smoothed(self, average: float, sample: float) -> float:
        return (1 - self.SMOOTHING) * average + self.SMOOTHING * sample
