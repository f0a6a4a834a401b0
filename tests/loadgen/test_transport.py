"""The load client's HTTP transport (loadgen.http_stream) against real servers on loopback ports: kept-alive
connections are reused, and one the server closed while idle costs no request; a response delimited by the close of
its connection, a path prefix and https work; a refused connection and a malformed answer are clean rejections; a
header with a line break never reaches the wire; and a run with every fault outcome leaves no reference cycles for
the collector the runner pauses.

The aiohttp servers here run in the test's own event loop: these tests are about what arrives, not when."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import ssl
from collections import Counter

import pytest
import trustme
from aiohttp import web

from loadgen.client import StreamingClient
from loadgen.plan import plan_run
from loadgen.records import Outcome
from loadgen.results import RunConfig
from loadgen.runner import run_event_loop
from loadgen.scripted_server import EXPECTED_OUTCOME
from loadgen.workloads import PlannedRequest
from tests.loadgen.conftest import scripted_server

SSE_BODY = (
    b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
    b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n\n'
    b"data: [DONE]\n\n"
)


def _planned(path: str = "/v1/completions") -> PlannedRequest:
    return PlannedRequest(index=0, offset_s=0.0, path=path, body={"prompt": "x"}, max_tokens=2)


async def _send(base_url: str, *, path: str = "/v1/completions", **client_options) -> list:
    """Three requests, one after the other, through one client."""
    options = {"request_timeout_s": 5, "stall_timeout_s": 5, "exact_output": False, **client_options}
    async with StreamingClient(base_url, "m", **options) as client:
        return [await client.send(_planned(path), request_id=f"r{i}", run_start_ts=0.0) for i in range(3)]


class _SseApp:
    """An aiohttp server that streams SSE_BODY and remembers each request's path and client port."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen.append((request.path, request.transport.get_extra_info("peername")[1]))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE_BODY)
        await response.write_eof()
        return response

    @contextlib.asynccontextmanager
    async def serving(self, ssl_context: ssl.SSLContext | None = None, keepalive_timeout_s: float = 75):
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.stream)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        try:
            yield runner.addresses[0][1]
        finally:
            await runner.cleanup()


def _assert_ok(records: list) -> None:
    assert [(r.outcome, r.delivered_tokens, r.finish_reason) for r in records] == [(Outcome.OK, 2, "length")] * 3


def test_one_kept_alive_connection_serves_requests_in_turn():
    sse = _SseApp()

    async def scenario():
        async with sse.serving() as port:
            return await _send(f"http://127.0.0.1:{port}")

    _assert_ok(run_event_loop(scenario()))
    assert len({port for _, port in sse.seen}) == 1


def test_a_connection_the_server_closed_while_idle_is_not_used_again():
    sse = _SseApp()

    async def scenario():
        async with (
            sse.serving(keepalive_timeout_s=0.1) as port,
            StreamingClient(f"http://127.0.0.1:{port}", "m", request_timeout_s=5, stall_timeout_s=5) as client,
        ):
            first = await client.send(_planned(), request_id="r0", run_start_ts=0.0)
            await asyncio.sleep(0.5)  # the server closes the idle connection; the client has not used it since
            second = await client.send(_planned(), request_id="r1", run_start_ts=0.0)
        return [first, second]

    records = run_event_loop(scenario())
    assert [r.outcome for r in records] == [Outcome.OK, Outcome.OK]
    assert len({port for _, port in sse.seen}) == 2


def test_a_request_that_meets_a_kept_alive_connection_closing_goes_out_again_on_a_new_one():
    # The race a keep-alive timeout makes (uvicorn closes idle connections after 5 s): the request is written to a
    # connection the server is closing, which answers nothing. This server closes every connection at its second
    # request, unanswered; each request must still end ok, sent again on a new connection.
    heads_per_connection = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads_per_connection.append(0)
        while True:
            await reader.readuntil(b"\r\n\r\n")
            heads_per_connection[-1] += 1
            if heads_per_connection[-1] == 2:
                writer.close()
                return
            head = f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {len(SSE_BODY)}\r\n\r\n"
            writer.write(head.encode() + SSE_BODY)

    async def scenario():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            return await _send(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")

    _assert_ok(run_event_loop(scenario()))
    assert heads_per_connection == [2, 2, 1]


def test_a_base_url_path_prefixes_every_request():
    sse = _SseApp()

    async def scenario():
        async with sse.serving() as port:
            return await _send(f"http://127.0.0.1:{port}/proxy/tenant-a/")

    _assert_ok(run_event_loop(scenario()))
    assert {path for path, _ in sse.seen} == {"/proxy/tenant-a/v1/completions"}


def test_https_with_the_servers_certificate_checked(tmp_path, monkeypatch):
    authority = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server_context)
    sse = _SseApp()

    async def scenario():
        async with sse.serving(ssl_context=server_context) as port:
            return await _send(f"https://127.0.0.1:{port}")

    # Not trusted yet: the handshake fails and every request is a clean rejection naming why.
    untrusted = run_event_loop(scenario())
    assert {r.outcome for r in untrusted} == {Outcome.REJECTED}
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted[0].error
    authority_file = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(authority_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(authority_file))  # what ssl.create_default_context trusts
    _assert_ok(run_event_loop(scenario()))


