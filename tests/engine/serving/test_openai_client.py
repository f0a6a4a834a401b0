"""The official openai client against a live server with the real model: completions and chat, JSON and SSE."""

from __future__ import annotations

import openai
import pytest
import requests

from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLM
from tests.engine.serving.conftest import make_engine, metric_value, running_server

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    with running_server(make_engine(real_model, real_tokenizer)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(real_model, real_tokenizer):
    """The same model without the server: what greedy output must be."""
    llm = LLM(tokenizer=real_tokenizer, loaded_model=real_model, kv_cache_memory=64 << 20, swap_space=0)

    def generate(prompt, max_tokens: int, **params):
        (completion,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **params))
        return completion

    return generate


def test_completion_json_is_the_offline_greedy_answer_with_exact_usage(client, offline, real_tokenizer):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    expected = offline(PROMPT, 8)
    (choice,) = response.choices
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(real_tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_completion_stream_has_one_chunk_per_token_then_usage(client, offline):
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(token_chunks) == 8
    assert "".join(c.choices[0].text for c in token_chunks) == offline(PROMPT, 8).text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 7 + ["length"]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (5, 8)


def test_chat_json_and_stream_agree_and_stop_at_eos(client, offline, real_tokenizer):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == offline(real_tokenizer.apply_chat_template(QUESTION), 40).text
    assert choice.finish_reason == "stop"
    assert response.usage.prompt_tokens == len(real_tokenizer.apply_chat_template(QUESTION))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_token_id_prompts_and_prompt_lists_give_one_choice_each_in_order(client, offline, real_tokenizer):
    ids = real_tokenizer.encode("Paged attention")
    response = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=5, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [offline(PROMPT, 5).text, offline("Once upon a time", 5).text]
    assert response.usage.completion_tokens == 10
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == offline(ids, 5).text
    stream = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: by_ids.choices[0].text, 1: by_ids.choices[0].text}


def test_a_stop_string_never_leaks_into_the_stream(client, offline):
    full = offline(PROMPT, 12).text
    stop = full[len(full) // 2 : len(full) // 2 + 4]  # spans token boundaries in the middle of the answer
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full[: full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_stream_and_json_agree(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert value <= 0
        assert max(top.values()) == pytest.approx(value)  # greedy: the chosen token is the most likely
        assert top[token] == pytest.approx(value)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, stream=True)
    streamed = [v for chunk in stream for v in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs)


def test_chat_logprobs_stream_and_json_agree_with_completions(client):
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 4
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert [top.logprob for top in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [e.logprob for chunk in stream if chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx([entry.logprob for entry in content])
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == response.choices[0].message.content


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(client):
    def sample(seed: int) -> str:
        params = {"max_tokens": 12, "temperature": 1.0, "seed": seed}
        return client.completions.create(model=MODEL, prompt="Once upon a time", **params).choices[0].text

    assert sample(1) == sample(1)
    assert len({sample(1), sample(2), sample(3)}) > 1


def test_models_lists_the_served_model(client):
    (card,) = client.models.list().data
    assert card.id == MODEL


def test_metrics_count_what_was_served_and_every_block_is_free_after(server, client):
    before = requests.get(f"{server.url}/metrics").text
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    after = requests.get(f"{server.url}/metrics").text
    tokens = metric_value(after, "vllm:generation_tokens_total") - metric_value(before, "vllm:generation_tokens_total")
    assert tokens == 3
    length = {"model_name": MODEL, "finished_reason": "length"}
    assert metric_value(after, "vllm:request_success_total", **length) == (
        metric_value(before, "vllm:request_success_total", **length) + 1
    )
    assert metric_value(after, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric_value(after, "vllm:num_requests_running") == 0
    assert metric_value(after, "kvstorm:free_blocks", pool="device") == metric_value(
        after, "kvstorm:total_blocks", pool="device"
    )


def test_vllm_style_extra_parameters_reach_the_sampler(client, offline, real_tokenizer):
    natural = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    assert natural.choices[0].finish_reason == "stop"
    longer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, extra_body={"min_tokens": 12}
    )
    assert natural.usage.completion_tokens < 12 <= longer.usage.completion_tokens
    top_one = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3, extra_body={"top_k": 1}
    )
    assert top_one.choices[0].text == offline(PROMPT, 8).text
    to_the_end = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (to_the_end.choices[0].finish_reason, to_the_end.usage.completion_tokens) == ("length", 20)


def test_newer_client_fields_are_understood(client, offline, real_tokenizer):
    # Current clients send max_completion_tokens for chat, and some send the penalties at 0 by default.
    response = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_completion_tokens=3,
        temperature=0,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.content == offline(real_tokenizer.apply_chat_template(QUESTION), 3).text
