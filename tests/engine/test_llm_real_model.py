"""The offline LLM API on the real model: stop strings, stop tokens, min_tokens, EOS."""

from __future__ import annotations

import pytest
import torch

from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLM
from engine.model_runner import ModelRunner

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


def test_logprobs_are_the_models_log_softmax_at_each_sampled_position(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=11, logprobs=3)
    request = engine.add_request("Paged attention is", params)
    logprobs = []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            logprobs.extend(output.logprobs)
    assert [lp.token_id for lp in logprobs] == request.output_token_ids

    context = request.prompt_token_ids + request.output_token_ids[:-1]
    runner = ModelRunner(engine.runner.model, num_device_blocks=4, num_host_blocks=0, block_size=16)
    logits = runner.forward([ScheduledRequest("r0", context, 0, [0, 1, 2, 3])])  # every position
    expected = torch.log_softmax(logits[request.num_prompt_tokens - 1 :].float(), dim=-1)
    for position, (value, row) in enumerate(zip(logprobs, expected, strict=True)):
        top = row.topk(3)
        assert value.logprob == pytest.approx(float(row[value.token_id]), abs=1e-4), position
        assert list(value.top_token_ids) == top.indices.tolist(), position
        assert value.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4), position


def test_logprobs_are_only_returned_when_asked(llm):
    engine = llm.engine
    engine.add_request("Paged attention is", SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        assert all(output.logprobs is None for output in engine.step().outputs)


def test_without_batch_invariance_the_packed_matmuls_take_every_row_at_once(real_tokenizer):
    llm = LLM(tokenizer=real_tokenizer, dtype="float32", kv_cache_memory=64 << 20, swap_space=0, batch_invariant=False)
    assert llm.engine.info.matmul == "onednn-packed"  # no slicing reported
    (completion,) = llm.generate(
        [real_tokenizer.apply_chat_template(QUESTION)], SamplingParams(max_tokens=40, temperature=0)
    )
    assert completion.text == "The capital of France is Paris."