@contextlib.asynccontextmanager
async def _raw_server(answer: bytes):
    """A TCP server that reads one request's head, writes ``answer`` and closes the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def _through_raw_server(answer: bytes) -> list:
    async def scenario():
        async with _raw_server(answer) as port:
            return await _send(f"http://127.0.0.1:{port}")

    return run_event_loop(scenario())


def test_a_stream_that_ends_with_its_connection_is_read_to_its_end():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    _assert_ok(_through_raw_server(head + SSE_BODY))


def test_a_stream_cut_before_its_last_chunk_is_broken():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    records = _through_raw_server(head + b"%x\r\n%b\r\n" % (len(SSE_BODY), SSE_BODY))  # no closing chunk
    assert {r.outcome for r in records} == {Outcome.BROKEN_STREAM}
    assert "the connection closed in the middle of the response" in records[0].error


def test_a_malformed_answer_is_a_rejection_that_says_so():
    records = _through_raw_server(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
    assert {r.outcome for r in records} == {Outcome.REJECTED}
    assert "malformed HTTP response" in records[0].error


def test_a_refused_connection_is_a_rejection_that_says_so():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections to it are refused
        records = run_event_loop(_send(f"http://127.0.0.1:{port}"))
    assert {r.outcome for r in records} == {Outcome.REJECTED}
    assert f"cannot connect to 127.0.0.1:{port}" in records[0].error


def test_an_error_status_keeps_the_start_of_its_body():
    records = _through_raw_server(
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
        + b'{"error": {"message": "prompt too long"}}'[:40]
    )
    assert {(r.outcome, r.http_status) for r in records} == {(Outcome.REJECTED, 400)}
    assert records[0].error.startswith('HTTP 400: {"error": {"message": "prompt too long"}')


def test_a_run_with_every_outcome_leaves_no_reference_cycles():
    # The runner pauses the cycle collector while it streams (loadgen.runner.cycle_collector_paused): what a request
    # makes, whatever its outcome, must go by reference counts alone, or a long run would keep it all until the end.
    server_args = ("--fault-plan", "mixed", "--ttft-ms", "50", "--gap-ms", "10", "--stall-ms", "300")
    with scripted_server(*server_args, "--long-stall-ms", "1500", "--silence-ms", "2500") as server:
        config = RunConfig(
            base_url=server.base_url,
            model="m",
            arrival="poisson:rate=60",
            workload="random",
            input_len="fixed:8",
            output_len="fixed:20",
            num_requests=120,  # past every fault slot of the mixed plan (the last is request 67)
            duration_s=None,
            max_concurrency=None,
            request_timeout_s=2,
            stall_timeout_s=1,
            exact_output=True,
            seed=5,
            slo=None,
        )
        plan = plan_run(config)

        async def run():
            async with StreamingClient.for_run(config) as client:
                return (await plan.run(client, None))[0]

        gc.collect()
        gc.disable()  # so that no automatic collection takes the cycles away before the count
        try:
            records = run_event_loop(run())
            assert gc.collect() == 0, "the run left reference cycles"
        finally:
            gc.enable()
        log = server.script_log()
    assert Counter(r.outcome for r in records) == Counter(EXPECTED_OUTCOME[log[r.request_id]["fault"]] for r in records)
    assert {log[r.request_id]["fault"] for r in records} >= {"stall_broken", "client_timeout", "break", "status_429"}


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent():
    async def scenario():
        async with StreamingClient(
            "http://127.0.0.1:9", "m", request_timeout_s=5, stall_timeout_s=5, api_key="k\r\nX-Admin: 1"
        ):
            pass

    with pytest.raises(ValueError, match="line break"):
        run_event_loop(scenario())
