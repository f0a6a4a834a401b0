"""Which way to preempt a victim: swap its blocks to host memory, or drop them and recompute later."""

from __future__ import annotations

from engine.core.config import PreemptionMode


class PreemptionPolicy:
    """Chooses swap or recompute per victim.

    ``auto`` compares estimated costs: moving the victim's blocks out and back
    at the copy bandwidth against re-running its computed tokens at the prefill
    throughput. Both start from a measurement at start-up and follow what the
    engine then observes (exponential moving averages of its swaps and of its
    prefill-heavy steps), so a host link that slows down turns ``auto`` towards
    recompute. A swap that does not fit in the host pool falls back to recompute.
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
        self.copy_bytes_per_s = copy_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def swap_cost_s(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s

    def recompute_cost_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

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
            self.prefill_tokens_per_s = self._smoothed(self.prefill_tokens_per_s, num_tokens / seconds)

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0 and seconds > 0:
            self.copy_bytes_per_s = self._smoothed(self.copy_bytes_per_s, num_blocks * self.bytes_per_block / seconds)

    def _smoothed(self, average: float, sample: float) -> float:
        return (1 - self.SMOOTHING) * average + self.SMOOTHING * sample
