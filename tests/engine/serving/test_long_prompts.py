"""Long text prompts cannot block the event loop: one that could not fit the context whatever its tokens is refused
from its size before it is tokenized, and one that might fit is tokenized on a thread while ``/health`` and the
other requests are answered. (A megabyte took 1.28 s to tokenize on the loop, and ``/health`` as long.)"""

from __future__ import annotations

import random
import statistics
import threading
import time

import pytest
import requests

from tests.engine.serving.conftest import make_engine, running_server

MODEL = "smollm2-135m"
MAX_BODY_BYTES = 4 << 20
NUM_LONG_PROMPTS = 6
# /health while they tokenize, against a tokenize of one of them (0.7-0.9 s on a 2-core Xeon) that held the loop
# throughout: a typical probe far under it, the slowest still under it (0.13 s measured with the machine's load
# average at 4, the tokenizing threads and this test's clients contending for the same two cores).
MAX_MEDIAN_HEALTH_S = 0.1
MAX_HEALTH_S = 0.5


def words_text(num_bytes: int, seed: int) -> str:
    """Text of ``num_bytes`` bytes of random words: several bytes a token, so slow to tokenize per byte."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]
    text = ""
    while len(text) < num_bytes:
        text += " ".join(rng.choices(vocabulary, k=10_000)) + " "
    return text[:num_bytes]


def chat(server, content: str) -> requests.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    with running_server(make_engine(real_model, real_tokenizer), max_body_bytes=MAX_BODY_BYTES) as running:
        yield running


def largest_that_might_fit(server) -> int:
    """Bytes of a message whose conversation is just under the size past which it cannot fit, whatever its tokens."""
    info, tokenizer = server.async_engine.engine.info, server.async_engine.engine.tokenizer
    return info.max_model_len * tokenizer.max_bytes_per_token - 1000  # room for the chat template's own text


def test_a_prompt_that_cannot_fit_whatever_its_tokens_is_refused_before_tokenizing(server):
    info, tokenizer = server.async_engine.engine.info, server.async_engine.engine.tokenizer
    text = words_text(3 << 20, seed=1)  # tokenizing it would take seconds
    started = time.monotonic()
    refused = chat(server, text)
    refused_s = time.monotonic() - started
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages"
    assert f"too long for the model's context of {info.max_model_len} tokens" in error["message"]
    assert f"no token of this tokenizer is longer than {tokenizer.max_bytes_per_token} bytes" in error["message"]
    completion = {"model": MODEL, "prompt": text, "max_tokens": 4}
    refused_too = requests.post(f"{server.url}/v1/completions", json=completion, timeout=120)
    assert refused_too.status_code == 400, refused_too.text
    minimum = -(-len(text) // tokenizer.max_bytes_per_token)
    assert f"{len(text)} bytes of text are at least {minimum} tokens" in refused_too.json()["error"]["message"]

    started = time.monotonic()
    tokenized = chat(server, words_text(largest_that_might_fit(server), seed=2))
    tokenized_s = time.monotonic() - started
    assert tokenized.status_code == 400, tokenized.text
    assert f"exceeds the model's context of {info.max_model_len} tokens" in tokenized.json()["error"]["message"]
    # Four times its size, refused faster than it was tokenized and refused.
    assert refused_s < tokenized_s, (refused_s, tokenized_s)


def test_health_answers_fast_while_long_prompts_tokenize(server):
    texts = [words_text(largest_that_might_fit(server), seed=10 + i) for i in range(NUM_LONG_PROMPTS)]
    statuses: list[int] = []
    long_ones = [threading.Thread(target=lambda t=t: statuses.append(chat(server, t).status_code)) for t in texts]
    started = time.monotonic()
    for thread in long_ones:
        thread.start()
    health_s: list[float] = []
    while any(thread.is_alive() for thread in long_ones):
        asked = time.monotonic()
        assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
        health_s.append(time.monotonic() - asked)
        time.sleep(0.02)
    tokenizing_s = time.monotonic() - started
    assert statuses == [400] * NUM_LONG_PROMPTS  # each tokenized, then found longer than the context
    assert tokenizing_s > MAX_HEALTH_S, tokenizing_s
    assert len(health_s) >= 5  # the probes overlapped the tokenizing
    assert statistics.median(health_s) < MAX_MEDIAN_HEALTH_S, (statistics.median(health_s), tokenizing_s)
    assert max(health_s) < MAX_HEALTH_S, (max(health_s), tokenizing_s)
