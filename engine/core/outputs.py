"""Plain data that crosses module boundaries: the scheduler's decisions, step results, stats.

No torch here: the scheduler emits these, the model runner turns them into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import PreemptionMode
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` take positions ``num_computed_tokens ..`` and their K/V go to
    ``block_ids`` (the request's whole block table, already large enough). When
    ``needs_sample`` the chunk reaches the request's last token and the step
    samples its next one.
    """

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    request_id: str = ""
    needs_sample: bool = True
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    # Stop tokens masked out of this step's sampling (min_tokens not reached yet).
    banned_token_ids: frozenset[int] = frozenset()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PreemptionEvent:
    request_id: str
    mode: PreemptionMode
    num_blocks: int
    num_computed_tokens: int
    ts: float
    # Why this mode: "requested", "cheaper", or "host_pool_full" (a swap that fell back to recompute).
    reason: str


@dataclass
class SchedulerOutput:
    """Everything the model runner must do this step, in order: swap out, swap in, copy, run."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
    preemptions: list[PreemptionEvent] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of the model's distribution (before temperature, top-k/p or banned tokens) at one position."""

    token_id: int
    logprob: float
    # The most likely tokens at this position, most likely first.
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class ExecuteResult:
    """What the model runner returns for one step."""

    sampled: dict[str, int]
    # Only for requests that asked for logprobs.
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    stop_reason: int | str | None = None
    # Why the engine gave up on the request (finish reason "error").
    error: str | None = None
    # One entry per new token when the request asked for logprobs.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # The text the new tokens complete (empty while a character is still partial, or without a tokenizer).
    new_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_device_blocks: int
    num_device_blocks: int
    num_free_host_blocks: int
    num_host_blocks: int
    num_preemptions: int
    # The batch a step may take now: the configured one, or less while backing off after failed steps.
    max_num_seqs_now: int
    max_num_batched_tokens_now: int
