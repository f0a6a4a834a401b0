"""The server's side of the run from a Prometheus server: KV usage, running / waiting / swapped requests, the preemption
rate and the prefix cache's hit rate, over the run's wall-clock window. vLLM's metric names, which kvstorm exports
too."""

from __future__ import annotations

import asyncio

import aiohttp

from loadgen.results import PromSeries

QUERIES = {
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; either answers.
    "KV cache usage": "avg(vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc)",
    "running": "sum(vllm:num_requests_running)",
    "waiting": "sum(vllm:num_requests_waiting)",
    "swapped": "sum(vllm:num_requests_swapped)",
    "preemptions/s": "sum(rate(vllm:num_preemptions_total[30s]))",
    # Of the prompt tokens looked up at admission, the share found cached (no data while no prompt arrives).
    "prefix cache hit rate": (
        "sum(rate(vllm:prefix_cache_hits_total[30s])) / sum(rate(vllm:prefix_cache_queries_total[30s]))"
    ),
}


async def fetch_series(
    prometheus_url: str, start_unix: float, end_unix: float, step_s: float = 1.0
) -> tuple[list[PromSeries], list[str]]:
    """Every query of ``QUERIES`` as a range query; returns the series and one note per query that gave nothing."""
    series, notes = [], []
    url = prometheus_url.rstrip("/") + "/api/v1/query_range"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for name, query in QUERIES.items():
            params = {"query": query, "start": f"{start_unix:.3f}", "end": f"{end_unix:.3f}", "step": f"{step_s:g}"}
            try:
                async with session.get(url, params=params) as response:
                    payload = await response.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
                notes.append(f"Prometheus query {query!r} failed: {error}")
                continue
            results = (payload.get("data") or {}).get("result") or []
            if payload.get("status") != "success" or not results:
                notes.append(f"Prometheus query {query!r} returned no data ({payload.get('error', 'empty')})")
                continue
            points = [(float(ts), float(value)) for ts, value in results[0]["values"]]
            series.append(PromSeries(name=name, query=query, points=points))
    return series, notes
