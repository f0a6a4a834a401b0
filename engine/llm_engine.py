"""The engine: requests in, one ``step()`` at a time, outputs out; and ``LLM`` for offline batches.

step():  schedule -> swap -> run the model -> sample -> update queues -> decide who is done -> outputs
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.kv_cache import kv_cache_bytes_per_block
from engine.attention.selector import make_attention_backend
from engine.core.block_hash import BlockHash, extend_block_hashes
from engine.core.block_pool import BlockPool
from engine.core.config import EngineConfig
from engine.core.interface import InvalidRequest, Prompt, PromptTooLong
from engine.core.kv_cache_manager import KVCacheManager, num_blocks_for
from engine.core.outputs import (
    PROBE_PROMPT_TOKENS,
    EngineInfo,
    EngineSnapshot,
    FinishReason,
    PreemptionEvent,
    PreparedRequest,
    RequestOutput,
    RequestSnapshot,
    SchedulerOutput,
    SchedulerStats,
    StepResult,
    StepStats,
    TokenLogprobs,
)
from engine.core.preemption import PreemptionPolicy
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.step_cost import StepShape
from engine.core.stopping import check_stop, releasable_text_end
from engine.cpu_share import describe_threads
from engine.faults import EngineFaults
from engine.model.llama import LlamaForCausalLM
from engine.model.registry import describe_dtype_choice, resolve_device, resolve_dtype, resolve_model
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.model_runner import ModelRunner
from kernels.cpu_isa import check_library_caps, describe_cpu_isa

logger = logging.getLogger(__name__)


@dataclass
class _TextState:
    """A live request's detokenizer and how much of its text has gone out in outputs."""

    detokenizer: IncrementalDetokenizer
    num_released_chars: int = 0


