"""Engine configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

GiB = 1 << 30


class PreemptionMode(str, Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"  # per victim, whichever the cost model says is cheaper


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the byte budgets of the device pool and the host swap pool."""

    block_size: int = 16
    kv_cache_memory: int = 1 * GiB
    swap_space: int = 1 * GiB
    # The device pool in blocks, whatever a block weighs in the engine's dtype (instead of kv_cache_memory).
    num_kv_blocks: int | None = None
    # Fraction of device blocks kept free when admitting new requests, so running ones can grow.
    watermark: float = 0.01
    # Requests share the KV blocks of a prompt prefix already computed (``engine.core.kv_cache_manager``).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the preemption policy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # With chunked prefill, the prompt tokens a step computes while it also decodes: a decode waits for the whole
    # step, so a long prompt is spread over several short steps instead of stalling every stream for one long one
    # (Sarathi-Serve's stall-free batching). A step with no decode gives prompts the whole token budget.
    max_prefill_tokens_beside_decodes: int = 256
    preemption_mode: PreemptionMode = PreemptionMode.AUTO

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_beside_decodes < 1:
            raise ValueError(
                f"max_prefill_tokens_beside_decodes must be >= 1, got {self.max_prefill_tokens_beside_decodes}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs and not self.enable_chunked_prefill:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs without chunked prefill")
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))


# Which range of row counts batch-invariant CPU matmuls take where their kernels agree in several (bfloat16 on an
# Intel Xeon with AMX): engine.model.packed_linear.choose_row_range.
INVARIANT_ROWS = ("throughput", "latency")


def check_invariant_rows(favour: str) -> None:
    if favour not in INVARIANT_ROWS:
        raise ValueError(f"invariant_rows must be one of {INVARIANT_ROWS}, got {favour!r}")


# What multiplies the CPU's packed linear layers: "auto" takes kvstorm's tile matmuls for bfloat16 where the CPU has
# AMX or AVX512-BF16 (kernels.cpu_matmul) and oneDNN elsewhere; "onednn" always oneDNN.
MATMUL_KERNELS = ("auto", "onednn")


def check_matmul_kernel(kernel: str) -> None:
    if kernel not in MATMUL_KERNELS:
        raise ValueError(f"matmul_kernel must be one of {MATMUL_KERNELS}, got {kernel!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    # Each request's tokens the same whatever else runs in its step (bit-identical preemption); off lets oneDNN's
    # packed CPU matmuls take every row at once, faster where their kernels change with the row count (the tile
    # matmuls are invariant at any count).
    batch_invariant: bool = True
    # Where oneDNN's matmul kernels agree in more than one range of row counts, the one they take (INVARIANT_ROWS):
    # "throughput" (the widest: big batches in few calls) or "latency" (a lone decode is not padded; the weights are
    # packed in the layout whose range for a lone row spans most counts: engine.model.packed_linear.choose_layout).
    invariant_rows: str = "throughput"
    # MATMUL_KERNELS: kvstorm's tile matmuls where they apply ("auto") or oneDNN for every packed layer.
    matmul_kernel: str = "auto"
    # The CPU threads a step runs on: None follows the cores other processes leave (engine.cpu_share), a number
    # fixes it.
    cpu_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Longest prompt + output; None means the model's own context length.
    max_model_len: int | None = None
    # Check every block-pool invariant after every step (slow; for tests and debugging).
    debug_invariants: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_invariant_rows(self.invariant_rows)
        check_matmul_kernel(self.matmul_kernel)
        if self.cpu_threads is not None and (type(self.cpu_threads) is not int or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive whole number or None (auto), got {self.cpu_threads!r}")

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """From flat keyword options (``block_size=16, max_num_seqs=64, ...``), each routed to its dataclass."""
        cache_fields = set(CacheConfig.__dataclass_fields__)
        scheduler_fields = set(SchedulerConfig.__dataclass_fields__)
        unknown = set(options) - cache_fields - scheduler_fields - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        return cls(
            cache=CacheConfig(**{k: v for k, v in options.items() if k in cache_fields}),
            scheduler=SchedulerConfig(**{k: v for k, v in options.items() if k in scheduler_fields}),
            **{k: v for k, v in options.items() if k not in cache_fields | scheduler_fields},
        )
