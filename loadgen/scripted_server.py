"""A fake OpenAI-compatible server whose streams follow a script with known timing (the yardstick of the client).

Each request gets a script from its arrival order at the server: first token ``ttft_ms`` after the request arrived
(when its first bytes were read, or its connection accepted; not when aiohttp got round to the handler), plus
``order * slowdown_ms`` for servers that get slower and slower, then one token every ``gap_ms``. Sleeps aim at
absolute times, so lateness never accumulates, and the server stamps every token with ``time.perf_counter()``
right after handing it to the socket, on the same clock as the client: ``GET /script-log`` returns those stamps,
so a test can compare what the client measured with what the server really did, not only with what it meant to do.
The log also says what each request asked: its prompt length in the server's stand-in for tokens (token ids of a
token-id prompt, words of a text prompt or of every chat message), which its usage reports as ``prompt_tokens``,
and the first ``PROMPT_HEAD_LEN`` of them.

With ``--fault-plan mixed`` the order also picks a fault (``FAULT_SLOTS``), each with the outcome the client must
report (``EXPECTED_OUTCOME``). Run it in its own process (``python -m loadgen.scripted_server --port 0``; it
prints ``listening on HOST:PORT``) so the client under test does not share its event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import orjson
from aiohttp import web

from loadgen.records import Outcome
from loadgen.runner import run_event_loop

# order % 100 -> fault; every tenth request (order % 10 == 9) is answered 429 before these apply.
FAULT_SLOTS = {
    3: "stall_ok",  # one stall of stall_ms before token 10: a long gap, still a clean stream
    7: "break",  # the connection is cut after token 7
    13: "stall_broken",  # a stall of long_stall_ms (longer than the client's stall timeout) before token 5
    21: "no_done",  # finish reason sent, then a clean end of stream without [DONE]
    33: "no_finish_reason",  # [DONE] without any finish reason
    41: "usage_mismatch",  # usage.completion_tokens is one less than the token chunks sent
    47: "chunk_after_finish",  # the last token chunk sent twice, after the finish reason
    55: "client_timeout",  # headers, then silence for silence_ms (longer than the client's request timeout)
    61: "status_503",  # 503 before the stream
    67: "keepalive",  # keep-alive comments and CRLF line endings: still a clean stream
}
EXPECTED_OUTCOME = {
    "normal": Outcome.OK,
    "stall_ok": Outcome.OK,
    "keepalive": Outcome.OK,
    "status_429": Outcome.REJECTED,
    "status_503": Outcome.REJECTED,
    "break": Outcome.BROKEN_STREAM,
    "stall_broken": Outcome.BROKEN_STREAM,
    "no_done": Outcome.BROKEN_STREAM,
    "no_finish_reason": Outcome.BROKEN_STREAM,
    "usage_mismatch": Outcome.BROKEN_STREAM,
    "chunk_after_finish": Outcome.BROKEN_STREAM,
    "client_timeout": Outcome.CLIENT_TIMEOUT,
}
STALL_BEFORE_TOKEN = {"stall_ok": 10, "stall_broken": 5}
BREAK_AFTER_TOKENS = 7
PROMPT_HEAD_LEN = 64


@dataclass(frozen=True)
class ServerScript:
    ttft_ms: float = 150.0
    gap_ms: float = 20.0
    slowdown_ms: float = 0.0
    stall_ms: float = 400.0
    long_stall_ms: float = 1500.0
    silence_ms: float = 3000.0
    fault_plan: str = "none"

    def fault_for(self, order: int) -> str:
        if self.fault_plan == "none":
            return "normal"
        if order % 10 == 9:
            return "status_429"
        return FAULT_SLOTS.get(order % 100, "normal")


@dataclass
class StreamLog:
    """What the server did for one request; ``token_send_ts`` are perf_counter stamps after each token's write."""

    order: int
    request_id: str
    fault: str
    received_ts: float
    num_tokens: int
    ttft_s: float
    gap_s: float
    stall_before_token: int | None
    stall_s: float
    prompt_tokens: int
    prompt_head: list[str]
    token_send_ts: list[float] = field(default_factory=list)


