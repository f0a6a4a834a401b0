"""A GGUF file converted once into the cache: the same configuration, weights and tokenizer as the file read
directly, converted again when the file changes, and the file read directly where the cache cannot be written."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.config import PRESETS
from engine.model.gguf_cache import CACHE_DIR_ENV, converted_checkpoint
from engine.model.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_config
from engine.model.llama import LlamaForCausalLM
from engine.model.registry import resolve_model
from engine.model.tokenizer import Tokenizer
from tests.engine.model.gguf_writer import write_llama_gguf
from tests.engine.model.test_gguf_loader import hf_weights, tiny_hf_model


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    config = PRESETS["tiny"]
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, config, hf_weights(tiny_hf_model(config), config), gguf.GGMLQuantizationType.Q4_1)
    return path


def parameters_read_directly(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    reader = open_gguf(path)
    return dict(iter_gguf_weights(reader, read_gguf_config(reader), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_converted_checkpoint_loads_the_same_model_as_the_file(tiny_gguf, tmp_path, dtype):
    source = resolve_model(str(tiny_gguf))
    kind, directory = source.readable()
    assert kind == "safetensors"
    assert directory.parent == tmp_path / "cache" / "gguf"
    assert source.load_config() == read_gguf_config(open_gguf(tiny_gguf))
    from_cache = source.load_model(dtype=dtype)
    direct = LlamaForCausalLM(from_cache.config, TorchAttentionBackend()).to(dtype=dtype)
    direct.load_weights(parameters_read_directly(tiny_gguf, dtype).items())
    for (name, ours), (_, theirs) in zip(from_cache.named_parameters(), direct.named_parameters(), strict=True):
        assert ours.dtype == dtype
        assert torch.equal(ours, theirs), name


def test_a_file_is_converted_once_and_again_when_it_changes(tiny_gguf):
    first = converted_checkpoint(tiny_gguf)
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert converted_checkpoint(tiny_gguf) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".converting-")]
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = converted_checkpoint(tiny_gguf)
    assert second != first
    assert (second / "config.json").is_file()


def test_an_unwritable_cache_reads_the_file_directly(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(blocker / "cache"))
    source = resolve_model(str(tiny_gguf))
    assert source.readable() == ("gguf", tiny_gguf)
    model = source.load_model()
    assert torch.equal(
        model.embed_tokens.weight, parameters_read_directly(tiny_gguf, torch.float32)["model.embed_tokens.weight"]
    )


def test_the_converted_tokenizer_is_the_files(real_source):
    """The bundled model's tokenizer as saved in the cache against transformers reading the file again."""
    cached = real_source.load_tokenizer()
    kind, directory = real_source.readable()
    assert kind == "safetensors"
    assert cached.hf_tokenizer.name_or_path == str(directory)
    direct = Tokenizer.from_gguf(real_source.path)
    texts = ["Hello, world!", "Emoji 🚀 and accents: déjà vu.", "日本語と中文", "  spaces\tand\nlines  ", "<|im_end|>"]
    for text in texts:
        assert cached.encode(text) == direct.encode(text)
        ids = direct.encode(text)
        assert cached.decode(ids, skip_special_tokens=False) == direct.decode(ids, skip_special_tokens=False)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(chat) == direct.apply_chat_template(chat)
    assert cached.eos_token_ids == direct.eos_token_ids
    assert cached.vocab_size == direct.vocab_size
