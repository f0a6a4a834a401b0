"""After a failed step (out of memory, say), smaller batches until steps succeed again.

A step that raised changed nothing the scheduler keeps: no request advanced, and the blocks it allocated stay with
their requests for the retry. What the failure asks for is a smaller step, because what runs out in a step is
memory that grows with the batch (activations, logits), not the KV pool, which is allocated once. So each failure
halves the number of requests and tokens the next step may take; a run of successes doubles them back. A request
that fails alone, in the smallest step there is, fails ``max_failures_alone`` times in a row: then it is the cause,
not the batch, and the engine gives up on it (it ends with finish reason ``error``) so the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLimit:
    max_num_seqs: int
    max_num_batched_tokens: int


class StepBackOff:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        min_num_batched_tokens: int = 1,
        successes_to_grow: int = 8,
        max_failures_alone: int = 3,
    ) -> None:
        """``min_num_batched_tokens``: the smallest token budget that still lets every request run (1 with
        chunked prefill; without it, a whole prompt must fit one step, so the budget never shrinks)."""
        self.full = BatchLimit(max_num_seqs, max_num_batched_tokens)
        self.min_num_batched_tokens = min_num_batched_tokens
        self.successes_to_grow = successes_to_grow
        self.max_failures_alone = max_failures_alone
        self.limit = self.full
        self.num_failures = 0
        self._successes = 0
        self._failures_at_smallest = 0

    @property
    def is_backing_off(self) -> bool:
        return self.limit != self.full

    def on_failure(self, num_seqs: int, num_batched_tokens: int) -> bool:
        """A step of this size failed. True when it was one request in the smallest step, failing for the
        ``max_failures_alone``-th time in a row: give up on that request."""
        self.num_failures += 1
        self._successes = 0
        if num_seqs <= 1 and num_batched_tokens <= self.min_num_batched_tokens:
            self._failures_at_smallest += 1
        self.limit = BatchLimit(
            max(1, min(self.limit.max_num_seqs, num_seqs // 2)),
            max(self.min_num_batched_tokens, min(self.limit.max_num_batched_tokens, num_batched_tokens // 2)),
        )
        if self._failures_at_smallest >= self.max_failures_alone:
            self._failures_at_smallest = 0
            return True
        return False

    def on_success(self) -> None:
        self._failures_at_smallest = 0
        if not self.is_backing_off:
            return
        self._successes += 1
        if self._successes >= self.successes_to_grow:
            self._successes = 0
            self.limit = BatchLimit(
                min(self.full.max_num_seqs, self.limit.max_num_seqs * 2),
                min(self.full.max_num_batched_tokens, self.limit.max_num_batched_tokens * 2),
            )