class ScriptedServer:
    def __init__(self, script: ServerScript) -> None:
        self.script = script
        self.logs: list[StreamLog] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.stream)
        app.router.add_post("/v1/chat/completions", self.stream)
        app.router.add_get("/script-log", self.script_log)
        return app

    async def script_log(self, request: web.Request) -> web.Response:
        _arrival_ts(request)  # taken, so that it cannot pass for the next request's on a kept-alive connection
        return web.json_response([asdict(log) for log in self.logs])

    async def stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received_ts = _arrival_ts(request)
        order = len(self.logs)
        fault = self.script.fault_for(order)
        prompt = _prompt_tokens(body)
        stall_before = STALL_BEFORE_TOKEN.get(fault)
        log = StreamLog(
            order=order,
            request_id=request.headers.get("X-Request-Id", ""),
            fault=fault,
            received_ts=received_ts,
            num_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 16),
            ttft_s=(self.script.ttft_ms + order * self.script.slowdown_ms) / 1e3,
            gap_s=self.script.gap_ms / 1e3,
            stall_before_token=stall_before,
            stall_s=(self.script.long_stall_ms if fault == "stall_broken" else self.script.stall_ms) / 1e3,
            prompt_tokens=len(prompt),
            prompt_head=prompt[:PROMPT_HEAD_LEN],
        )
        self.logs.append(log)
        if fault.startswith("status_"):
            status = int(fault.removeprefix("status_"))
            return web.json_response({"error": {"message": f"scripted {status}", "code": status}}, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        response.enable_chunked_encoding()  # _TokenPacer writes the chunks itself
        await response.prepare(request)
        chat = request.path.endswith("/chat/completions")
        # The client gives up on some faults (stall, request timeout): writes after that fail, as expected.
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._write_stream(request, response, log, chat)
        return response

    async def _write_stream(
        self, request: web.Request, response: web.StreamResponse, log: StreamLog, chat: bool
    ) -> None:
        newline = "\r\n" if log.fault == "keepalive" else "\n"
        frame = _Framer(log.request_id, chat, newline, log.prompt_tokens)
        if chat:
            await response.write(frame.chunk({"role": "assistant", "content": ""}, None))
        if log.fault == "client_timeout":
            await asyncio.sleep(self.script.silence_ms / 1e3)
        if not await _TokenPacer(request.transport, log, frame).paced():
            return
        if log.fault == "chunk_after_finish":
            await response.write(frame.token(log.num_tokens - 1, None))
        usage_tokens = log.num_tokens - (log.fault == "usage_mismatch")
        tail = frame.usage(usage_tokens) + (b"" if log.fault == "no_done" else frame.done())
        await response.write(tail)
        await response.write_eof()


class _TokenPacer:
    """Writes a stream's tokens at their scripted instants from timer callbacks, straight to the transport as HTTP
    chunks (the response is chunked: aiohttp wrote the headers and writes the closing chunk). A coroutine that
    slept and wrote through aiohttp cost about 20 µs of server CPU per token, and at a thousand streams the yardstick,
    not the client under test, set the limit (``kvstorm bench client-capacity``)."""

    def __init__(self, transport: asyncio.Transport | None, log: StreamLog, frame: _Framer) -> None:
        self._transport, self._log, self._frame = transport, log, frame
        self._keepalive = f": keepalive{frame.newline}{frame.newline}".encode() if log.fault == "keepalive" else b""
        self._loop = asyncio.get_running_loop()
        self._position = 0
        self._done = self._loop.create_future()

    async def paced(self) -> bool:
        """Whether every token went out (not: a scripted break, or the client left)."""
        self._tick()
        return await self._done

    def _target_ts(self, position: int) -> float:
        log = self._log
        target_ts = log.received_ts + log.ttft_s + position * log.gap_s
        if log.stall_before_token is not None and position >= log.stall_before_token:
            target_ts += log.stall_s
        return target_ts

    def _tick(self) -> None:
        log = self._log
        while self._position < log.num_tokens:
            # Timers fire in whole milliseconds, up to one late: aiming half a millisecond early centres the error.
            delay_s = self._target_ts(self._position) - _WAIT_ROUNDING_S - time.perf_counter()
            if delay_s > 0:
                self._loop.call_at(self._loop.time() + delay_s, self._tick)
                return
            if self._transport is None or self._transport.is_closing():  # the client gave up (a stall, a timeout)
                self._finish(False)
                return
            if log.fault == "break" and self._position == BREAK_AFTER_TOKENS:
                self._transport.close()
                self._finish(False)
                return
            finish = "length" if self._position == log.num_tokens - 1 and log.fault != "no_finish_reason" else None
            data = self._keepalive + self._frame.token(self._position, finish)
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            log.token_send_ts.append(time.perf_counter())
            self._position += 1
        self._finish(True)

    def _finish(self, all_sent: bool) -> None:
        if not self._done.done():  # its handler may have been cancelled
            self._done.set_result(all_sent)


def _prompt_tokens(body: dict) -> list[str]:
    """The prompt as this server counts it, without a tokenizer: the ids of a token-id prompt, else words."""
    if "messages" in body:
        return [word for message in body["messages"] for word in str(message.get("content") or "").split()]
    prompt = body.get("prompt", "")
    return [str(token_id) for token_id in prompt] if isinstance(prompt, list) else str(prompt).split()


class _Framer:
    """SSE bytes in the OpenAI shapes (completions or chat chunks)."""

    def __init__(self, request_id: str, chat: bool, newline: str, prompt_tokens: int) -> None:
        self.request_id, self.chat, self.newline, self.prompt_tokens = request_id, chat, newline, prompt_tokens
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, payload: dict) -> bytes:
        return b"data: %b%b" % (orjson.dumps(payload), self.newline.encode() * 2)

    def chunk(self, delta: dict, finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta} if self.chat else {"index": 0, "text": delta["content"]}
        choice["finish_reason"] = finish
        return self._event({"id": self.request_id, "object": self.object, "choices": [choice]})

    def token(self, position: int, finish: str | None) -> bytes:
        return self.chunk({"content": f" t{position}"}, finish)

    def usage(self, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }
        return self._event({"id": self.request_id, "object": self.object, "choices": [], "usage": usage})

    def done(self) -> bytes:
        return f"data: [DONE]{self.newline}{self.newline}".encode()


