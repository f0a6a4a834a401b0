"""A server that answers like a buggy or hostile OpenAI-compatible server: the load client's adversary in the tests.

A chaos harness is pointed at servers that misbehave, so every byte they send is input. This server writes raw
bytes to the socket (no HTTP library in the way), following a *script* per request: a list of steps, plain JSON so
a test can draw them at random.

- ``["send", TEXT]``: write TEXT (latin-1: any byte) once.
- ``["sleep", MS]``: wait.
- ``["flood", UNIT, SECONDS]``: write UNIT again and again, as fast as the client reads, until the client goes or
  SECONDS passed; ``{i}`` in UNIT is replaced by a counter (ever new header names).
- ``["trickle", UNIT, EVERY_MS, SECONDS]``: write UNIT every EVERY_MS, until the client goes or SECONDS passed.
- ``["stream", TOKENS, GAP_MS]``: a well-behaved completion stream of TOKENS tokens (``-1``: the request's
  max_tokens), a token every GAP_MS, with its finish reason, usage and ``[DONE]``.

After its last step the server closes the connection (every response is close-delimited). :data:`MODES` names the
misbehaviours the client must survive, each with the outcome it must record and words its error must hold; a
script may also be the name of a mode. ``POST /scripts`` with a JSON list sets the scripts (request ``i``, by the
index in its ``X-Request-Id``, gets script ``i`` mod their number), ``GET /served`` says which script each request
got. Run it in its own process: ``python -m loadgen.hostile_server --port 0`` prints ``listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import orjson

from loadgen.records import Outcome
from loadgen.runner import run_event_loop

# The longest an endless step runs whatever the client does: every connection of this server ends.
MAX_STEP_S = 120.0
# A request's head and body, at most (the client under test sends a few KB).
MAX_REQUEST_BYTES = 1 << 20

HEAD_200 = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def _event(payload: object) -> str:
    return f"data: {orjson.dumps(payload).decode()}\n\n"


def _chunk(text: str, finish: object = None) -> str:
    return _event({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def _refusal(retry_after: str) -> list:
    body = '{"error": {"message": "busy", "code": 429}}'
    head = f"HTTP/1.1 429 Too Many Requests\r\nRetry-After: {retry_after}\r\nContent-Length: {len(body)}\r\n"
    return [["send", head + "Connection: close\r\n\r\n" + body]]


@dataclass(frozen=True)
class Mode:
    """One misbehaviour: its script, the outcome the client must record, and words its error must hold."""

    script: list
    outcome: Outcome
    error: str = ""


MODES: dict[str, Mode] = {
    "bad_finish_reason": Mode(
        [["send", HEAD_200 + _chunk("a") + _chunk("b", 1) + "data: [DONE]\n\n"]],
        Outcome.BROKEN_STREAM,
        "protocol error: finish_reason is not a short string: 1",
    ),
    "usage_not_an_object": Mode(
        [["send", HEAD_200 + _chunk("a", "length") + _event({"choices": [], "usage": [1]}) + "data: [DONE]\n\n"]],
        Outcome.BROKEN_STREAM,
        "protocol error: usage is not an object: [1]",
    ),
    "retry_after_superscript": Mode(_refusal("²"), Outcome.REJECTED, "HTTP 429"),
    "retry_after_5000_digits": Mode(_refusal("9" * 5000), Outcome.REJECTED, "HTTP 429"),
    "endless_header_value": Mode(
        [["send", "HTTP/1.1 200 OK\r\nX-Endless: "], ["flood", "v" * 512, MAX_STEP_S]],
        Outcome.REJECTED,
        "more than 65536 bytes with no body data",
    ),
    "endless_header_names": Mode(
        [["send", "HTTP/1.1 200 OK\r\n"], ["flood", "X-Name-{i}: v\r\n", MAX_STEP_S]],
        Outcome.REJECTED,
        "more than 100 header lines",
    ),
    "endless_trailers": Mode(
        [["send", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"], ["flood", "X-T: v\r\n", MAX_STEP_S]],
        Outcome.BROKEN_STREAM,
        "more than 100 header lines",
    ),
    "endless_sse_line": Mode(
        [["send", HEAD_200 + _chunk("a") + "data: "], ["flood", "x" * 4096, MAX_STEP_S]],
        Outcome.BROKEN_STREAM,
        "an SSE line passed 1048576 bytes without ending",
    ),
    "token_flood": Mode(
        [["send", HEAD_200], ["flood", _chunk("t"), MAX_STEP_S]],
        Outcome.BROKEN_STREAM,
        "cut as a flood",
    ),
    "comment_flood": Mode(
        [["send", HEAD_200], ["flood", ": keep-alive\n\n" * 64, MAX_STEP_S]],
        Outcome.BROKEN_STREAM,
        "more than 1114112 bytes in a row with no token",
    ),
    "error_body_flood": Mode(
        [["send", "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\n"], ["flood", "e" * 4096, MAX_STEP_S]],
        Outcome.REJECTED,
        "body passed 65536 bytes and was cut",
    ),
    "slow_header_trickle": Mode(
        [["send", "HTTP/1.1 200 OK\r\n"], ["trickle", "X-Slow: v\r\n", 200, MAX_STEP_S]],
        Outcome.CLIENT_TIMEOUT,
        "within the request timeout",
    ),
    "not_http": Mode([["send", "SSH-2.0-OpenSSH_9.2\r\n\r\n"]], Outcome.REJECTED, "malformed HTTP response"),
    "json_not_an_object": Mode(
        [["send", HEAD_200 + 'data: ["a"]\n\n' + _chunk("b", "stop") + "data: [DONE]\n\n"]],
        Outcome.BROKEN_STREAM,
        "protocol error: event data is not a JSON object",
    ),
    "invalid_utf8_and_nul": Mode(
        [["send", HEAD_200 + 'data: {"choices": [{"text": "\xff\x00", "finish_reason": "stop"}]}\n\n']],
        Outcome.BROKEN_STREAM,
        "event data is not JSON",
    ),
    "cut_mid_event": Mode([["send", HEAD_200 + _chunk("a") + 'data: {"cho']], Outcome.BROKEN_STREAM, "inside an event"),
}


class HostileServer:
    def __init__(self) -> None:
        self.scripts: list = [[["stream", -1, 10]]]
        self.served: list[dict] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            length = int(headers.get("content-length", "0"))
            if len(head) + length > MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            body = await reader.readexactly(length)
            if path == "/scripts" and method == "POST":
                self.scripts = json.loads(body)
                await self._write_json(writer, {"scripts": len(self.scripts)})
            elif path == "/served":
                await self._write_json(writer, self.served)
            else:
                await self._serve(writer, headers.get("x-request-id", ""), json.loads(body or b"{}"))
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.transport.abort()

    async def _write_json(self, writer: asyncio.StreamWriter, payload: object) -> None:
        body = json.dumps(payload).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
        writer.write(b"Connection: close\r\n\r\n" + body)
        await writer.drain()

    async def _serve(self, writer: asyncio.StreamWriter, request_id: str, body: dict) -> None:
        try:
            index = int(request_id[-12:], 16)
        except ValueError:
            index = len(self.served)
        script = self.scripts[index % len(self.scripts)]
        self.served.append({"request_id": request_id, "index": index, "script": script})
        steps = MODES[script].script if isinstance(script, str) else script
        for step in steps:
            await _STEPS[step[0]](writer, body, *step[1:])


async def _send(writer: asyncio.StreamWriter, _body: dict, text: str) -> None:
    writer.write(text.encode("latin-1"))
    await writer.drain()


async def _sleep(_writer: asyncio.StreamWriter, _body: dict, ms: float) -> None:
    await asyncio.sleep(ms / 1e3)


async def _flood(writer: asyncio.StreamWriter, _body: dict, unit: str, seconds: float) -> None:
    await _repeat(writer, unit, 0.0, seconds)


async def _trickle(writer: asyncio.StreamWriter, _body: dict, unit: str, every_ms: float, seconds: float) -> None:
    await _repeat(writer, unit, every_ms / 1e3, seconds)


async def _repeat(writer: asyncio.StreamWriter, unit: str, every_s: float, seconds: float) -> None:
    end_ts = time.monotonic() + min(seconds, MAX_STEP_S)
    counter = 0
    while time.monotonic() < end_ts and not writer.is_closing():
        # A batch per drain: the client reads at its own pace, and a slow one is not flooded past its socket.
        for _ in range(1 if every_s else 64):
            writer.write(unit.replace("{i}", str(counter)).encode("latin-1"))
            counter += 1
        await writer.drain()
        if every_s:
            await asyncio.sleep(every_s)


async def _stream(writer: asyncio.StreamWriter, body: dict, tokens: int, gap_ms: float) -> None:
    num_tokens = int(body.get("max_tokens") or 16) if tokens < 0 else tokens
    await _send(writer, body, HEAD_200)
    for position in range(num_tokens):
        await asyncio.sleep(gap_ms / 1e3)
        await _send(writer, body, _chunk(f" t{position}", "length" if position == num_tokens - 1 else None))
    usage = {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": 1 + num_tokens}
    await _send(writer, body, _event({"choices": [], "usage": usage}) + "data: [DONE]\n\n")


_STEPS = {"send": _send, "sleep": _sleep, "flood": _flood, "trickle": _trickle, "stream": _stream}


async def _serve_forever(host: str, port: int) -> None:
    server = HostileServer()
    listener = await asyncio.start_server(server.handle, host, port, limit=MAX_REQUEST_BYTES)
    print(f"listening on {host}:{listener.sockets[0].getsockname()[1]}", flush=True)
    async with listener:
        await listener.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run_event_loop(_serve_forever(args.host, args.port))


if __name__ == "__main__":
    main()
