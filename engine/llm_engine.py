"""The engine: requests in, one ``step()`` at a time, outputs out; and ``LLM`` for offline batches.

step():  schedule -> swap / copy -> run the model -> sample -> update queues
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.attention.kv_cache import kv_cache_bytes_per_block
from engine.attention.selector import make_attention_backend
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager, num_blocks_for
from engine.model.llama import LlamaForCausalLM
from engine.model.registry import resolve_device, resolve_dtype, resolve_model
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.model_runner import ModelRunner
from engine.outputs import PreemptionEvent, RequestOutput, SchedulerOutput, SchedulerStats
from engine.preemption import PreemptionPolicy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

Prompt = str | Sequence[int]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What one step did and how long it took."""

    num_scheduled: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_swapped_in_blocks: int
    num_swapped_out_blocks: int
    duration_s: float
    preemptions: tuple[PreemptionEvent, ...] = ()
    # Time spent moving blocks between the device and host pools.
    swap_s: float = 0.0
    # The type of the error the step's forward pass raised (the step changed nothing, and the engine backs off).
    error: str | None = None


class LLMEngine:
    """Continuous batching over a paged KV cache for one model.

    ``add_request`` rejects (``ValueError``) a request that can never fit; it
    never fails later for lack of memory: it waits, is preempted, or runs.
    """

    PREEMPTION_LOG_SIZE = 10_000

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        model: LlamaForCausalLM | None = None,
    ) -> None:
        """``model`` and ``tokenizer``, when given, are used instead of loading ``config.model`` again."""
        self.config = config
        source = resolve_model(config.model)
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        if model is None:
            device = resolve_device(config.device)
            dtype = resolve_dtype(config.dtype, device)
            backend = make_attention_backend(config.attention_backend, device, dtype)
            model = source.load_model(dtype=dtype, device=device, backend=backend, seed=config.seed)
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.load_timings = {"model_s": time.perf_counter() - start}
        self.model_config = model.config
        start = time.perf_counter()
        self.tokenizer = tokenizer if tokenizer is not None or source.kind == "random" else source.load_tokenizer()
        self.load_timings["tokenizer_s"] = time.perf_counter() - start
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings, self.model_config.max_position_embeddings
        )

        cache = config.cache
        self.bytes_per_block = kv_cache_bytes_per_block(self.model_config, cache.block_size, self.dtype)
        num_device_blocks = cache.kv_cache_memory // self.bytes_per_block
        if num_device_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block of {self.bytes_per_block} bytes"
            )
        num_host_blocks = cache.swap_space // self.bytes_per_block
        self.runner = ModelRunner(model, num_device_blocks, num_host_blocks, cache.block_size)
        self.kv_cache_manager = KVCacheManager(
            BlockPool(num_device_blocks, "device"), BlockPool(num_host_blocks, "host"), cache.block_size
        )
        self.preemption_policy = PreemptionPolicy(
            config.scheduler.preemption_mode,
            self.bytes_per_block,
            copy_bytes_per_s=self.runner.measure_copy_bandwidth(),
            prefill_tokens_per_s=self.runner.measure_prefill_throughput(),
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.preemption_policy, cache.watermark)
        self.preemption_log: collections.deque[PreemptionEvent] = collections.deque(maxlen=self.PREEMPTION_LOG_SIZE)
        self.last_step: StepStats | None = None
        # Per live request when the model has a tokenizer: the request and the detokenizer of its output.
        self._detokenizers: dict[str, tuple[Request, IncrementalDetokenizer]] = {}
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_ts: float | None = None,
    ) -> Request:
        """Queue a request; ``ValueError`` with the numbers if it is malformed or can never fit."""
        request = self.prepare_request(prompt, params, request_id, arrival_ts)
        self.add_prepared_request(request)
        return request

    def prepare_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_ts: float | None = None,
    ) -> Request:
        """Tokenize and validate without touching engine state (safe from another thread).

        Raises ``ValueError`` with the numbers if the request is malformed or can never fit.
        """
        prompt_ids = self._prompt_ids(prompt)
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        blocks = num_blocks_for(total, self.config.cache.block_size)
        if blocks > self.kv_cache_manager.device_pool.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) needs {blocks} KV blocks "
                f"but the whole KV pool has {self.kv_cache_manager.device_pool.num_blocks}"
            )
        budget = self.config.scheduler.max_num_batched_tokens
        if not self.config.scheduler.enable_chunked_prefill and total > budget:
            # Unchunked, a prompt (or a recompute of prompt + output) must fit one step's budget.
            raise ValueError(
                f"prompt + max_tokens = {total} tokens exceeds max_num_batched_tokens ({budget}) "
                "and chunked prefill is off"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        request = Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_ids=self.tokenizer.eos_token_ids if self.tokenizer else frozenset(),
        )
        if arrival_ts is not None:
            request.arrival_ts = arrival_ts
        return request

    def add_prepared_request(self, request: Request) -> None:
        """Queue a request made by ``prepare_request``; ``ValueError`` if its id is already in use."""
        self.scheduler.add_request(request)
        if self.tokenizer is not None:
            self._detokenizers[request.request_id] = (request, IncrementalDetokenizer(self.tokenizer))

    def abort_request(self, request_id: str) -> str | None:
        """Abort now: the request leaves its queue and its blocks are free before this returns.

        Returns the phase the abort hit (see ``Request.phase``), or None if the request is unknown or done.
        """
        self._detokenizers.pop(request_id, None)
        self.runner.release([request_id])
        request = self.scheduler.requests.get(request_id)
        phase = request.phase if request is not None else None
        self.scheduler.abort_request(request_id)
        return phase

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. A failure of the forward pass (out of memory, say) fails no request by itself: the step
        changed nothing, and the next steps are smaller until they succeed (``engine.step_back_off``)."""
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
            outputs = self.scheduler.step_failed(scheduler_output, error)
            self._end_step(scheduler_output, outputs, start, swap_s, type(error).__name__)
            return outputs
        outputs = self.scheduler.update_from_output(scheduler_output, result.sampled)
        if result.logprobs:
            outputs = [
                replace(o, logprobs=(result.logprobs[o.request_id],)) if o.request_id in result.logprobs else o
                for o in outputs
            ]
        if self._detokenizers:
            outputs = [self._detokenize(o) for o in outputs]
        self._end_step(scheduler_output, outputs, start, swap_s)
        return outputs

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- helpers --------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
        return prompt_ids

    def _detokenize(self, output: RequestOutput) -> RequestOutput:
        """Decode the output's new tokens once, for every consumer; end the request if a stop string appeared."""
        request, detokenizer = self._detokenizers[output.request_id]
        new_text = "".join(detokenizer.push(token_id) for token_id in output.new_token_ids)
        stop = request.sampling_params.stop
        # Text already searched cannot hold a match, except one that ends in the new text.
        search_from = max(0, len(request.output_text) - max(map(len, stop), default=0) + 1)
        request.output_text += new_text
        output = replace(output, new_text=new_text)
        found = [(pos, s) for s in stop if (pos := request.output_text.find(s, search_from)) >= 0]
        if found and not output.finished:
            matched = min(found)[1]
            self.scheduler.finish_request(output.request_id, RequestStatus.FINISHED_STOPPED, matched)
            output = replace(output, finish_reason=RequestStatus.FINISHED_STOPPED.value, stop_reason=matched)
        return output

    def _end_step(
        self,
        output: SchedulerOutput,
        outputs: list[RequestOutput],
        start: float,
        swap_s: float,
        error: str | None = None,
    ) -> None:
        finished = [o.request_id for o in outputs if o.finished]
        self.runner.release(finished)
        for request_id in finished:
            self._detokenizers.pop(request_id, None)
        if self.config.debug_invariants:
            self.scheduler.check_invariants()
        self._record(output, time.perf_counter() - start, swap_s, error)

    def _record(self, output: SchedulerOutput, duration_s: float, swap_s: float, error: str | None) -> None:
        num_prefill = sum(s.num_new_tokens for s in output.scheduled if s.num_new_tokens > 1)
        self.preemption_log.extend(output.preemptions)
        if error is None and num_prefill > output.num_batched_tokens // 2:
            self.preemption_policy.observe_prefill(output.num_batched_tokens, duration_s)
        self.last_step = StepStats(
            num_scheduled=len(output.scheduled),
            num_batched_tokens=output.num_batched_tokens,
            num_prefill_tokens=num_prefill,
            num_swapped_in_blocks=len(output.blocks_to_swap_in),
            num_swapped_out_blocks=len(output.blocks_to_swap_out),
            preemptions=tuple(output.preemptions),
            duration_s=duration_s,
            swap_s=swap_s,
            error=error,
        )


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
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
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options), tokenizer, loaded_model)

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
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        has_text = self.engine.tokenizer is not None
        return [
            Completion(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=r.output_token_ids,
                text=_visible_text(r) if has_text else None,
                finish_reason=final[r.request_id].finish_reason,
                stop_reason=r.stop_reason,
                num_preemptions=r.num_preemptions,
                error=final[r.request_id].error,
            )
            for r in requests
        ]


def _visible_text(request: Request) -> str:
    """Decoded output, cut before the stop string that ended it."""
    text = request.output_text
    if isinstance(request.stop_reason, str):
        text = text[: text.find(request.stop_reason)]
    return text
