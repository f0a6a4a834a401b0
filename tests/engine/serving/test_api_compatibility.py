"""What the benchmark clients and SDKs of the field send, accepted and honoured by the real server on the real model.

Each sampling parameter shows its effect on the output (greedy, so the effect is the parameter's alone); chat
content parts, the developer role and name fields read as the plain messages they stand for; n, echo and
continuous usage come back in OpenAI's shapes; unknown fields are ignored and named (or refused with
``strict_api``); and the request bodies recorded from real clients (``scripts/capture_client_requests.py``: the
openai SDK, GuideLLM and vLLM's ``bench serve``, which failed with 400 before) succeed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from engine.serving.request_body import IGNORED_FIELDS_HEADER
from tests.engine.serving.conftest import make_engine, running_server

MODEL = "smollm2-135m"
PROMPT = "apple apple apple apple apple apple apple apple"
RECORDED = Path(__file__).parent / "recorded_client_requests.json"


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    with running_server(make_engine(real_model, real_tokenizer)) as running:
        yield running


def complete(server, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, messages, **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **fields}
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def text(response: dict, index: int = 0) -> str:
    choice = response["choices"][index]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def stream_events(server, route: str, body: dict) -> tuple[requests.Response, list[dict]]:
    response = requests.post(f"{server.url}{route}", json=body, stream=True, timeout=120)
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return response, [json.loads(event) for event in events[:-1]]


def test_penalties_and_logit_bias_change_greedy_output(server, real_tokenizer):
    plain = text(complete(server))
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}):
        assert text(complete(server, **penalty)) != plain, penalty
    assert text(complete(server, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)) == plain
    token = real_tokenizer.encode(" banana")[0]
    forced = complete(server, logit_bias={str(token): 100}, max_tokens=4)
    assert text(forced) == real_tokenizer.decode([token] * 4)
    first = real_tokenizer.encode(text(complete(server, max_tokens=1)))[0]
    assert text(complete(server, logit_bias={str(first): -100}, max_tokens=1)) != text(complete(server, max_tokens=1))


def test_min_p_keeps_only_tokens_near_the_top_one(server):
    greedy = text(complete(server))
    # min_p = 1 leaves the most likely token alone: sampling at any temperature is greedy.
    for seed in (1, 2, 3):
        assert text(complete(server, temperature=1.5, min_p=1.0, seed=seed)) == greedy
    free = {text(complete(server, temperature=1.5, seed=seed)) for seed in (1, 2, 3)}
    assert free != {greedy}


def test_n_choices_are_independent_reproducible_streams(server):
    body = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 16}
    first, again = complete(server, **body), complete(server, **body)
    texts = [text(first, i) for i in range(3)]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [text(again, i) for i in range(3)]
    assert len(set(texts)) == 3
    assert text(complete(server, temperature=1.0, seed=8, max_tokens=16)) == texts[1], "choice i uses seed + i"
    assert first["usage"]["completion_tokens"] == 3 * 16
    two_prompts = complete(server, prompt=["One", "Two"], n=2, best_of=2, max_tokens=3)
    assert len(two_prompts["choices"]) == 4
    replies = chat(server, [{"role": "user", "content": "Say hi"}], n=2, temperature=1.0, seed=3)
    assert len(replies["choices"]) == 2


def test_echo_returns_the_prompt_before_the_output_in_the_first_tokens_chunk(server, real_tokenizer):
    echoed = complete(server, echo=True)
    assert text(echoed) == PROMPT + text(complete(server))
    ids = real_tokenizer.encode("Hello there")
    assert text(complete(server, prompt=ids, echo=True, max_tokens=2)).startswith("Hello there")
    _, chunks = stream_events(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                          "temperature": 0, "echo": True, "stream": True})  # fmt: skip
    # The echo is not a generated token: it leaves with the first one, one chunk per token as before.
    assert len(chunks) == 4
    first_text = chunks[0]["choices"][0]["text"]
    assert first_text.startswith(PROMPT)
    assert len(first_text) > len(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text(complete(server, echo=True, max_tokens=4))


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "temperature": 0}  # fmt: skip
    _, chunks = stream_events(server, "/v1/chat/completions", body)
    usages = [chunk["usage"] for chunk in chunks]
    assert all(usage is not None for usage in usages)
    assert [u["completion_tokens"] for u in usages[1:-1]] == [1, 2, 3, 4, 5]
    assert chunks[-1]["choices"] == [] and usages[-1]["completion_tokens"] == 5  # noqa: PT018


def test_content_parts_developer_role_and_names_read_as_plain_messages(server):
    plain = chat(server, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"}])
    parts = chat(
        server,
        [
            {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
            {
                "role": "user",
                "name": "ada",
                "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
            },
        ],
    )
    joined = chat(server, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi\nthere"}])
    assert text(parts) == text(joined)
    assert text(plain)  # the single-string form still answers


def test_neutral_values_of_unsupported_parameters_are_accepted(server):
    chat(server, [{"role": "user", "content": "Hi"}], tools=[], tool_choice="none", response_format={"type": "text"},
         parallel_tool_calls=False, logit_bias={})  # fmt: skip
    complete(server, suffix=None, best_of=1, logit_bias=None, presence_penalty=None)


def test_unknown_fields_are_ignored_and_named_unless_strict(server, real_model, real_tokenizer):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "skip_special_tokens": True, "guided_json": None,
            "stream_options": {"include_usage": True, "vendor_flag": 1}, "stream": True}  # fmt: skip
    response, chunks = stream_events(server, "/v1/completions", body)
    named = set(response.headers[IGNORED_FIELDS_HEADER].split(","))
    assert named == {"skip_special_tokens", "guided_json", "stream_options.vendor_flag"}
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    with running_server(make_engine(real_model, real_tokenizer, num_blocks=32), strict_api=True) as strict:
        refused = requests.post(f"{strict.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert message in {f"unknown field '{name}'" for name in named}


@pytest.mark.parametrize("client", json.loads(RECORDED.read_text()), ids=lambda client: client["client"])
def test_recorded_client_requests_succeed(server, client):
    body = {**client["body"], "model": MODEL}
    if body.get("stream"):
        response, chunks = stream_events(server, client["route"], body)
        finish_reasons = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]]
    else:
        response = requests.post(f"{server.url}{client['route']}", json=body, timeout=120)
        assert response.status_code == 200, response.text
        finish_reasons = [choice["finish_reason"] for choice in response.json()["choices"]]
    assert finish_reasons[-1] in ("stop", "length")
    assert IGNORED_FIELDS_HEADER not in response.headers, "every field these clients send is known"


def test_stop_token_ids_end_the_output(server, real_tokenizer):
    plain = text(complete(server))
    token = real_tokenizer.encode(plain)[1]  # a token of the greedy output (re-encoding may merge the first)
    stopped = complete(server, stop_token_ids=[token])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert plain.startswith(text(stopped))
    assert len(text(stopped)) < len(plain)
