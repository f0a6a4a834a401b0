"""The offline LLM API on the real model: stop strings, stop tokens, min_tokens, EOS."""

from __future__ import annotations

import pytest

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(real_model, real_tokenizer) -> LLM:
    return LLM(tokenizer=real_tokenizer, loaded_model=real_model, kv_cache_memory=64 << 20, swap_space=0)


def test_eos_ends_the_answer(llm, real_tokenizer):
    (completion,) = llm.generate(
        [real_tokenizer.apply_chat_template(QUESTION)], SamplingParams(max_tokens=40, temperature=0)
    )
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == 2  # <|im_end|>
    assert completion.text == "The capital of France is Paris."


def test_stop_string_cuts_the_text_before_it(llm, real_tokenizer):
    params = SamplingParams(max_tokens=40, temperature=0, stop=(" Paris",))
    (completion,) = llm.generate([real_tokenizer.apply_chat_template(QUESTION)], params)
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == " Paris"
    assert completion.text == "The capital of France is"


def test_min_tokens_keeps_generating_past_eos_and_max_tokens_ends_with_length(llm, real_tokenizer):
    prompt = real_tokenizer.apply_chat_template(QUESTION)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    (completion,) = llm.generate([prompt], params)
    assert len(completion.token_ids) == 12
    assert 2 not in completion.token_ids
    assert completion.finish_reason == "length"


def test_text_prompts_and_token_prompts_agree(llm, real_tokenizer):
    text = "The three primary colors are"
    params = SamplingParams(max_tokens=8, temperature=0)
    from_text, from_ids = llm.generate([text, real_tokenizer.encode(text)], params)
    assert from_text.token_ids == from_ids.token_ids
