"""A hostile client beside the real load: the ways a client can try to hurt a server and its other clients.

One round, for a stated time, against any OpenAI-compatible server:

- **idle sockets**: connections that send nothing, held open (a server that counts them against its connection cap
  locks everyone else out);
- **slow headers**: a request's head sent a byte a second (slowloris);
- **resets**: real requests (streamed or not, ``n`` 1 or 2, both routes), each reset (RST) 0-15 ms after it was
  sent, while the server is submitting it (a server that loses track of them decodes for no one);
- **bad input**: bodies that are not JSON or not UTF-8, fields named with line breaks, ``n`` past any cap, a
  non-UTF-8 ``Authorization``; each must get a 4xx (or a close), never a 5xx.

What the server answered is counted by kind; a 5xx to a client's fault is the server blaming itself. Whether the
server let go of everything afterwards is for the caller to check (its queues and KV blocks, from ``/metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field

NUM_IDLE_SOCKETS = 40
NUM_SLOW_SOCKETS = 4
# How long a reset request may be in flight before its reset: within its submission on a CPU server.
MAX_RESET_DELAY_S = 0.015
# Bad inputs and resets per second of a round.
ATTEMPTS_PER_S = 4


@dataclass
class HostileReport:
    """What one round did: attempts by kind, and the status lines (or ``closed``) the server answered with."""

    attempts: Counter = field(default_factory=Counter)
    answers: Counter = field(default_factory=Counter)

    @property
    def num_server_errors(self) -> int:
        """Answers of 500 and above to a client's fault."""
        return sum(count for answer, count in self.answers.items() if answer.isdigit() and int(answer) >= 500)

    def to_json(self) -> dict[str, dict[str, int]]:
        return {"attempts": dict(self.attempts), "answers": dict(self.answers)}


def _head(method: str, path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1") + body


def bad_inputs(model: str) -> dict[str, bytes]:
    """Each kind of bad input, as the bytes of a whole request."""
    completion = {"model": model, "prompt": "hello", "max_tokens": 4}
    return {
        "not_json": _head("POST", "/v1/completions", b"{not json"),
        "not_utf8": _head("POST", "/v1/completions", b'{"model": "\xff\xfe", "prompt": "x"}'),
        "field_with_line_break": _head("POST", "/v1/completions", json.dumps({**completion, "a\r\nb": 1}).encode()),
        "not_utf8_authorization": _head("GET", "/admin/faults", b"", "Authorization: Bearer \xff\xfe\r\n"),
        "n_past_any_cap": _head("POST", "/v1/completions", json.dumps({**completion, "n": 100_000}).encode()),
    }


def _resettable_request(model: str, rng: random.Random) -> bytes:
    common = {"model": model, "max_tokens": 64, "n": rng.choice([1, 2]), "stream": rng.choice([False, True])}
    if rng.random() < 0.5:
        return _head(
            "POST", "/v1/completions", json.dumps({**common, "prompt": f"Story {rng.randrange(10**6)}"}).encode()
        )
    messages = [{"role": "user", "content": f"Tell me story {rng.randrange(10**6)}."}]
    return _head("POST", "/v1/chat/completions", json.dumps({**common, "messages": messages}).encode())


async def hostile_round(host: str, port: int, model: str, duration_s: float, seed: int = 0) -> HostileReport:
    """Every kind of hostility above, for ``duration_s``; the idle and slow sockets are closed at its end."""
    rng = random.Random(seed)
    report = HostileReport()
    deadline = time.monotonic() + duration_s
    holders = [asyncio.create_task(_idle(host, port, deadline, report)) for _ in range(NUM_IDLE_SOCKETS)]
    holders += [asyncio.create_task(_slow_headers(host, port, deadline, report)) for _ in range(NUM_SLOW_SOCKETS)]
    inputs = bad_inputs(model)
    try:
        while time.monotonic() < deadline:
            if rng.random() < 0.5:
                await _reset_after_sending(host, port, _resettable_request(model, rng), rng, report)
            else:
                kind = rng.choice(sorted(inputs))
                report.attempts[kind] += 1
                report.answers[await _answer(host, port, inputs[kind])] += 1
            await asyncio.sleep(rng.expovariate(ATTEMPTS_PER_S))
    finally:
        await asyncio.gather(*holders, return_exceptions=True)
    return report


async def _idle(host: str, port: int, deadline: float, report: HostileReport) -> None:
    report.attempts["idle_socket"] += 1
    with contextlib.suppress(OSError):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            closed = await asyncio.wait_for(reader.read(1), max(0.0, deadline - time.monotonic()))
            report.answers["idle socket closed by the server" if not closed else "idle socket sent bytes"] += 1
        except asyncio.TimeoutError:
            report.answers["idle socket held to the end"] += 1
        finally:
            writer.transport.abort()


async def _slow_headers(host: str, port: int, deadline: float, report: HostileReport) -> None:
    report.attempts["slow_headers"] += 1
    head = _head("POST", "/v1/completions", b"{}")
    with contextlib.suppress(OSError):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for byte in head:
                if time.monotonic() > deadline or reader.at_eof():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
            report.answers["slow headers closed by the server" if reader.at_eof() else "slow headers held"] += 1
        finally:
            writer.transport.abort()


async def _reset_after_sending(host: str, port: int, request: bytes, rng: random.Random, report: HostileReport) -> None:
    """Send ``request``, wait 0-15 ms, then reset the connection (an RST, as a crashed client's kernel sends)."""
    report.attempts["reset"] += 1
    with contextlib.suppress(OSError):
        _, writer = await asyncio.open_connection(host, port)
        writer.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.0, MAX_RESET_DELAY_S))
        writer.transport.abort()


async def _answer(host: str, port: int, request: bytes, timeout_s: float = 10.0) -> str:
    """The status line the server answered ``request`` with (``HTTP/1.1 400 Bad Request`` -> ``400``), or how it
    did not answer."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as error:
        return f"no connection: {error.strerror}"
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return "no answer"
    finally:
        writer.transport.abort()
    parts = line.decode("latin-1").split()
    return parts[1] if len(parts) >= 2 and parts[1].isdigit() else "closed"
