"""Prefix caching as a client and an operator see it, on the real model through a real server: OpenAI's
``usage.prompt_tokens_details.cached_tokens``, vLLM's prefix-cache counters in /metrics, the hit rate in
/admin/stats, ``POST /admin/reset_prefix_cache`` to start cold, and ``enable_prefix_caching=False`` turning it off."""

from __future__ import annotations

import pytest
import requests

from tests.engine.serving.conftest import BLOCK_SIZE, make_engine, metric_value, running_server

SYSTEM = (
    "You are the on-call assistant of a team that serves language models in production. Answer in one short "
    "sentence, name the metric that shows the problem, and never guess a number you were not given."
)


def chat(server, question: str) -> dict:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
    }
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_a_shared_system_prompt_is_served_from_the_cache_and_every_signal_says_so(real_model, real_tokenizer):
    with running_server(make_engine(real_model, real_tokenizer)) as server:
        first = chat(server, "Why is the time to first token high?")
        second = chat(server, "Why are requests preempted?")
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["prompt_tokens_details"]["cached_tokens"]
        # The system prompt's full blocks, at least: the template and the system text before the user's turn.
        assert cached >= 2 * BLOCK_SIZE
        assert cached % BLOCK_SIZE == 0
        assert cached < second["prompt_tokens"]

        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        queried = first["prompt_tokens"] + second["prompt_tokens"]
        assert metric_value(metrics, "vllm:prefix_cache_queries_total") == queried
        assert metric_value(metrics, "vllm:prefix_cache_hits_total") == cached
        assert metric_value(metrics, "vllm:prompt_tokens_cached_total") == cached
        assert metric_value(metrics, "kvstorm:prefix_cache_blocks", state="evictable") > 0
        stats = requests.get(f"{server.url}/admin/stats", headers=server.admin_headers, timeout=10).json()
        assert stats["prefix_cache"]["enabled"] is True
        assert stats["prefix_cache"]["hit_rate"] == pytest.approx(cached / queried)

        assert requests.post(f"{server.url}/admin/reset_prefix_cache", timeout=10).status_code == 401
        reset = requests.post(f"{server.url}/admin/reset_prefix_cache", headers=server.admin_headers, timeout=10)
        assert reset.status_code == 200
        assert reset.json()["num_cached_blocks_forgotten"] > 0
        cold = chat(server, "Why are requests preempted?")
        assert cold["prompt_tokens_details"]["cached_tokens"] == 0
        warm = chat(server, "Why are requests preempted?")  # all but the last prompt token's block
        assert warm["prompt_tokens_details"]["cached_tokens"] == (warm["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_with_prefix_caching_off_nothing_is_cached(real_model, real_tokenizer):
    with running_server(make_engine(real_model, real_tokenizer, enable_prefix_caching=False)) as server:
        chat(server, "Why is the time to first token high?")
        usage = chat(server, "Why is the time to first token high?")
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(metrics, "vllm:prefix_cache_queries_total") == 0
        stats = requests.get(f"{server.url}/admin/stats", headers=server.admin_headers, timeout=10).json()
        assert stats["prefix_cache"] == {
            "enabled": False,
            "hit_rate": None,
            "queried_tokens": 0,
            "hit_tokens": 0,
            "cached_blocks": 0,
            "evictable_blocks": 0,
            "evictions": 0,
        }
