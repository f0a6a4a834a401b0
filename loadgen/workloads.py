"""Workloads: what each scheduled request asks for (prompt, endpoint, output length).

Specs (``--workload``)::

    random[:low=1000,high=30000]   completions with ``prompt`` = a list of random token ids in [low, high)
                                   (ids in a range every common vocabulary has; no tokenizer needed)
    chat                           chat completions built from the corpus that ships with the package;
                                   about 0.75 words per token, so prompt lengths are approximate (the
                                   server's usage.prompt_tokens is what the results record)
    jsonl:path=prompts.jsonl       one object per line: {"prompt": str | [int]} (completions) or
                                   {"messages": [...]} (chat), optionally "max_tokens"
    shared-prefix:num_prefixes=4,prefix_len=512[,low=1000,high=30000]
                                   completions of random token ids: one of ``num_prefixes`` fixed prefixes of
                                   ``prefix_len`` tokens (picked at random), then ``--input-len`` tokens of its own;
                                   every request after the first of its prefix could be served that prefix from a
                                   prefix cache (the results say how much the server reports it did)
    multiturn:turns=6,system_len=1000[,think_s=0]
                                   chat sessions (``loadgen.sessions``): each arrival starts a session, whose turn k
                                   sends the system prompt (shared by every session), the conversation so far with
                                   the answers as they streamed, and a new user message of ``--input-len`` tokens;
                                   the next turn leaves ``think_s`` after the answer ends

Lengths (``--input-len``, ``--output-len``): ``fixed:128``, ``uniform:64-512``, ``normal:mean=256,std=64[,max=N]``,
``lognormal:median=256,sigma=0.5[,max=N]``. ``fixed`` and ``uniform`` give the lengths written; ``normal`` and
``lognormal`` samples are rounded and clipped to [1, max], max 32,768 tokens unless given (``MAX_SAMPLED_LENGTH``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.arrivals import Arrival
from loadgen.spec import Spec, parse_spec

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
WORKLOAD_KINDS = {"random", "chat", "jsonl", "shared-prefix", "multiturn"}
LENGTH_KINDS = {"fixed", "uniform", "normal", "lognormal"}
WORDS_PER_TOKEN = 0.75
# The longest length a normal or lognormal spec gives unless its max= says otherwise: their tails are unbounded (a
# lognormal of sigma 1 about 32,768 reaches millions), and 32 Ki tokens is beyond the context most served models take,
# so a longer sample is a request the server refuses, not the load asked for. A long-context run gives max=.
MAX_SAMPLED_LENGTH = 32_768


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run, fully decided before the run starts (so the schedule does not depend on the server)."""

    index: int
    offset_s: float
    path: str
    body: dict[str, Any]
    max_tokens: int
    # Leading prompt tokens an earlier request of the run sent first: the most a prefix cache can serve it (0 when
    # the workload shares nothing, or cannot count tokens).
    shared_prefix_tokens: int = 0


