"""Step-cost profiles: a simulated engine's pools and rules, and what its steps cost.

A profile is a JSON file. ``fitted`` profiles come from ``kvstorm simulate profile`` (steps of the real engine on
this machine, fitted); ``roofline`` profiles describe a GPU and a model on paper, with their assumptions written in
the file. The shipped ones (``PROFILES``) are roofline examples; a name that is not one of them is read as a path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

from engine.core.config import PreemptionMode, SchedulerConfig
from engine.core.simulator import SimulatedEngine
from engine.core.step_cost import Gpu, LinearStepCost, Model, RooflineStepCost

PROFILES = ("h200-llama-3-8b", "h100x8-llama-3-70b")
NonNegativeFloat = Annotated[float, Field(ge=0)]
# A simulated pool keeps a few words per block: ten million blocks (160 million tokens of 16) is about a gigabyte.
MAX_BLOCKS = 10_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineShape(_Strict):
    """The simulated engine's pools and scheduling rules (``kvstorm serve``'s options of the same names)."""

    num_kv_blocks: Annotated[int, Field(ge=1, le=MAX_BLOCKS)] | None = None  # None: what fits the memory (roofline)
    num_swap_blocks: Annotated[int, Field(ge=0, le=MAX_BLOCKS)] = 0
    block_size: PositiveInt = 16
    max_model_len: PositiveInt
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 2048
    enable_chunked_prefill: bool = True
    max_prefill_tokens_beside_decodes: PositiveInt = SchedulerConfig().max_prefill_tokens_beside_decodes
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    watermark: Annotated[float, Field(ge=0, lt=1)] = 0.01
    enable_prefix_caching: bool = True


class LinearCost(_Strict):
    per_step_s: NonNegativeFloat
    per_prefill_token_s: NonNegativeFloat
    per_decode_s: NonNegativeFloat
    per_context_token_s: NonNegativeFloat
    per_attended_pair_s: NonNegativeFloat
    swap_block_s: NonNegativeFloat


class Fit(_Strict):
    num_steps: PositiveInt
    median_relative_error: NonNegativeFloat
    p90_relative_error: NonNegativeFloat
    total_relative_error: NonNegativeFloat


class FittedProfile(_Strict):
    kind: Literal["fitted"] = "fitted"
    name: str
    engine: EngineShape
    bytes_per_block: PositiveInt
    cost: LinearCost
    fit: Fit
    # What a client's TTFT adds to the server's own (vllm:time_to_first_token_seconds), on average over the measuring
    # load's Poisson arrivals: the event loop delivering the token, the socket, the client's parsing.
    token_latency_s: NonNegativeFloat = 0.0
    # Where and how the steps were measured: CPU, dtype, model, the command.
    measured_on: dict[str, str]

    @property
    def model_name(self) -> str:
        return self.measured_on["model"]


class GpuSpec(_Strict):
    name: str
    memory_bytes: PositiveFloat
    memory_bytes_per_s: PositiveFloat
    flops_per_s: PositiveFloat
    host_link_bytes_per_s: PositiveFloat
    interconnect_bytes_per_s: PositiveFloat
    all_reduce_latency_s: NonNegativeFloat


class ModelSpec(_Strict):
    name: str
    num_parameters: PositiveFloat
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    bytes_per_value: PositiveInt


class RooflineProfile(_Strict):
    kind: Literal["roofline"] = "roofline"
    name: str
    engine: EngineShape
    gpu: GpuSpec
    model: ModelSpec
    tensor_parallel: PositiveInt = 1
    memory_efficiency: Annotated[float, Field(gt=0, le=1)]
    compute_efficiency: Annotated[float, Field(gt=0, le=1)]
    per_step_s: NonNegativeFloat
    # The share of each GPU's memory the engine takes, and what it keeps of it for activations (the KV pool is the
    # rest, beside the weights), when ``engine.num_kv_blocks`` is not given.
    memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    activation_reserve_bytes: NonNegativeFloat = 0
    # From a step's end to the client holding its tokens (network, server and client), assumed.
    token_latency_s: NonNegativeFloat = 0.0
    # Every number above that is not a datasheet's, and why it is what it is.
    assumptions: list[str]

    @property
    def model_name(self) -> str:
        return self.model.name

    def cost(self) -> RooflineStepCost:
        return RooflineStepCost(
            Gpu(**self.gpu.model_dump()),
            Model(**self.model.model_dump()),
            self.tensor_parallel,
            self.engine.block_size,
            self.memory_efficiency,
            self.compute_efficiency,
            self.per_step_s,
        )


Profile = Annotated[FittedProfile | RooflineProfile, Field(discriminator="kind")]


class _ProfileFile(BaseModel):
    profile: Profile


def load_profile(name_or_path: str) -> FittedProfile | RooflineProfile:
    """A shipped profile by name, or a profile file; ``ValueError`` saying what is wrong with it."""
    if name_or_path in PROFILES:
        text = resources.files("kvstorm.simulate").joinpath(f"profiles/{name_or_path}.json").read_text()
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"no profile {name_or_path!r}: neither a shipped one ({', '.join(PROFILES)}) nor a file")
        text = path.read_text()
    try:
        return _ProfileFile.model_validate_json(f'{{"profile": {text}}}').profile
    except ValidationError as error:
        raise ValueError(f"profile {name_or_path!r} is not valid: {error}") from None


def simulated_engine(profile: FittedProfile | RooflineProfile, **overrides: object) -> SimulatedEngine:
    """The engine a profile describes; ``overrides`` replace fields of its ``engine`` (None: keep)."""
    updates = {name: value for name, value in overrides.items() if value is not None}
    shape = EngineShape.model_validate({**profile.engine.model_dump(), **updates})
    if isinstance(profile, FittedProfile):
        cost: LinearStepCost | RooflineStepCost = LinearStepCost(**profile.cost.model_dump())
        bytes_per_block = profile.bytes_per_block
        if shape.block_size != profile.engine.block_size:
            raise ValueError("a fitted profile's block size is the one it was measured with")
    else:
        cost = profile.cost()
        bytes_per_block = cost.bytes_per_block
    num_kv_blocks = shape.num_kv_blocks
    if num_kv_blocks is None:
        if isinstance(profile, FittedProfile):
            raise ValueError("a fitted profile must give engine.num_kv_blocks")
        num_kv_blocks = cost.num_kv_blocks(profile.memory_utilization, profile.activation_reserve_bytes)
        if not 1 <= num_kv_blocks <= MAX_BLOCKS:
            raise ValueError(
                f"profile {profile.name!r}: {profile.gpu.memory_bytes:g} bytes of GPU memory hold {num_kv_blocks:,} KV "
                f"blocks of {bytes_per_block:,} bytes; a simulated pool holds 1 to {MAX_BLOCKS:,} (MAX_BLOCKS: about "
                "a gigabyte of the simulator's own memory): give engine.num_kv_blocks or a smaller gpu.memory_bytes"
            )
    return SimulatedEngine(
        num_device_blocks=num_kv_blocks,
        num_host_blocks=shape.num_swap_blocks,
        block_size=shape.block_size,
        bytes_per_block=bytes_per_block,
        max_model_len=shape.max_model_len,
        scheduler_config=SchedulerConfig(
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            enable_chunked_prefill=shape.enable_chunked_prefill,
            max_prefill_tokens_beside_decodes=shape.max_prefill_tokens_beside_decodes,
            preemption_mode=shape.preemption_mode,
        ),
        cost=cost,
        watermark=shape.watermark,
        enable_prefix_caching=shape.enable_prefix_caching,
        token_latency_s=profile.token_latency_s,
    )
