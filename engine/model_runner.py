"""Executes the scheduler's decisions: block moves, the batched forward pass, sampling.

This is the only engine module that touches device tensors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

import torch

from engine.attention.backend import AttentionMetadata, int64_tensor
from engine.attention.kv_cache import PagedKVCache, kv_cache_bytes_per_block, move_blocks
from engine.core.kv_cache_manager import num_blocks_for
from engine.core.outputs import (
    PROBE_DECODE_ROWS,
    PROBE_PROMPT_TOKENS,
    ExecuteResult,
    ScheduledRequest,
    SchedulerOutput,
    StepCosts,
    TokenLogprobs,
)
from engine.cpu_share import FixedThreads, ThreadGovernor, thread_policy
from engine.faults import EngineFaults
from engine.host_memory import keep_freed_host_memory
from engine.model.llama import LlamaForCausalLM
from engine.model.packed_linear import describe_packed_matmuls, packing_applies, set_batch_invariant
from engine.sampling import argmax_rows, compute_logprobs, make_generator, sample
from kernels.cpu_argmax import argmax_rows_cpu
from kernels.cpu_extension import cpu_kernels_apply, cpu_kernels_available


class ModelRunner:
    """Owns the model, the device KV cache, the host swap cache and each request's random stream; raises the
    engine's faults (``engine.faults``) where a device would. On the CPU it prepacks the model's linear weights
    for kvstorm's tile matmuls or oneDNN and runs its norms and rotary embeddings through the compiled kernels where
    they build (in place: a model handed to a runner serves inference only from then on). On the CPU it also keeps
    the host memory a step frees for the next (``engine.host_memory``)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        faults: EngineFaults | None = None,
        batch_invariant: bool = True,
        invariant_rows: str = "throughput",
        matmul_kernel: str = "auto",
        cpu_threads: int | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        parameter = next(model.parameters())
        self.device = parameter.device
        # On the CPU, how many threads a step runs on (engine.cpu_share); chosen before the packing probes oneDNN.
        self.threads: ThreadGovernor | FixedThreads | None = None
        if self.device.type == "cpu":  # the steps' activations live in host memory
            keep_freed_host_memory()
            follows_threads = "the torch attention backend's results change with the thread count"
            self.threads = thread_policy(cpu_threads, follows_threads if model.backend.name == "torch" else None)
        # How the linear layers multiply, reported by the startup line and benchmarks: "torch", or the packed
        # layers' kernels and how many rows a call takes when that keeps each row's result batch-invariant
        # (``describe_packed_matmuls``).
        self.matmul = "torch"
        if packing_applies(self.device, parameter.dtype):
            model.pack_linear_weights(invariant_rows if batch_invariant else "throughput", matmul_kernel)
            rows = set_batch_invariant(model, batch_invariant, invariant_rows)
            self.matmul = describe_packed_matmuls(model, batch_invariant, rows)
        # "cpu-kernels" or "torch": how RMSNorm, rotary embeddings and greedy's argmax run (reported with the
        # matmuls).
        self.layer_ops = "torch"
        self.argmax = argmax_rows
        if cpu_kernels_apply(self.device, parameter.dtype) and cpu_kernels_available():
            one_call = model.use_cpu_kernels()
            self.layer_ops = "cpu-kernels (a decoder layer per call)" if one_call else "cpu-kernels"
            self.argmax = argmax_rows_cpu
        self.device_cache = PagedKVCache(model.config, num_device_blocks, block_size, parameter.dtype, self.device)
        self.host_cache = PagedKVCache(
            model.config,
            num_host_blocks,
            block_size,
            parameter.dtype,
            "cpu",
            pin_memory=self.device.type == "cuda",
        )
        self._generators: dict[str, torch.Generator | None] = {}
        self.faults = faults or EngineFaults()

    def move_blocks(self, output: SchedulerOutput) -> float:
        """The step's swaps (before its forward pass); returns the seconds they took."""
        start = time.perf_counter()
        self.swap_out(output.blocks_to_swap_out)
        self.swap_in(output.blocks_to_swap_in)
        if output.blocks_to_swap_out or output.blocks_to_swap_in:
            self._synchronize()
        self.faults.delay_block_moves(len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in))
        return time.perf_counter() - start

    def execute(self, output: SchedulerOutput) -> ExecuteResult:
        """The step's forward pass, once its blocks are in place: the sampled token of every request that
        ``needs_sample``, logprobs where asked. Raising leaves the cache as it was, but for K/V written into
        slots of this step's new tokens, which a retry writes again."""
        to_sample = [s for s in output.scheduled if s.needs_sample]
        if not output.scheduled:
            return ExecuteResult({})
        self.faults.before_forward(output)
        if self.threads is not None:
            self.threads.follow()
        logits = self.forward(output.scheduled, positions_to_keep=[s.needs_sample for s in output.scheduled])
        if not to_sample:  # every chunk was a partial prefill
            return ExecuteResult({})
        tokens = sample(
            logits,
            [s.sampling_params for s in to_sample],
            [self._generator(s) for s in to_sample],
            [s.banned_token_ids for s in to_sample],
            [(s.prompt_token_ids, s.output_token_ids) for s in to_sample],
            argmax=self.argmax,
        )
        sampled = {s.request_id: token for s, token in zip(to_sample, tokens, strict=True)}
        return ExecuteResult(sampled, self._logprobs(logits, to_sample, tokens))

    def swap_out(self, block_pairs: Sequence[tuple[int, int]]) -> None:
        move_blocks(self.device_cache, self.host_cache, block_pairs, self.model.backend)

    def swap_in(self, block_pairs: Sequence[tuple[int, int]]) -> None:
        move_blocks(self.host_cache, self.device_cache, block_pairs, self.model.backend)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget the random streams of requests that are done."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[ScheduledRequest], positions_to_keep: Sequence[bool] | None = None
    ) -> torch.Tensor:
        """Logits [num_kept, vocab] of each kept chunk's last token; of every position without ``positions_to_keep``."""
        input_ids, positions, metadata = self.prepare_inputs(chunks)
        hidden = self.model(input_ids, positions, self.device_cache.layers, metadata)
        if positions_to_keep is not None:
            last_rows = [
                end - 1 for end, keep in zip(metadata.query_start_loc_cpu[1:], positions_to_keep, strict=True) if keep
            ]
            hidden = hidden[int64_tensor(last_rows, self.device)]
        return self.model.compute_logits(hidden)

    def measure_copy_bandwidth(self, num_blocks: int = 8) -> float:
        """Bytes/s of a device -> host block move, timed once at start (feeds the preemption cost model)."""
        num_blocks = min(num_blocks, self.device_cache.num_blocks, self.host_cache.num_blocks)
        if num_blocks == 0:
            return 1e9
        pairs = [(i, i) for i in range(num_blocks)]
        self.swap_out(pairs)  # warm-up
        self._synchronize()
        start = time.perf_counter()
        self.swap_out(pairs)
        self._synchronize()
        bytes_per_block = kv_cache_bytes_per_block(self.model.config, self.block_size, self.device_cache.data.dtype)
        return num_blocks * bytes_per_block / max(time.perf_counter() - start, 1e-9)

    def measure_step_costs(
        self, num_prompt_tokens: int = PROBE_PROMPT_TOKENS, num_decode_rows: int = PROBE_DECODE_ROWS
    ) -> StepCosts:
        """A step's fixed cost and its costs per prompt token and per decode row, from the fastest of a few steps of
        each kind: a prefill of ``num_prompt_tokens``, a decode of one row and one of ``num_decode_rows`` (writes
        only blocks no request owns yet)."""
        if self.threads is not None:  # measured on the threads the steps will run on, beside whatever runs now
            self.threads.follow()
        num_prompt_tokens = min(num_prompt_tokens, self.device_cache.num_blocks * self.block_size)
        num_decode_rows = max(2, min(num_decode_rows, num_prompt_tokens))
        blocks = list(range(num_blocks_for(num_prompt_tokens, self.block_size)))
        prefill = [ScheduledRequest("step-probe", [0] * num_prompt_tokens, num_computed_tokens=0, block_ids=blocks)]
        # Decode rows over the prefill's blocks, each rewriting one of its positions.
        decodes = [
            ScheduledRequest(
                f"step-probe-{row}", [0], num_computed_tokens=num_prompt_tokens - 1 - row, block_ids=blocks
            )
            for row in range(num_decode_rows)
        ]
        prefill_s = self._fastest_step_s(prefill)
        one_decode_s = self._fastest_step_s(decodes[:1])
        decodes_s = self._fastest_step_s(decodes)
        return StepCosts.from_probes(prefill_s, num_prompt_tokens, one_decode_s, decodes_s, num_decode_rows)

    def _fastest_step_s(self, chunks: list[ScheduledRequest], repeats: int = 3) -> float:
        self.forward(chunks, positions_to_keep=[True] * len(chunks))  # warm-up
        self._synchronize()
        fastest = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            self.forward(chunks, positions_to_keep=[True] * len(chunks))
            self._synchronize()
            fastest = min(fastest, time.perf_counter() - start)
        return max(fastest, 1e-9)

    def prepare_inputs(
        self, chunks: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_size = self.block_size
        for chunk in chunks:
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + len(chunk.token_ids)
            if len(chunk.block_ids) * block_size < end:
                raise ValueError(f"block table of {len(chunk.block_ids)} blocks cannot hold {end} tokens")
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            slots.extend(chunk.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, slots, [c.block_ids for c in chunks], block_size, self.device
        )
        return int64_tensor(token_ids, self.device), int64_tensor(positions, self.device), metadata

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, to_sample: Sequence[ScheduledRequest], tokens: Sequence[int]
    ) -> dict[str, TokenLogprobs]:
        rows = [i for i, s in enumerate(to_sample) if s.sampling_params.logprobs is not None]
        if not rows:
            return {}
        values = compute_logprobs(
            logits[rows], [tokens[i] for i in rows], [to_sample[i].sampling_params.logprobs for i in rows]
        )
        return {to_sample[i].request_id: value for i, value in zip(rows, values, strict=True)}

    def _generator(self, scheduled: ScheduledRequest) -> torch.Generator | None:
        if scheduled.request_id not in self._generators:
            self._generators[scheduled.request_id] = make_generator(scheduled.sampling_params, self.device)
        return self._generators[scheduled.request_id]

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
