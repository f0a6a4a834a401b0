"""Bad input, one row each: the right status, OpenAI's error JSON, a message that says what is wrong.

Afterwards the server still answers correctly and holds no request and no block.
"""

from __future__ import annotations

import json

import pytest
import requests

from tests.engine.serving.conftest import make_engine, metric_value, running_server

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 256
NUM_BLOCKS = 12  # 192 tokens: a request can fit the context and still not fit the pool
MAX_BODY_BYTES = 4096
OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}


def completion(**fields: object) -> bytes:
    return json.dumps({**OK, **fields}).encode()


def without(field: str) -> bytes:
    return json.dumps({k: v for k, v in OK.items() if k != field}).encode()


def chat(**fields: object) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return json.dumps({**body, **fields}).encode()


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CASES = [
    # (route, body, status, param, message fragment)
    (COMPLETIONS, b'{"model": "smollm2-135m", "prompt": ', 400, None, "not valid JSON"),
    (COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', 400, None, "not valid UTF-8"),
    (COMPLETIONS, b"[1, 2, 3]", 400, None, "must be a JSON object, got list"),
    (COMPLETIONS, b"", 400, None, "not valid JSON"),
    (COMPLETIONS, without("model"), 400, "model", "'model': Field required"),
    (COMPLETIONS, without("prompt"), 400, "prompt", "'prompt': Field required"),
    (COMPLETIONS, completion(model="gpt-4"), 404, "model", "model 'gpt-4' does not exist"),
    (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens", "greater than or equal to 1"),
    (COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens", "valid integer"),
    (COMPLETIONS, completion(max_tokens=2.5), 400, "max_tokens", "valid integer"),
    (COMPLETIONS, completion(temperature=-0.5), 400, "temperature", "greater than or equal to 0"),
    (COMPLETIONS, completion(temperature="hot"), 400, "temperature", "valid number"),
    (COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}', 400, "temperature", "finite"),
    (COMPLETIONS, completion(top_p=0), 400, "top_p", "greater than 0"),
    (COMPLETIONS, completion(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    (COMPLETIONS, completion(top_k=-3), 400, "top_k", "greater than or equal to 0"),
    (COMPLETIONS, completion(seed=-1), 400, "seed", "greater than or equal to 0"),
    (COMPLETIONS, completion(n=129), 400, "n", "'n': Input should be less than or equal to 128"),
    (COMPLETIONS, completion(stream="yes"), 400, "stream", "valid boolean"),
    (COMPLETIONS, completion(ignore_eos=1), 400, "ignore_eos", "valid boolean"),
    (COMPLETIONS, completion(best_of=3), 400, None, "best_of (3) other than n (1) is not supported"),
    (COMPLETIONS, completion(presence_penalty=2.5), 400, "presence_penalty", "less than or equal to 2"),
    (COMPLETIONS, completion(frequency_penalty="x"), 400, "frequency_penalty", "valid number"),
    (COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty", "greater than 0"),
    (COMPLETIONS, completion(min_p=1.5), 400, "min_p", "less than or equal to 1"),
    (COMPLETIONS, completion(logit_bias={"50256": -100}), 400, "logit_bias", "[50256] are outside the vocabulary"),
    (COMPLETIONS, completion(logit_bias={"the": 1}), 400, "logit_bias", "keys are token ids"),
    (COMPLETIONS, completion(logit_bias={"5": 101}), 400, "logit_bias", "less than or equal to 100"),
    (COMPLETIONS, completion(stop_token_ids=[49152]), 400, "stop_token_ids", "outside the vocabulary"),
    (COMPLETIONS, completion(suffix="!"), 400, "suffix", "suffix (insertion) is not supported by kvstorm"),
    (COMPLETIONS, completion(echo=True, logprobs=1), 400, None, "echo with logprobs"),
    (COMPLETIONS, b'{"model": "smollm2-135m", "prompt": ' + b"[" * 1900 + b"]" * 1900 + b"}", 400, None, "nested"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "tools (function calling)"),
    (CHAT, chat(tool_choice="auto"), 400, "tool_choice", "'tool_choice': Input should be 'none'"),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format", "json_object is not supported"),
    (CHAT, chat(messages=[{"role": "tool", "content": "42"}]), 400, "messages", "'messages.0.role'"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages",
        "content part type 'image_url' is not supported",
    ),
    (CHAT, chat(max_tokens=4, max_completion_tokens=8), 400, None, "max_tokens and max_completion_tokens disagree"),
    (COMPLETIONS, completion(prompt=42), 400, "prompt", "'prompt' must be one of: str, list[int]"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt", "'prompt': List should have at least 1 item"),
    (COMPLETIONS, completion(prompt=[[1], []]), 400, "prompt", "'prompt.1': List should have at least 1 item"),
    (COMPLETIONS, completion(prompt=""), 400, "prompt", "at least one token"),
    (COMPLETIONS, completion(prompt=[1, 999_999]), 400, "prompt", "token ids must be integers in [0, 49152)"),
    (COMPLETIONS, completion(prompt="a\ud800b"), 400, None, "not valid Unicode: a \\u escape writes half of"),
    (CHAT, chat(messages=[{"role": "user", "content": "\udfff"}]), 400, None, "half of a surrogate pair"),
    (COMPLETIONS, completion(max_tokens=300), 400, "prompt", f"exceeds the model's context of {MAX_MODEL_LEN} tokens"),
    (
        COMPLETIONS,
        completion(max_tokens=200),
        400,
        "prompt",
        f"needs 13 KV blocks but the whole KV pool has {NUM_BLOCKS}",
    ),
    (COMPLETIONS, completion(prompt=["ok", " hello" * 300]), 400, "prompt", "prompt 1: prompt (300 tokens) + max"),
    (COMPLETIONS, completion(min_tokens=5), 400, None, "min_tokens must be an integer in [0, max_tokens=4]"),
    (COMPLETIONS, completion(logprobs=21), 400, "logprobs", "less than or equal to 20"),
    (COMPLETIONS, completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", "'stop': List should have at most 4 items"),
    (COMPLETIONS, completion(stop=[""]), 400, "stop", "'stop.0': String should have at least 1 character"),
    (COMPLETIONS, completion(stream_options={"include_usage": "yes"}), 400, "stream_options", "valid boolean"),
    (COMPLETIONS, completion(prompt="x" * MAX_BODY_BYTES), 413, None, f"Maximum request body size {MAX_BODY_BYTES}"),
    (CHAT, chat(messages=[]), 400, "messages", "at least 1 item"),
    (CHAT, chat(messages=[{"role": "robot", "content": "Hi"}]), 400, "messages", "'messages.0.role'"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages", "'messages.0.content"),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages", "Field required"),
    (CHAT, chat(top_logprobs=2), 400, None, "top_logprobs needs logprobs set to true"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "less than or equal to 20"),
    (CHAT, chat(logprobs="yes"), 400, "logprobs", "valid boolean"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/nothing-here", completion(), 404, None, "Not Found"),
]


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    engine = make_engine(real_model, real_tokenizer, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, max_body_bytes=MAX_BODY_BYTES) as running:
        yield running


@pytest.mark.parametrize(("route", "body", "status", "param", "fragment"), CASES)
def test_bad_input_gets_the_right_status_and_a_clear_openai_error(server, route, body, status, param, fragment):
    response = requests.post(f"{server.url}{route}", data=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"]
    assert error["param"] == param
    assert error["code"] == status
    assert error["type"] == "invalid_request_error"


def test_after_all_bad_input_the_server_serves_correctly_and_holds_nothing(server, real_tokenizer):
    for route, body, *_ in CASES:  # once more, back to back, then a good request
        requests.post(f"{server.url}{route}", data=body, headers={"Content-Type": "application/json"})
    response = requests.post(f"{server.url}{COMPLETIONS}", json={**OK, "temperature": 0, "max_tokens": 5})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert requests.get(f"{server.url}/health").status_code == 200
    metrics = requests.get(f"{server.url}/metrics").text
    assert metric_value(metrics, "kvstorm:rejected_requests_total", reason="invalid_request") >= 2 * 35
    assert metric_value(metrics, "kvstorm:free_blocks", pool="device") == NUM_BLOCKS
    stats = requests.get(f"{server.url}/admin/stats", headers=server.admin_headers).json()
    assert stats["num_in_flight"] == 0
    # What runs, named as --dtype and --attention-backend name it (this fixture's model attends with the reference).
    assert (stats["engine"]["dtype"], stats["engine"]["attention_backend"]) == ("float32", "torch")