class LLMEngine:
    """Continuous batching over a paged KV cache for one model (implements ``engine.core.interface.EngineClient``).

    ``add_request`` rejects (``ValueError``) a request that can never fit; it
    never fails later for lack of memory: it waits, is preempted, or runs.
    Every finish is decided here, and each ``RequestOutput`` is built once, complete (``_output``).
    """

    PREEMPTION_LOG_SIZE = 10_000

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        kv_cache_manager: KVCacheManager,
        preemption_policy: PreemptionPolicy,
        info: EngineInfo,
        tokenizer: Tokenizer | None,
        load_timings: dict[str, float] | None = None,
    ) -> None:
        """An engine over parts already built (``from_config`` builds them); the runner's faults are the engine's."""
        self.config = config
        self.runner = runner
        self.faults: EngineFaults = runner.faults
        self.kv_cache_manager = kv_cache_manager
        self.preemption_policy = preemption_policy
        self.info = info
        self.tokenizer = tokenizer
        self.load_timings = load_timings or {}
        self.device = runner.device
        self.scheduler = Scheduler(config.scheduler, kv_cache_manager, preemption_policy, config.cache.watermark)
        # Device memory a memory_hog fault holds outside the engine (None: no hog).
        self._memory_hog: torch.Tensor | None = None
        self.preemption_log: collections.deque[PreemptionEvent] = collections.deque(maxlen=self.PREEMPTION_LOG_SIZE)
        self.last_step: StepStats | None = None
        # Per live request when the model has a tokenizer.
        self._texts: dict[str, _TextState] = {}
        self._ids = itertools.count()

    @classmethod
    def from_config(
        cls, config: EngineConfig, tokenizer: Tokenizer | None = None, model: LlamaForCausalLM | None = None
    ) -> LLMEngine:
        """Load the model and tokenizer (unless given), size both block pools from their byte budgets, measure the
        host link and the prefill throughput the preemption policy starts from, and build the engine."""
        check_library_caps()
        model, tokenizer, dtype_choice, load_timings = _load(config, tokenizer, model)
        cache = config.cache
        dtype = next(model.parameters()).dtype
        bytes_per_block = kv_cache_bytes_per_block(model.config, cache.block_size, dtype)
        num_device_blocks = cache.num_kv_blocks or cache.kv_cache_memory // bytes_per_block
        if num_device_blocks < 1:
            raise ValueError(f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block of {bytes_per_block} bytes")
        num_host_blocks = cache.swap_space // bytes_per_block
        runner = ModelRunner(
            model,
            num_device_blocks,
            num_host_blocks,
            cache.block_size,
            EngineFaults(),
            config.batch_invariant,
            config.invariant_rows,
            config.matmul_kernel,
            config.cpu_threads,
        )
        kv_cache_manager = KVCacheManager(
            BlockPool(num_device_blocks, "device"),
            BlockPool(num_host_blocks, "host"),
            cache.block_size,
            cache.enable_prefix_caching,
        )
        step_costs = runner.measure_step_costs()
        preemption_policy = PreemptionPolicy(
            config.scheduler.preemption_mode,
            bytes_per_block,
            copy_bytes_per_s=runner.measure_copy_bandwidth(),
            prefill_tokens_per_s=step_costs.prompt_tokens_per_s(PROBE_PROMPT_TOKENS),
        )
        max_position_embeddings = model.config.max_position_embeddings
        info = EngineInfo(
            model=config.model,
            device=str(runner.device),
            dtype=str(dtype).removeprefix("torch."),
            dtype_choice=dtype_choice,
            max_model_len=min(config.max_model_len or max_position_embeddings, max_position_embeddings),
            vocab_size=model.config.vocab_size,
            block_size=cache.block_size,
            bytes_per_block=bytes_per_block,
            attention_backend=model.backend.name,
            matmul=runner.matmul,
            layer_ops=runner.layer_ops,
            scheduler_config=config.scheduler,
            watermark=cache.watermark,
            step_costs=step_costs,
            enable_prefix_caching=cache.enable_prefix_caching,
            instruction_set=describe_cpu_isa() if runner.device.type == "cpu" else "",
            cpu_threads=describe_threads(runner.threads.share()) if runner.threads is not None else "",
        )
        return cls(config, runner, kv_cache_manager, preemption_policy, info, tokenizer, load_timings)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_ts: float | None = None,
    ) -> Request:
        """Queue a request; ``InvalidRequest`` with the numbers if it is malformed or can never fit. Returns the
        engine's own request (offline use: the serving layer holds only the prepared one)."""
        prepared = self.prepare_request(prompt, params, request_id, arrival_ts)
        self.add_prepared_request(prepared)
        return self.scheduler.requests[prepared.request_id]

    def prepare_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_ts: float | None = None,
    ) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from another thread).

        Raises ``InvalidRequest`` (the client's fault: a 400) with the numbers if the request is malformed or can
        never fit; any other error is the server's.
        """
        prompt_ids = self._prompt_ids(prompt)
        total = len(prompt_ids) + params.max_tokens
        if total > self.info.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.info.max_model_len} tokens"
            )
        blocks = num_blocks_for(total, self.config.cache.block_size)
        if blocks > self.kv_cache_manager.device_pool.num_blocks:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) needs {blocks} KV blocks "
                f"but the whole KV pool has {self.kv_cache_manager.device_pool.num_blocks}"
            )
        budget = self.config.scheduler.max_num_batched_tokens
        if not self.config.scheduler.enable_chunked_prefill and total > budget:
            # Unchunked, a prompt (or a recompute of prompt + output) must fit one step's budget.
            raise InvalidRequest(
                f"prompt + max_tokens = {total} tokens exceeds max_num_batched_tokens ({budget}) "
                "and chunked prefill is off"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none")
        for param, token_ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", [token_id for token_id, _ in params.logit_bias]),
        ):
            outside = sorted(t for t in token_ids if t >= self.info.vocab_size)
            if outside:
                raise InvalidRequest(
                    f"token ids {outside} are outside the vocabulary of {self.info.vocab_size} tokens", param
                )
        block_hashes: list[BlockHash] = []
        if self.info.enable_prefix_caching:  # hashed here, off the engine's thread
            extend_block_hashes(block_hashes, prompt_ids, self.info.block_size)
        return PreparedRequest(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=tuple(prompt_ids),
            sampling_params=params,
            arrival_ts=time.monotonic() if arrival_ts is None else arrival_ts,
            eos_token_ids=self.tokenizer.eos_token_ids if self.tokenizer else frozenset(),
            block_hashes=tuple(block_hashes),
        )

    def add_prepared_request(self, prepared: PreparedRequest, first_attempt_ts: float | None = None) -> None:
        """Queue a request made by ``prepare_request`` (``first_attempt_ts``: a retry's first attempt, which keeps
        its place in line); ``ValueError`` if its id is already in use."""
        block_size = self.info.block_size if self.info.enable_prefix_caching else 0
        request = Request.from_prepared(prepared, block_size, first_attempt_ts)
        self.scheduler.add_request(request)
        if self.tokenizer is not None:
            self._texts[request.request_id] = _TextState(IncrementalDetokenizer(self.tokenizer))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort now: the request leaves its queue and its blocks are free before this returns.

        Returns its final output (``aborted_in`` says which phase the abort hit), or None if it is unknown or done.
        """
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        phase = request.phase
        self._finish(request, FinishReason.ABORT)
        return self._output(request, [], aborted_in=phase)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay with their requests, but no new request finds them);
        returns how many blocks were cached. What a benchmark calls to start cold."""
        return self.kv_cache_manager.device_pool.forget_cache()

    def update_faults(self, **changes: object) -> dict[str, object]:
        """Change run-time faults (``engine.faults``): ``ValueError`` for a bad one, and then nothing changes; no
        changes to read them. Returns every fault's value. A new ``kv_cap`` takes effect in the next step, which
        preempts what the block tables hold above it."""
        parsed = self.faults.validated(changes)
        if "memory_hog" in parsed:
            self._hold_device_memory(parsed["memory_hog"])
        self.faults.apply(parsed)
        self.faults.cap_pools(self.kv_cache_manager.device_pool, self.kv_cache_manager.host_pool)
        return self.faults.to_json()

    def clear_faults(self) -> dict[str, object]:
        """Every fault off; returns every fault's value."""
        return self.update_faults(**EngineFaults().to_json())

    def cut_fault_delays(self) -> None:
        """End the delay faults at once, a sleep in the step in progress included; safe from any thread while a
        step runs (the one engine method that is)."""
        self.faults.cut_delays()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One iteration: its outputs and the engine after it. A failure of the forward pass (out of memory, say)
        fails no request by itself: the step changed nothing, and the next steps are smaller until they succeed
        (``engine.core.step_back_off``)."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        swap_s = self.runner.move_blocks(scheduler_output)
        try:
            result = self.runner.execute(scheduler_output)
        except Exception as error:
            logger.warning(
                "step of %d requests, %d tokens failed (%s: %s); backing off",
                len(scheduler_output.scheduled),
                scheduler_output.num_batched_tokens,
                type(error).__name__,
                error,
            )
            outputs = self._give_up_after_failure(scheduler_output, error)
            self._record(scheduler_output, time.perf_counter() - start, swap_s, type(error).__name__)
            return StepResult(outputs, self.snapshot())
        advanced = self.scheduler.update_from_output(scheduler_output, result.sampled)
        outputs = [self._advance(request, result.logprobs.get(request.request_id)) for request in advanced]
        self._record(scheduler_output, time.perf_counter() - start, swap_s)
        return StepResult(outputs, self.snapshot())

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def snapshot(self, include_requests: bool = False) -> EngineSnapshot:
        """The engine between two steps; ``include_requests`` adds every live request (costs a walk over them)."""
        requests = None
        if include_requests:
            requests = tuple(
                RequestSnapshot(
                    request_id=r.request_id,
                    phase=r.phase,
                    num_prompt_tokens=r.num_prompt_tokens,
                    num_computed_tokens=r.num_computed_tokens,
                    num_output_tokens=r.num_output_tokens,
                    max_tokens=r.sampling_params.max_tokens,
                    num_preemptions=r.num_preemptions,
                )
                for r in self.scheduler.requests.values()
            )
        cpu_share = self.runner.threads.share() if self.runner.threads is not None else None
        return self.scheduler.snapshot(self.faults.active(), self.last_step, requests, cpu_share)

    # ---- finishing: the one place --------------------------------------------------------

    def _advance(self, request: Request, logprobs: TokenLogprobs | None) -> RequestOutput:
        """The request got a token: decode it, decide whether the request is done, and say so in one output."""
        token_id = request.output_token_ids[-1]
        text = self._texts.get(request.request_id)
        num_new_chars = 0
        if text is not None:
            new_text = text.detokenizer.push(token_id)
            request.output_text += new_text
            num_new_chars = len(new_text)
        stop = check_stop(request, num_new_chars)
        if stop is not None:
            if stop.text_end is not None:
                request.output_text = request.output_text[: stop.text_end]
            request.stop_reason = stop.reason
            self._finish(request, stop.finish_reason)
        return self._output(request, [token_id], (logprobs,) if logprobs is not None else None)

    def _give_up_after_failure(self, output: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        request = self.scheduler.step_failed(output)
        if request is None:
            return []
        self._finish(request, FinishReason.ERROR)
        message = (
            f"the engine gave up on this request after {self.scheduler.back_off.max_failures_alone} failed steps in "
            f"which it ran alone; last error: {type(error).__name__}: {error}"
        )
        return [self._output(request, [], error=message)]

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish_request(request.request_id, reason)
        request.finished_ts = time.monotonic()
        self.runner.release([request.request_id])

    def _output(
        self,
        request: Request,
        new_token_ids: list[int],
        logprobs: tuple[TokenLogprobs, ...] | None = None,
        error: str | None = None,
        aborted_in: str | None = None,
    ) -> RequestOutput:
        """The request's output for what just happened to it, complete: its new tokens, the text they release
        (``engine.core.stopping``) and, once finished, why."""
        new_text = ""
        text = self._texts.get(request.request_id)
        if text is not None:
            end = releasable_text_end(request.output_text, request.sampling_params.stop, request.is_finished)
            new_text = request.output_text[text.num_released_chars : end]
            text.num_released_chars = max(text.num_released_chars, end)
            if request.is_finished:
                del self._texts[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            finish_reason=request.finish_reason,
            timings=request.timings,
            stop_reason=request.stop_reason,
            error=error,
            logprobs=logprobs,
            new_text=new_text,
            aborted_in=aborted_in,
            num_cached_tokens=request.num_cached_tokens,
        )

    # ---- helpers --------------------------------------------------------------------------

    def _hold_device_memory(self, num_bytes: int) -> None:
        """What a co-tenant process does to the device: take memory the engine does not own (CUDA only)."""
        if num_bytes and self.device.type != "cuda":
            raise ValueError(
                f"memory_hog takes device memory outside the engine and needs a CUDA device; this engine runs on "
                f"{self.device}, where the KV pool is preallocated host memory that nothing else can take: use "
                '{"kv_cap": {"fraction": F}} to take KV blocks away instead'
            )
        hog = None
        if num_bytes:
            try:
                hog = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError as error:
                raise ValueError(f"memory_hog of {num_bytes} bytes does not fit on {self.device}: {error}") from None
        self._memory_hog = hog
        if hog is None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; pass token ids")
            try:  # a text that cannot fit the context whatever its tokens is refused before it is tokenized
                prompt_ids = self.tokenizer.encode(prompt, max_num_tokens=self.info.max_model_len)
            except PromptTooLong as error:
                context = self.info.max_model_len
                raise InvalidRequest(f"prompt too long for the model's context of {context} tokens: {error}") from None
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise InvalidRequest("prompt must contain at least one token")
        vocab_size = self.info.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
        return prompt_ids

    def _record(self, output: SchedulerOutput, duration_s: float, swap_s: float, error: str | None = None) -> None:
        if self.config.debug_invariants:
            self.scheduler.check_invariants()
        shape = StepShape.of_batch((s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled)
        self.preemption_log.extend(output.preemptions)
        if error is None and shape.num_prefill_tokens > output.num_batched_tokens // 2:
            self.preemption_policy.observe_prefill(output.num_batched_tokens, duration_s)
        self.preemption_policy.observe_swap(len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in), swap_s)
        self.last_step = StepStats(
            num_scheduled=len(output.scheduled),
            num_batched_tokens=output.num_batched_tokens,
            num_prefill_tokens=shape.num_prefill_tokens,
            num_swapped_in_blocks=len(output.blocks_to_swap_in),
            num_swapped_out_blocks=len(output.blocks_to_swap_out),
            preemptions=tuple(output.preemptions),
            duration_s=duration_s,
            swap_s=swap_s,
            error=error,
            num_context_tokens=shape.num_context_tokens,
            num_attended_pairs=shape.num_attended_pairs,
        )


def _load(
    config: EngineConfig, tokenizer: Tokenizer | None, model: LlamaForCausalLM | None
) -> tuple[LlamaForCausalLM, Tokenizer | None, str, dict[str, float]]:
    """The model (``model`` if given), its tokenizer (``tokenizer`` if given; none for random weights), why its
    dtype, and how long each took to load."""
    source = resolve_model(config.model)
    torch.manual_seed(config.seed)
    start = time.perf_counter()
    dtype_choice = "the model given"
    if model is None:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        dtype_choice = describe_dtype_choice(config.dtype, device)
        backend = make_attention_backend(config.attention_backend, device, dtype)
        model = source.load_model(dtype=dtype, device=device, backend=backend, seed=config.seed)
    load_timings = {"model_s": time.perf_counter() - start}
    start = time.perf_counter()
    if tokenizer is None and source.kind != "random":
        tokenizer = source.load_tokenizer()
    load_timings["tokenizer_s"] = time.perf_counter() - start
    return model, tokenizer, dtype_choice, load_timings


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    num_preemptions: int
    # Why the engine gave up on it (finish reason "error").
    error: str | None = None


class LLM:
    """Offline batch generation: submit everything, step until all are done, return in input order."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        tokenizer: Tokenizer | None = None,
        loaded_model: LlamaForCausalLM | None = None,
        **options: object,
    ) -> None:
        self.engine = LLMEngine.from_config(EngineConfig.from_options(model=model, **options), tokenizer, loaded_model)

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        arrival_ts = time.monotonic()
        requests = [
            self.engine.add_request(prompt, p, arrival_ts=arrival_ts)
            for prompt, p in zip(prompts, params_list, strict=True)
        ]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step().outputs:
                if output.finished:
                    final[output.request_id] = output
        has_text = self.engine.tokenizer is not None
        return [
            Completion(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=r.output_token_ids,
                text=r.output_text if has_text else None,
                finish_reason=final[r.request_id].finish_reason,
                stop_reason=r.stop_reason,
                num_preemptions=r.num_preemptions,
                error=final[r.request_id].error,
            )
            for r in requests
        ]
