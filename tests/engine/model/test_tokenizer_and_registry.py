from __future__ import annotations

import pytest
import torch

from engine.core.interface import PromptTooLong
from engine.model.packed_linear import packing_applies
from engine.model.registry import describe_dtype_choice, native_bfloat16_cpu_feature, resolve_dtype, resolve_model
from engine.model.tokenizer import IncrementalDetokenizer
from kernels.cpu_isa import ceiling_name, visible_cpu_flags


@pytest.mark.parametrize(
    "text",
    ["Hello, world! This is plain ASCII.", "Emoji 🚀🔥 and accents: déjà vu, naïve.", "日本語のテキストと中文混合。"],
)
def test_incremental_detokenizer_reproduces_full_decode(real_tokenizer, text):
    token_ids = real_tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(real_tokenizer)
    deltas = [detokenizer.push(token_id) for token_id in token_ids]
    assert "".join(deltas) == real_tokenizer.decode(token_ids) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_chat_template_adds_the_assistant_header(real_tokenizer):
    ids = real_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = real_tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert real_tokenizer.eos_token_ids == frozenset({2})


TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Emoji 🚀🔥 and accents: déjà vu, naïve. 日本語のテキスト",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>",
    "\n" + " " * 80 + "x\t\t  \r\n" * 3,
]


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_are_transformers_own(real_tokenizer, text):
    hf = real_tokenizer.hf_tokenizer
    assert real_tokenizer.encode(text) == hf.encode(text)
    messages = [{"role": "user", "content": text}]
    expected = hf.encode(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)  # fmt: skip
    assert real_tokenizer.apply_chat_template(messages) == expected


def test_no_token_stands_for_more_bytes_than_the_length_bound_assumes(real_tokenizer):
    longest = max(
        len(real_tokenizer.decode([token_id], skip_special_tokens=False).encode())
        for token_id in range(real_tokenizer.vocab_size)
    )
    assert real_tokenizer.max_bytes_per_token == longest == 81


@pytest.mark.parametrize("text", [*TEXTS, ("\n" + " " * 80) * 50, "🚀" * 300])
def test_a_text_is_refused_from_its_length_only_when_it_cannot_fit(real_tokenizer, text):
    num_tokens = len(real_tokenizer.encode(text))
    assert num_tokens >= len(text.encode()) / real_tokenizer.max_bytes_per_token
    assert real_tokenizer.encode(text, max_num_tokens=num_tokens)  # fits exactly: never refused
    floor = -(-len(text.encode()) // real_tokenizer.max_bytes_per_token)
    with pytest.raises(PromptTooLong, match=f"{len(text.encode())} bytes of text are at least {floor} tokens"):
        real_tokenizer.encode(text, max_num_tokens=floor - 1)


def test_alias_resolves_to_the_bundled_gguf(real_source):
    assert real_source.kind == "gguf"
    assert real_source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = real_source.load_config()
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert config.tie_word_embeddings
    assert config.vocab_size == 49152


def test_random_preset_is_reproducible_from_its_seed():
    source = resolve_model("random:tiny")
    a, b, c = (source.load_model(seed=s) for s in (1, 1, 2))
    assert torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    with pytest.raises(ValueError, match="no tokenizer"):
        source.load_tokenizer()


@pytest.mark.parametrize(
    ("spec", "message"),
    [("no-such-model", "cannot resolve model 'no-such-model'"), ("random:huge", "unknown preset 'huge'")],
)
def test_unknown_models_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_model(spec)


def test_dtype_defaults_follow_the_device_and_the_cpus_bfloat16_support():
    cpu = torch.device("cpu")
    native = {"avx512_bf16", "amx_bf16", "bf16"} & visible_cpu_flags()
    expected = torch.bfloat16 if native and packing_applies(cpu, torch.bfloat16) else torch.float32
    assert resolve_dtype("auto", cpu) == expected
    choice = describe_dtype_choice("auto", cpu)
    if native:
        assert choice.startswith(f"auto: the CPU has {native_bfloat16_cpu_feature()}"), choice
        assert native_bfloat16_cpu_feature() in native
    elif ceiling_name() != "native":
        assert choice == f"auto: no native bfloat16 multiply under the {ceiling_name()} ceiling"
    else:
        assert choice == "auto: the CPU has no native bfloat16 multiply"
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert describe_dtype_choice("float32", cpu) == "--dtype float32"
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