# The event loop rounds every wait up to a whole millisecond (epoll's unit), so a wake lands up to 1 ms after its
# target; aiming half a millisecond early centres that error on the target instead.
_WAIT_ROUNDING_S = 0.5e-3


def prioritize_timing(cpu: int | None = None) -> None:
    """For a timing-critical process on a shared machine: real-time priority (SCHED_FIFO 1) where allowed, else
    nice -10 where allowed, else nothing; optionally pinned to one CPU. Meant as a ``preexec_fn`` of a child started
    with ``start_new_session=True`` (the kernel shares CPU time per session, so nice alone does not reach across).
    Such a child sleeps most of the time and the kernel caps real-time tasks at 95% of a CPU: nothing starves."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):  # AttributeError: not Linux
        with contextlib.suppress(OSError):
            os.nice(-10)


class ServerProcess:
    """A scripted server in its own process (see :func:`scripted_server_process`)."""

    def __init__(self, process: subprocess.Popen, base_url: str) -> None:
        self.process, self.base_url = process, base_url

    def script_log(self) -> dict[str, dict]:
        """What the server did for every request so far, by X-Request-Id (see :class:`StreamLog`)."""
        with urllib.request.urlopen(self.base_url + "/script-log", timeout=60) as response:
            return {entry["request_id"]: entry for entry in json.load(response)}


def scripted_server_process(
    *args: str, cpu: int | None = None, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[ServerProcess]:
    """``python -m loadgen.scripted_server ARGS`` on a free loopback port, at timing priority, stopped on exit."""
    return server_process("loadgen.scripted_server", *args, cpu=cpu, env=env)


@contextlib.contextmanager
def server_process(
    module: str, *args: str, cpu: int | None = None, env: dict[str, str] | None = None, timing_priority: bool = True
) -> Iterator[ServerProcess]:
    """``python -m MODULE --port 0 ARGS``, a server that prints ``listening on HOST:PORT`` once it listens, stopped on
    exit; at timing priority unless ``timing_priority`` is false (an adversary, which must not outrun its client)."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=functools.partial(prioritize_timing, cpu) if timing_priority else None,
        start_new_session=True,
        env=env,
    )
    try:
        line = process.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"{module} did not start: {line!r}")
        yield ServerProcess(process, "http://" + line.removeprefix("listening on ").strip())
    finally:
        process.terminate()
        process.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    defaults = ServerScript()
    for name in ("ttft_ms", "gap_ms", "slowdown_ms", "stall_ms", "long_stall_ms", "silence_ms"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--fault-plan", choices=["none", "mixed"], default=defaults.fault_plan)
    args = parser.parse_args(argv)
    script = ServerScript(**{name: getattr(args, name) for name in ServerScript.__dataclass_fields__})
    run_event_loop(_serve(ScriptedServer(script), args.host, args.port))


class _ArrivalStamping(asyncio.Protocol):
    """aiohttp's connection protocol, wrapped to stamp when each request's first bytes arrive (the connection's
    accept for its first request). The handler runs only after a trip through the event loop: under load that trip
    alone is milliseconds, which a script anchored at the handler would add to every TTFT it claims."""

    def __init__(self, inner: asyncio.Protocol) -> None:
        self._inner = inner
        self._arrival_ts: float | None = None

    def take_arrival_ts(self) -> float | None:
        arrival_ts, self._arrival_ts = self._arrival_ts, None
        return arrival_ts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._arrival_ts = time.perf_counter()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._arrival_ts is None:
            self._arrival_ts = time.perf_counter()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def _arrival_ts(request: web.Request) -> float:
    """When the request's first bytes arrived. Each handler takes it once the request is read whole, so bytes that
    arrive later belong to the next request on the connection (pipelined requests, which share a read, get now)."""
    arrival_ts = request.transport.get_protocol().take_arrival_ts()
    return arrival_ts if arrival_ts is not None else time.perf_counter()


async def _serve(server: ScriptedServer, host: str, port: int) -> None:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    listener = await asyncio.get_running_loop().create_server(lambda: _ArrivalStamping(runner.server()), host, port)
    bound_port = listener.sockets[0].getsockname()[1]
    # A yardstick must not pause: no garbage-collector sweeps during a (bounded) run.
    gc.collect()
    gc.freeze()
    gc.disable()
    print(f"listening on {host}:{bound_port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
