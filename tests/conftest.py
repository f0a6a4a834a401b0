"""Session-wide fixtures: the real model, its tokenizer, transformers as the logits oracle, and a real kvstorm
server process for the harness's tests (chaos, dashboards).

Loading each costs seconds, so each is loaded once per test session.
"""

from __future__ import annotations

import os

# Triton decides at kernel definition whether to interpret, so this must precede every import of a kernel: the
# tests run the Triton kernels on the CPU (a GPU machine runs them natively through scripts/gpu_check.sh).
os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.cpu_isa import library_caps

# Under KVSTORM_CPU_ISA (CI runs the CPU-dependent tests under avx2 too) oneDNN, ATen and MKL are capped before torch
# is first used, here and in every process a test starts (``kernels.cpu_isa.apply_cpu_isa_ceiling``).
os.environ.update(library_caps())

import atexit
import shutil
import tempfile

from engine.model.gguf_cache import CACHE_DIR_ENV

# The session's converted checkpoints (engine.model.gguf_cache), servers it starts included, in a directory of its
# own that it removes at the end: a test run leaves nothing in the user's cache and starts from none of it.
if CACHE_DIR_ENV not in os.environ:
    os.environ[CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="kvstorm-test-cache-")
    atexit.register(shutil.rmtree, os.environ[CACHE_DIR_ENV], ignore_errors=True)

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from chaos.injectors import processes
from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV, EngineAdmin
from engine.model.llama import LlamaForCausalLM
from engine.model.registry import ModelSource, resolve_model
from engine.model.tokenizer import Tokenizer

REAL_MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def real_source() -> ModelSource:
    return resolve_model(REAL_MODEL)


@pytest.fixture(scope="session")
def real_model(real_source: ModelSource) -> LlamaForCausalLM:
    """The real model as the engine runs it on the CPU, linear weights prepacked for oneDNN: an engine would
    pack the shared model on first use, so it is packed here and every test sees the same one."""
    model = real_source.load_model(dtype=torch.float32, device="cpu")
    model.pack_linear_weights()
    return model


@pytest.fixture(scope="session")
def real_tokenizer(real_source: ModelSource) -> Tokenizer:
    return real_source.load_tokenizer()


@pytest.fixture(scope="session")
def hf_oracle(real_source: ModelSource):
    """transformers' own Llama loaded from the same GGUF file, in float32."""
    from transformers import AutoModelForCausalLM

    path = real_source.path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


# ---- a kvstorm server for the harness (the bundled model, its own process on a loopback port) ----

# float32: the bursts the chaos and dashboard tests push were sized to fill this pool at float32's speed on 2 cores.
# Admission off: under their 10% KV cap the forecast (which cannot know the cap is lifted 4 s later) refuses some
# requests, which these tests, about faults and their verdicts, count as lost.
SERVER_ARGS = (
    "--dtype",
    "float32",
    "--ttft-slo",
    "off",
    "--num-kv-blocks",
    "88",
    "--swap-space",
    "256MiB",
    "--preemption-mode",
    "auto",
)


@dataclass(frozen=True)
class KvstormServer:
    url: str
    admin: EngineAdmin


@pytest.fixture(scope="session")
def kvstorm_server(tmp_path_factory) -> Iterator[KvstormServer]:
    token = secrets.token_urlsafe(16)
    previous = os.environ.get(ADMIN_TOKEN_ENV)
    os.environ[ADMIN_TOKEN_ENV] = token
    log = tmp_path_factory.mktemp("server") / "server.log"
    try:
        with processes.kvstorm_server(SERVER_ARGS, log) as kvstorm:
            yield KvstormServer(kvstorm.url, EngineAdmin(kvstorm.url, token))
    finally:
        if previous is None:
            os.environ.pop(ADMIN_TOKEN_ENV, None)
        else:
            os.environ[ADMIN_TOKEN_ENV] = previous