def request_body(
    planned: PlannedRequest, model: str, *, exact_output: bool, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON body of a streamed request. ``exact_output`` asks for exactly ``max_tokens`` tokens with
    ``ignore_eos`` and ``min_tokens`` (vLLM, SGLang and kvstorm read them; a server that does not may stop early or
    reject the request, and the report says so). Usage comes in the last chunk (``include_usage``)."""
    body = {
        **planned.body,
        "model": model,
        "max_tokens": planned.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if exact_output:
        body.update(ignore_eos=True, min_tokens=planned.max_tokens)
    return {**body, **(extra_body or {})}


def sample_lengths(text: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` integer lengths from a length spec: ``fixed`` and ``uniform`` as written, ``normal`` and
    ``lognormal`` rounded and clipped to [1, max]."""
    spec = parse_spec(text, LENGTH_KINDS)
    if spec.kind == "fixed":
        return np.full(count, _bare_int(spec), dtype=np.int64)
    if spec.kind == "uniform":
        low, high = _uniform_bounds(spec)
        return rng.integers(low, high + 1, size=count).astype(np.int64)
    location, scale, high = _distribution(spec)
    if spec.kind == "normal":
        values = rng.normal(location, scale, size=count)
    else:
        values = rng.lognormal(np.log(location), scale, size=count)
    return np.clip(np.rint(values), 1, high).astype(np.int64)


def mean_length(text: str) -> float:
    """The expected length of a length spec, its clipping included."""
    spec = parse_spec(text, LENGTH_KINDS)
    if spec.kind == "fixed":
        return float(_bare_int(spec))
    if spec.kind == "uniform":
        return sum(_uniform_bounds(spec)) / 2
    location, scale, high = _distribution(spec)
    return _clipped_mean(spec.kind, location, scale, 1, high)


def _distribution(spec: Spec) -> tuple[float, float, int]:
    """A normal's mean and std, or a lognormal's median and sigma, and the longest length it gives (``max``)."""
    center, spread = ("mean", "std") if spec.kind == "normal" else ("median", "sigma")
    spec.check_keys({center, spread, "max"})
    location, scale = spec.get_float(center, minimum=1), spec.get_float(spread, minimum=0)
    high = spec.get_int("max", MAX_SAMPLED_LENGTH, minimum=1)
    if location > high:
        raise ValueError(f"{spec.text!r}: {center}={location:g} is above max={high}: give a larger max=")
    return location, scale, high


def _clipped_mean(kind: str, location: float, scale: float, low: int, high: int) -> float:
    """E[clip(X, low, high)] of a normal (mean, std) or a lognormal (median, sigma): what lies below ``low`` counts
    as ``low``, above ``high`` as ``high`` (rounding to whole tokens moves the mean by well under one)."""
    if scale == 0:
        return float(min(max(location, low), high))
    if kind == "normal":
        alpha, beta = (low - location) / scale, (high - location) / scale
        inside = location * (_normal_cdf(beta) - _normal_cdf(alpha)) + scale * (_normal_pdf(alpha) - _normal_pdf(beta))
    else:
        mu = math.log(location)
        alpha, beta = (math.log(low) - mu) / scale, (math.log(high) - mu) / scale
        inside = _lognormal_part(mu, scale, beta) - _lognormal_part(mu, scale, alpha)
    return low * _normal_cdf(alpha) + high * (1 - _normal_cdf(beta)) + inside


def _lognormal_part(mu: float, sigma: float, z: float) -> float:
    """E[X; ln X <= mu + z sigma] = e^(mu + sigma^2/2) Phi(z - sigma), in logs: the exponential alone overflows for
    a wide sigma while the probability beside it vanishes."""
    probability = _normal_cdf(z - sigma)
    return math.exp(mu + sigma**2 / 2 + math.log(probability)) if probability > 0 else 0.0


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def _normal_pdf(z: float) -> float:
    return math.exp(-(z**2) / 2) / math.sqrt(2 * math.pi)


def _uniform_bounds(spec: Spec) -> tuple[int, int]:
    low, _, high = spec.args.partition("-")
    try:
        low_value, high_value = int(low), int(high)
    except ValueError:
        raise ValueError(f"{spec.text!r}: expected uniform:LOW-HIGH, e.g. uniform:64-512") from None
    if not 1 <= low_value <= high_value:
        raise ValueError(f"{spec.text!r}: need 1 <= LOW <= HIGH")
    return low_value, high_value


def _bare_int(spec: Spec) -> int:
    try:
        value = int(spec.args)
    except ValueError:
        raise ValueError(f"{spec.text!r}: expected fixed:N, e.g. fixed:128") from None
    if value < 1:
        raise ValueError(f"{spec.text!r}: N must be >= 1")
    return value


def is_session_workload(workload: str) -> bool:
    """Whether the workload is conversations (``loadgen.sessions`` plans and runs them), not single requests."""
    return parse_spec(workload, WORKLOAD_KINDS).kind == "multiturn"


def build_plan(
    arrivals: list[Arrival],
    workload: str,
    *,
    input_len: str,
    output_len: str,
    seed: int = 0,
    shared_seed: int | None = None,
) -> list[PlannedRequest]:
    """Pair each arrival with a prompt and an output length; a trace's own lengths win over the distributions.

    ``shared_seed`` draws the shared-prefix workload's prefixes on their own (by default they are drawn with the rest
    from ``seed``): planners of parts of one run (Locust's users) pass the same one, so that they share the prefixes
    while each draws its own suffixes."""
    spec = parse_spec(workload, WORKLOAD_KINDS)
    if spec.kind == "multiturn":
        raise ValueError(f"{workload!r} is a session workload: plan it with loadgen.sessions.build_sessions")
    rng = np.random.default_rng(seed + 1)
    prompt_lens = sample_lengths(input_len, len(arrivals), rng)
    output_lens = sample_lengths(output_len, len(arrivals), rng)
    jsonl_items = _read_jsonl(spec) if spec.kind == "jsonl" else []
    sentences = corpus_sentences() if spec.kind == "chat" else []
    if spec.kind in ("random", "shared-prefix"):
        low, high = _token_id_range(spec)
    shared_rng = rng if shared_seed is None else np.random.default_rng(shared_seed + 1)
    prefixes = _shared_prefixes(spec, shared_rng, low, high) if spec.kind == "shared-prefix" else []
    prefixes_sent: set[int] = set()
    blocks = _TraceBlocks(seed)
    if any(arrival.block_ids for arrival in arrivals) and spec.kind != "random":
        raise ValueError(
            f"{workload!r}: a trace with prefix blocks (Mooncake's hash_ids) needs --workload random, whose prompts "
            "are token ids: one block of them per id"
        )
    plan = []
    for index, arrival in enumerate(arrivals):
        prompt_len = arrival.prompt_len or int(prompt_lens[index])
        max_tokens = arrival.output_len or int(output_lens[index])
        shared = 0
        if arrival.block_ids:
            prompt, shared = blocks.prompt(arrival, low, high)
            path, body = COMPLETIONS_PATH, {"prompt": prompt}
        elif spec.kind == "random":
            path, body = COMPLETIONS_PATH, {"prompt": rng.integers(low, high, size=prompt_len).tolist()}
        elif spec.kind == "shared-prefix":
            choice = int(rng.integers(len(prefixes)))
            suffix = rng.integers(low, high, size=prompt_len).tolist()
            path, body = COMPLETIONS_PATH, {"prompt": prefixes[choice] + suffix}
            shared = len(prefixes[choice]) if choice in prefixes_sent else 0
            prefixes_sent.add(choice)
        elif spec.kind == "chat":
            text = corpus_text(sentences, prompt_len, rng)
            path, body = CHAT_PATH, {"messages": [{"role": "user", "content": text}]}
        else:
            path, body, max_tokens = _jsonl_request(jsonl_items[index % len(jsonl_items)], max_tokens, spec)
        plan.append(PlannedRequest(index, arrival.offset_s, path, body, max_tokens, shared))
    return plan


class _TraceBlocks:
    """A trace's prefix blocks as token ids: the same tokens for the same id, wherever it recurs."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        # Per block id, how many of its tokens a request has sent (the end of a prompt may cut its last block).
        self.sent: dict[int, int] = {}
        self.num_prompts = 0

    def prompt(self, arrival: Arrival, low: int, high: int) -> tuple[list[int], int]:
        """The arrival's prompt, and how many of its leading tokens an earlier request sent (an id names a whole
        prefix: the shared part ends at the first block not sent whole before)."""
        tokens: list[int] = []
        for block_id in arrival.block_ids:
            tokens += np.random.default_rng([self.seed, block_id]).integers(low, high, size=arrival.block_len).tolist()
        prompt_len = arrival.prompt_len or len(tokens)
        # A prompt longer than its blocks (a trace's last block is partial, rounding) ends in tokens of its own.
        own = np.random.default_rng([self.seed, 1 << 40, self.num_prompts])
        tokens += own.integers(low, high, size=max(0, prompt_len - len(tokens))).tolist()
        self.num_prompts += 1
        shared = 0
        for block_id in arrival.block_ids:
            num_sent = self.sent.get(block_id, 0)
            shared += num_sent
            if num_sent < arrival.block_len:
                break
        for index, block_id in enumerate(arrival.block_ids):
            num_in_prompt = min(arrival.block_len, max(0, prompt_len - index * arrival.block_len))
            self.sent[block_id] = max(self.sent.get(block_id, 0), num_in_prompt)
        return tokens[:prompt_len], min(shared, prompt_len)


def _token_id_range(spec: Spec) -> tuple[int, int]:
    spec.check_keys({"low", "high"} | ({"num_prefixes", "prefix_len"} if spec.kind == "shared-prefix" else set()))
    low, high = spec.get_int("low", 1000, minimum=0), spec.get_int("high", 30000, minimum=1)
    if low >= high:
        raise ValueError(f"{spec.text!r}: need low < high")
    return low, high


def _shared_prefixes(spec: Spec, rng: np.random.Generator, low: int, high: int) -> list[list[int]]:
    num_prefixes = spec.get_int("num_prefixes", minimum=1)
    prefix_len = spec.get_int("prefix_len", minimum=1)
    return [rng.integers(low, high, size=prefix_len).tolist() for _ in range(num_prefixes)]


def corpus_sentences() -> list[str]:
    text = resources.files("loadgen").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [sentence for sentence in re.split(r"(?<=[.!?])\s+", text) if sentence]


def corpus_text(sentences: list[str], prompt_len: int, rng: np.random.Generator) -> str:
    """About ``prompt_len`` tokens of consecutive corpus sentences from a random start, wrapping around."""
    num_words = max(1, round(prompt_len * WORDS_PER_TOKEN))
    words: list[str] = []
    position = int(rng.integers(len(sentences)))
    while len(words) < num_words:
        words.extend(sentences[position % len(sentences)].split())
        position += 1
    return " ".join(words[:num_words])


def _read_jsonl(spec: Spec) -> list[dict[str, Any]]:
    spec.check_keys({"path"})
    path = Path(spec.params.get("path") or spec.args)
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def jsonl_mean_lengths(workload: str, output_len: float) -> tuple[float, float]:
    """A jsonl workload's mean prompt tokens (token ids counted, text at ``WORDS_PER_TOKEN``) and mean output tokens
    (a line's own max_tokens, else ``output_len``)."""
    items = _read_jsonl(parse_spec(workload, WORKLOAD_KINDS))
    num_tokens = [_approximate_tokens(item.get("prompt", item.get("messages", ""))) for item in items]
    return float(np.mean(num_tokens)), float(np.mean([float(item.get("max_tokens", output_len)) for item in items]))


def _approximate_tokens(prompt: Any) -> float:
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return len(prompt)
    return len(str(prompt).split()) / WORDS_PER_TOKEN  # text, or chat messages (their words, keys and all)


def _jsonl_request(item: dict[str, Any], max_tokens: int, spec: Spec) -> tuple[str, dict[str, Any], int]:
    max_tokens = int(item.get("max_tokens", max_tokens))
    if "messages" in item:
        return CHAT_PATH, {"messages": item["messages"]}, max_tokens
    if "prompt" in item:
        return COMPLETIONS_PATH, {"prompt": item["prompt"]}, max_tokens
    raise ValueError(f"{spec.text!r}: every line needs 'prompt' or 'messages' (got keys {sorted(item)})")
