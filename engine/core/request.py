"""A request's state as the scheduler and the engine share it. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.core.block_hash import ROOT_HASH, BlockHash, extend_block_hashes, hash_block
from engine.core.outputs import FinishReason, PreparedRequest, RequestTimings
from engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Which queue holds the request, or none (finished; ``Request.finish_reason`` says why)."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: queues find a request by what it is, not by equal fields
class Request:
    """One generation request.

    The one rule of scheduling: the request needs ``num_tokens`` tokens in the
    KV cache and has ``num_computed_tokens`` of them; each step hands it some of
    the difference. When it catches up, its last logits give the next token.
    A prefill, a chunk, a decode and a recompute after preemption are all the
    same arithmetic.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_ts: float = field(default_factory=time.monotonic)
    # A request sent again after the Retry-After it was refused with: its first attempt's arrival, which keeps its
    # place in line (ahead of the requests that arrived since); None for any other request.
    first_attempt_ts: float | None = None
    # Set by the scheduler: breaks ties between equal arrival times in submission order.
    submission_index: int = 0
    # Token ids that end the request unless sampling_params.ignore_eos (the tokenizer's EOS ids).
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    # The output decoded so far (by the engine, when the model has a tokenizer), stop string included.
    output_text: str = ""
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_ts: float | None = None
    first_token_ts: float | None = None
    finished_ts: float | None = None
    # The stop token id or stop string that ended the request, if one did.
    stop_reason: int | str | None = None
    # Block size of the KV cache whose prefix blocks ``block_hashes`` names (0: none are hashed).
    block_size: int = 0
    # The hash of each full block of prompt and output so far (``engine.core.block_hash``), for prefix caching.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Prompt tokens found in the prefix cache at the first admission (None until then).
    num_cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.block_size:
            extend_block_hashes(self.block_hashes, self.prompt_token_ids, self.block_size)

    @property
    def place_in_line_ts(self) -> float:
        """What the scheduler's queues are ordered by: the arrival, or the first attempt's for a retry."""
        return self.arrival_ts if self.first_attempt_ts is None else self.first_attempt_ts

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """All it may ever need in the KV cache: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        """One more output token; the block it fills, if any, gets its hash (one block at a time: the blocks
        before it have theirs)."""
        self.output_token_ids.append(token_id)
        end = self.num_tokens
        if self.block_size and end % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            self.block_hashes.append(hash_block(parent, self.token_ids(end - self.block_size, end)))

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt followed by output."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @classmethod
    def from_prepared(
        cls, prepared: PreparedRequest, block_size: int, first_attempt_ts: float | None = None
    ) -> Request:
        return cls(
            request_id=prepared.request_id,
            prompt_token_ids=list(prepared.prompt_token_ids),
            sampling_params=prepared.sampling_params,
            arrival_ts=prepared.arrival_ts,
            first_attempt_ts=first_attempt_ts,
            eos_token_ids=prepared.eos_token_ids,
            block_size=block_size,
            block_hashes=list(prepared.block_hashes),
        )

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def timings(self) -> RequestTimings:
        return RequestTimings(
            self.arrival_ts, self.first_scheduled_ts, self.first_token_ts, self.finished_ts, self.num_preemptions
        )

    @property
    def phase(self) -> str:
        """Where the request is: queued, prefill (more than one token to compute), decode, swapped or finished."""
        if self.status is RequestStatus.WAITING:
            return "queued"
        if self.status is RequestStatus.SWAPPED:
            return "swapped"
        if self.status is RequestStatus.RUNNING:
            pending = self.num_tokens - self.num_computed_tokens
            return "prefill" if pending > 1 or not self.output_token_ids else "decode"
        return "finished"

    def banned_token_ids(self) -> frozenset[int]:
        """Tokens that may not be sampled yet: every stop token until ``min_tokens`` are out."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            return frozenset()
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
