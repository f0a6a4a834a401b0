"""Plain data that crosses module boundaries: the scheduler's decisions, step results, stats, snapshots.

No torch here: the scheduler emits these, the model runner turns them into tensors, and the serving layer reads
the engine through them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.block_hash import BlockHash
from engine.core.config import PreemptionMode, SchedulerConfig
from engine.core.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request ended, as the OpenAI API names it (``error``: the engine gave up on it,
    ``engine.core.step_back_off``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class PreparedRequest:
    """A request tokenized and validated (``EngineClient.prepare_request``), not yet in the engine: what the serving
    layer holds of it. The engine builds its own mutable request from it when it is added."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    # When it reached the server (monotonic): where its latencies start.
    arrival_ts: float
    # Token ids that end it unless sampling_params.ignore_eos (the tokenizer's EOS ids).
    eos_token_ids: frozenset[int] = frozenset()
    # The hash of each full block of the prompt (``engine.core.block_hash``): what prefix caching looks up.
    block_hashes: tuple[BlockHash, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class RequestTimings:
    """When a request reached each milestone (monotonic seconds; None: not yet), and how often it was preempted."""

    arrival_ts: float
    first_scheduled_ts: float | None = None
    first_token_ts: float | None = None
    finished_ts: float | None = None
    num_preemptions: int = 0


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` take positions ``num_computed_tokens ..`` and their K/V go to
    ``block_ids`` (the request's whole block table, already large enough). When
    ``needs_sample`` the chunk reaches the request's last token and the step
    samples its next one.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    needs_sample: bool = True
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    # Stop tokens masked out of this step's sampling (min_tokens not reached yet).
    banned_token_ids: frozenset[int] = frozenset()
    # The request's tokens so far, for its penalties (empty unless sampling_params.has_penalties).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()

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
    """Everything the model runner must do this step, in order: swap out, swap in, run."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
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
    finish_reason: FinishReason | None  # once finished
    # Its milestones as of this output (the first token's time on the output that carries it).
    timings: RequestTimings
    stop_reason: int | str | None = None
    # Why the engine gave up on the request (finish reason "error").
    error: str | None = None
    # One entry per new token when the request asked for logprobs.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # Text released by the new tokens: what they complete, less a tail that may begin a stop string (held back
    # until it is decided), never a stop string itself; empty without a tokenizer.
    new_text: str = ""
    # The phase (``Request.phase``) an abort hit.
    aborted_in: str | None = None
    # Prompt tokens found in the prefix cache when it was first admitted (None: not admitted yet).
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """Queues and pools. Per pool: ``num_*_blocks`` is its capacity (all its blocks, unless a cap fault took some
    away), ``num_free_*`` what may still be allocated under it, ``num_used_*`` what block tables hold (above the
    capacity while the scheduler reclaims a new cap), ``num_physical_*`` the blocks the pool really has."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_device_blocks: int
    num_device_blocks: int
    num_used_device_blocks: int
    num_physical_device_blocks: int
    num_free_host_blocks: int
    num_host_blocks: int
    num_used_host_blocks: int
    num_physical_host_blocks: int
    num_preemptions: int
    # The batch a step may take now: the configured one, or less while backing off after failed steps.
    max_num_seqs_now: int
    max_num_batched_tokens_now: int
    # Device blocks new work must leave free while requests run (the watermark they grow into).
    num_reserved_device_blocks: int = 0
    # Prefix caching: device blocks cached under a hash (used or evictable), the evictable ones among them (counted
    # as free), and since the engine started the prompt tokens looked up at admission, those found cached, and the
    # cached blocks evicted (to make room, or by a cap).
    num_cached_device_blocks: int = 0
    num_evictable_device_blocks: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_evictions: int = 0


@dataclass(frozen=True)
class StepStats:
    """What one step did and how long it took."""

    num_scheduled: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_swapped_in_blocks: int
    num_swapped_out_blocks: int
    duration_s: float
    # KV tokens the step's rows hold after it, and the (new token, key) pairs its attention scored
    # (``engine.core.step_cost.StepShape``: what a step-cost model is fitted on).
    num_context_tokens: int = 0
    num_attended_pairs: int = 0
    preemptions: tuple[PreemptionEvent, ...] = ()
    # Time spent moving blocks between the device and host pools.
    swap_s: float = 0.0
    # The type of the error the step's forward pass raised (the step changed nothing, and the engine backs off).
    error: str | None = None


@dataclass(frozen=True)
class RequestSnapshot:
    """One live request as the engine last left it."""

    request_id: str
    phase: str  # see Request.phase
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_preemptions: int


class RemainingWork(NamedTuple):
    """What one live request still needs from the engine, as the scheduler sees it now. A named tuple, not a
    dataclass: every step builds one per live request, and a tuple costs half as much to build."""

    # Prompt and outputs so far (the last output is computed in the request's next step).
    num_tokens: int
    # Tokens whose KV is computed: num_tokens - 1 while decoding, less while a prompt (or a recompute) is pending.
    num_computed_tokens: int
    # Outputs still to come at most (max_tokens less those produced).
    num_remaining_outputs: int
    # Its place in the scheduler's queues (``Request.place_in_line_ts``).
    place_in_line_ts: float
    # Blocks its table holds: on the device while it runs, on the host while it is swapped out.
    num_blocks: int = 0
    # Prefix caching: the hash of each full block of its tokens so far, and (running only) the hash each block of
    # its table is cached under (None: not cached); empty with prefix caching off.
    block_hashes: tuple[BlockHash, ...] = ()
    table_hashes: tuple[BlockHash | None, ...] = ()


# The steps the engine measures at start-up (``ModelRunner.measure_step_costs``): a prompt of this many tokens, a
# decode of one row and one of this many.
PROBE_PROMPT_TOKENS = 128
PROBE_DECODE_ROWS = 8


@dataclass(frozen=True)
class StepCosts:
    """One engine step's time as measured at start-up: a fixed cost per step, plus a cost per prompt token, plus a
    cost per decode row. A decode row costs far more than a prompt token, and the fixed cost dominates a small
    batch: measured on the bundled model in float32, 30 ms for a step of one decode against 1.2 ms per prompt
    token."""

    per_step_s: float
    per_prompt_token_s: float
    per_decode_s: float

    @classmethod
    def from_probes(
        cls, prefill_s: float, num_prompt_tokens: int, one_decode_s: float, decodes_s: float, num_decode_rows: int
    ) -> StepCosts:
        """From three steps' times: a prefill of ``num_prompt_tokens``, a decode of one row and one of
        ``num_decode_rows``."""
        per_decode_s = max((decodes_s - one_decode_s) / (num_decode_rows - 1), 0.0)
        per_step_s = max(one_decode_s - per_decode_s, 0.0)
        per_prompt_token_s = max(prefill_s - per_step_s, 0.0) / num_prompt_tokens or prefill_s / num_prompt_tokens
        return cls(per_step_s, per_prompt_token_s, per_decode_s)

    def prompt_tokens_per_s(self, num_prompt_tokens: int) -> float:
        """The throughput of a step that computes ``num_prompt_tokens`` prompt tokens and nothing else."""
        return num_prompt_tokens / (self.per_step_s + num_prompt_tokens * self.per_prompt_token_s)


@dataclass(frozen=True)
class CpuShare:
    """The engine's threads now, how many it may use, and the CPU other processes took from its cores (in cores,
    over the last read; None before the first or where /proc/stat cannot be read): ``engine.cpu_share``."""

    threads: int
    max_threads: int
    co_tenant_cores: float | None
    # How the count is chosen: "follows the CPU share", or why it is fixed.
    policy: str


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine between two steps, as plain data: everything the serving layer may know about its state."""

    stats: SchedulerStats
    # Prefill throughput the engine measures as it runs (tokens/s): what a recompute costs its preemption policy.
    prefill_tokens_per_s: float
    # Host <-> device block copies as the engine measures them (bytes/s): what a swap costs its preemption policy.
    copy_bytes_per_s: float
    # Every run-time fault and whether it is active now (engine.faults).
    active_faults: dict[str, bool]
    last_step: StepStats | None = None
    # Every live request's remaining work, each queue in its scheduling order.
    running_work: tuple[RemainingWork, ...] = ()
    swapped_work: tuple[RemainingWork, ...] = ()
    waiting_work: tuple[RemainingWork, ...] = ()
    # Only when asked for (it walks every live request).
    requests: tuple[RequestSnapshot, ...] | None = None
    # Cached device blocks no request holds, the next to be evicted first (``BlockPool.evictable_hashes``).
    evictable_block_hashes: tuple[BlockHash, ...] = ()
    # Cached device blocks, held or not, that a second request took (``BlockPool.reused_hashes``).
    reused_block_hashes: frozenset[BlockHash] = frozenset()
    # On the CPU: the threads the next step runs on.
    cpu_share: CpuShare | None = None


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` produced and the engine after it: every output (each complete), and the snapshot."""

    outputs: list[RequestOutput]
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class EngineInfo:
    """What does not change while the engine runs."""

    model: str
    device: str
    dtype: str
    # Why this dtype: "--dtype bfloat16", "auto: the CPU has avx512_bf16", ... (engine.model.registry).
    dtype_choice: str
    max_model_len: int
    vocab_size: int
    block_size: int
    bytes_per_block: int
    attention_backend: str
    # How the linear layers multiply: "onednn-packed" or "torch".
    matmul: str
    # How RMSNorm and rotary embeddings run: "cpu-kernels" or "torch".
    layer_ops: str
    # The scheduler's rules and the share of the device pool new work leaves free (what a forecast replays).
    scheduler_config: SchedulerConfig
    watermark: float
    # Measured at start-up (``ModelRunner.measure_step_costs``): the prior of admission's step-time model.
    step_costs: StepCosts
    # Whether requests share cached prompt prefixes (``engine.core.kv_cache_manager``).
    enable_prefix_caching: bool = False
    # On the CPU, the instruction set the engine may use and the CPU's own ("instruction set capped at avx2 by
    # KVSTORM_CPU_ISA (the CPU has avx512-bf16)": ``kernels.cpu_isa``); empty elsewhere.
    instruction_set: str = ""
    # On the CPU, the threads a step runs on and how they are chosen ("2 threads, fewer while other processes take
    # a core"); empty elsewhere.
    cpu_threads: str = ""
