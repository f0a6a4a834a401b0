"""Session-wide fixtures: the real model, its tokenizer, and transformers as the logits oracle.

Loading each costs seconds, so each is loaded once per test session.
"""

from __future__ import annotations

import os

# Triton decides at kernel definition whether to interpret, so this must precede every import of a kernel: the
# tests run the Triton kernels on the CPU (a GPU machine runs them natively through scripts/gpu_check.sh).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

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
