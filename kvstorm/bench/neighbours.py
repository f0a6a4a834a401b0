"""``kvstorm bench neighbours``: what the worst request each cap allows costs the request beside it.

Against a fresh ``kvstorm serve`` (admission off, so every request runs): a 32-token greedy request's end-to-end
latency alone, then beside one aggressor per capped field, the request that field's cap still allows at its worst
(300 logit_bias keys, four 256-character stop strings, 64 stop_token_ids, 32 unknown fields with 64-character
names), streaming long enough to outlast it; and, for scale, requests of ``N_FOR_SCALE`` choices: n is capped at
OpenAI's 128, and what keeps a request of many sequences from slowing its neighbours is admission, which counts
each as a request (off here, so these rows show the cost it guards against). Each is the median of ``--repeats``
tries; the aggressor starts ``AGGRESSOR_LEAD_S`` before the victim and is hung up on after it. The target: every
capped field's ratio at most 1.5x."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import time
from typing import Any

import aiohttp

from chaos.injectors.processes import kvstorm_server
from engine.serving.protocol import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from engine.serving.request_body import MAX_UNKNOWN_FIELD_CHARS, MAX_UNKNOWN_FIELDS
from kvstorm.bench.doc import BenchReport

TARGET_RATIO = 1.5
N_FOR_SCALE = (2, 4, 16)
AGGRESSOR_LEAD_S = 0.5
VICTIM_TOKENS = 32
PROMPT = "The history of paged memory begins with"
NOTE_ON_N = (
    "Each of a request's n sequences decodes in the same steps as the request beside it, as a separate request "
    "would (the plain request of the same length shows that cost for one): that is batching, not a per-token "
    "overhead. So n is capped only at OpenAI's 128 (`--max-sequences-per-request`), and admission counts each "
    "sequence as a request (its forecast, `--max-waiting`): under load a request of many gets a 429. Admission is "
    "off here, so the n rows show the cost it guards against."
)


def add_bench_neighbours_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "neighbours",
        help="a 32-token request's latency alone and beside the worst request each cap allows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--server-args", default="", help="kvstorm serve's arguments besides port, model, admission")
    parser.add_argument("--repeats", type=int, default=5, help="tries of each case (the median counts)")
    parser.add_argument("--aggressor-tokens", type=int, default=512, help="max_tokens of each aggressor")


def aggressors() -> dict[str, dict[str, Any]]:
    """Per capped field, the fields of the worst request its cap allows (on top of a plain streamed request); n for
    scale shows where batching alone crosses the target."""
    stop = ["\u2603" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS  # never produced: matched against at every token
    return {
        f"logit_bias: {MAX_LOGIT_BIAS} keys": {"logit_bias": {str(t): 0.5 for t in range(1000, 1000 + MAX_LOGIT_BIAS)}},
        f"stop: {MAX_STOP_STRINGS} x {MAX_STOP_STRING_CHARS} characters": {"stop": stop},
        f"stop_token_ids: {MAX_STOP_TOKEN_IDS}": {"stop_token_ids": list(range(30000, 30000 + MAX_STOP_TOKEN_IDS))},
        **{f"n: {n} (for scale: admission counts each sequence)": {"n": n} for n in N_FOR_SCALE},
        f"unknown fields: {MAX_UNKNOWN_FIELDS} x {MAX_UNKNOWN_FIELD_CHARS} characters": {
            f"{i:02d}".ljust(MAX_UNKNOWN_FIELD_CHARS, "u"): i for i in range(MAX_UNKNOWN_FIELDS)
        },
    } | {"(no aggressor: a plain request of the same length)": {}}


async def victim_latency_s(session: aiohttp.ClientSession, url: str, model: str) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as response:
        payload = await response.json()
    if response.status != 200 or payload["usage"]["completion_tokens"] != VICTIM_TOKENS:
        raise RuntimeError(f"the victim request failed: HTTP {response.status}: {payload}")
    return time.perf_counter() - started


async def beside(session: aiohttp.ClientSession, url: str, model: str, fields: dict[str, Any], max_tokens: int):
    """The victim's latency while an aggressor with ``fields`` streams; the aggressor is hung up on after."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **fields}
    async with session.post(f"{url}/v1/completions", json=body) as aggressor:
        if aggressor.status != 200:
            raise RuntimeError(f"the aggressor was refused: HTTP {aggressor.status}: {await aggressor.text()}")
        await aggressor.content.readany()  # its first token: it runs
        await asyncio.sleep(AGGRESSOR_LEAD_S)
        latency_s = await victim_latency_s(session, url, model)
        if aggressor.content.at_eof():
            raise RuntimeError("the aggressor ended before the victim: raise --aggressor-tokens")
        aggressor.close()
    await asyncio.sleep(0.5)  # its sequences aborted, the engine idle again
    return latency_s


async def measure(url: str, model: str, repeats: int, max_tokens: int) -> tuple[float, dict[str, float]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(3):  # warm-up
            await victim_latency_s(session, url, model)
        alone = statistics.median([await victim_latency_s(session, url, model) for _ in range(repeats)])
        cases = {}
        for name, fields in aggressors().items():
            tries = [await beside(session, url, model, fields, max_tokens) for _ in range(repeats)]
            cases[name] = statistics.median(tries)
    return alone, cases


def run_bench_neighbours(args: argparse.Namespace) -> BenchReport:
    serve_args = ["--model", args.model, "--ttft-slo", "off"]
    with kvstorm_server([*serve_args, *shlex.split(args.server_args)]) as kvstorm:
        alone, cases = asyncio.run(measure(kvstorm.url, args.model, args.repeats, args.aggressor_tokens))
    rows = [f"| {name} | {latency * 1e3:.0f} | {latency / alone:.2f}x |" for name, latency in cases.items()]
    over = [name for name, latency in cases.items() if latency / alone > TARGET_RATIO and "for scale" not in name]
    markdown = "\n".join(
        [
            f"A {VICTIM_TOKENS}-token greedy completion alone: **{alone * 1e3:.0f} ms** (median of {args.repeats}); "
            f"beside the worst request each cap allows (streaming {args.aggressor_tokens} tokens, started "
            f"{AGGRESSOR_LEAD_S:g} s before it). Target: at most {TARGET_RATIO}x.",
            "",
            "| beside | latency (ms) | ratio |",
            "|---|---|---|",
            *rows,
            "",
            "Over the target: " + (", ".join(over) if over else "none"),
            "",
            NOTE_ON_N,
        ]
    )
    return BenchReport(markdown, data={"alone_s": alone, "beside_s": cases})
