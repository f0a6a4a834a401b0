"""The aiohttp app: OpenAI completions and chat (JSON or SSE), health, readiness, metrics, admin.

Every refusal (bad input 400, unknown model 404, body too large 413, overload 429,
engine down 503) happens before a stream starts, as OpenAI's error JSON. A stream
that has started always ends with a finish reason (``stop``, ``length``, ``abort``)
or an ``error`` event, and then ``data: [DONE]``.

A client that goes away cancels its handler (the runner must be built with
``handler_cancellation=True``); the handler's ``finally`` aborts its requests, and
their blocks are free after the engine's next loop iteration. Its reach covers the
submission: prompts are tokenized on a thread pool (the event loop keeps answering
meanwhile), then every sequence of a request is admitted and queued in one step that
does not await, so no cancellation can fall between queueing a sequence and holding it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from aiohttp import web

from engine.core.admission import AdmissionRefused
from engine.core.interface import InvalidRequest, PromptTooLong
from engine.core.outputs import PreparedRequest, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.serving.admin import add_admin_routes
from engine.serving.async_engine import AsyncEngine, EngineFailure, RequestStream
from engine.serving.connections import DRAINING, LIFECYCLE, Lifecycle, PeerConnections, gate_middleware
from engine.serving.protocol import (
    MAX_SEED,
    ROUTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    HealthResponse,
    ModelCard,
    ModelList,
    ReadyResponse,
    Usage,
    openapi_document,
    route_definitions,
)
from engine.serving.request_body import ignored_header, read_body
from engine.serving.streaming import (
    ChoiceAssembler,
    final_response,
    role_chunk,
    token_chunk,
    usage_chunk,
    usage_of,
)

logger = logging.getLogger(__name__)
ASYNC_ENGINE = web.AppKey("async_engine", AsyncEngine)
SERVER_CONFIG = web.AppKey("server_config", "ServerConfig")
# Tokenizing and validating prompts runs here, off the event loop: a megabyte of text takes a CPU second.
TOKENIZING = web.AppKey("tokenizing", ThreadPoolExecutor)


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_body_bytes: int = 1 << 20
    stall_timeout_s: float = 30.0
    # /admin/* exists only with a token.
    admin_token: str | None = None
    # POST /admin/exit ends the process, for a supervisor to start it again (kvstorm serve --admin-exit).
    admin_exit: bool = False
    # Refuse unknown request fields (400) instead of ignoring them and naming them in IGNORED_FIELDS_HEADER.
    strict_api: bool = False
    # A stream whose client reads nothing for this long is closed (its requests abort): a write never waits forever.
    write_timeout_s: float = 60.0
    # A connection that completes no request for this long is closed: an idle keep-alive one, or one still sending
    # its headers (aiohttp's default is an hour).
    keepalive_timeout_s: float = 15.0
    # Beyond this many requests in progress a request gets 503 and its connection is closed (probes are still
    # answered); idle connections do not count (engine.serving.connections).
    max_connections: int = 1024
    # Open connections from one address, idle ones included; past it a new one is answered 503 and closed. As many
    # as the engine's default running batch (max_num_seqs); a proxy in front, or a load generator, raises it.
    max_connections_per_peer: int = 256
    # prompts x n of one request, OpenAI's bound on n. Each sequence decodes beside everyone's as a request does, so
    # admission counts each one as a request (its forecast, --max-waiting): a request of many is refused under load.
    max_sequences: int = 128

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        for name in ("write_timeout_s", "keepalive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections", "max_connections_per_peer", "max_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin_token must not be empty")
        if self.admin_exit and self.admin_token is None:
            raise ValueError("admin_exit needs an admin token: /admin/exit is an admin route")


def create_app(async_engine: AsyncEngine, config: ServerConfig) -> web.Application:
    """The app; it starts the engine loop on startup and stops it on shutdown."""
    middlewares = [_error_middleware, gate_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[ASYNC_ENGINE] = async_engine
    app[SERVER_CONFIG] = config
    app[LIFECYCLE] = Lifecycle(config.max_connections)
    app[TOKENIZING] = ThreadPoolExecutor(thread_name_prefix="tokenize")
    document = openapi_document(include_admin=config.admin_token is not None)

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(document)

    handlers = {
        "completions": _completions,
        "chat_completions": _chat_completions,
        "models": _models,
        "health": _health,
        "ready": _ready,
        "metrics": _metrics,
        "openapi": openapi,
    }
    app.add_routes(route_definitions(ROUTES, handlers))
    if config.admin_token is not None:
        add_admin_routes(app, async_engine, config.admin_token, config.admin_exit)

    async def start_engine(app: web.Application) -> None:
        app[ASYNC_ENGINE].start(asyncio.get_running_loop())

    async def stop_engine(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, app[ASYNC_ENGINE].shutdown)

    async def stop_tokenizing(app: web.Application) -> None:
        app[TOKENIZING].shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(start_engine)
    # On shutdown, not cleanup: the server waits for open handlers in between, and streams end only once the
    # engine has ended them.
    app.on_shutdown.append(stop_engine)
    app.on_cleanup.append(stop_tokenizing)
    return app


# ---- errors ---------------------------------------------------------------------------------------


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


_REJECTION_REASONS = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    500: "internal_error",
    503: "engine_unavailable",
}


@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        rejection = error
    except web.HTTPException as error:
        if error.status < 400:
            raise
        error_type = "invalid_request_error" if error.status < 500 else "server_error"
        # Keep what the status needs (Allow on 405), not the body's own content headers.
        headers = {k: v for k, v in error.headers.items() if k.lower() not in ("content-type", "content-length")}
        rejection = ApiError(error.status, error.text or error.reason, error_type=error_type, headers=headers)
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client went before its answer could go out: its doing, not the server's
        request.app[ASYNC_ENGINE].metrics.observe_rejected("client_disconnected")
        return web.Response(status=499, reason="Client Closed Request")  # for the access log: it reaches no one
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        rejection = ApiError(500, "internal server error", error_type="server_error")
    reason = rejection.reason or _REJECTION_REASONS.get(rejection.status, f"http_{rejection.status}")
    request.app[ASYNC_ENGINE].metrics.observe_rejected(reason)
    response = error_response(rejection)
    if rejection.headers.get("Connection") == "close":
        response.force_close()
    return response


# ---- completions ----------------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    arrival_ts = time.monotonic()  # the server's TTFT counts from here, as a client's does: reading and tokenizing too
    body, ignored = await read_body(request, CompletionRequest, request.app[SERVER_CONFIG].strict_api)
    async_engine = _check_model_and_engine(request, body.model)
    try:
        params = body.sampling_params(default_max_tokens=16)
    except ValueError as error:
        raise ApiError(400, str(error)) from None
    prompts = body.prompts()
    _check_num_sequences(request, len(prompts), body.n)
    params_list = _per_choice(params, len(prompts), body.n)
    return await _generate(request, body, "cmpl", prompts, params_list, async_engine, ignored, arrival_ts)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    arrival_ts = time.monotonic()
    body, ignored = await read_body(request, ChatCompletionRequest, request.app[SERVER_CONFIG].strict_api)
    async_engine = _check_model_and_engine(request, body.model)
    if async_engine.engine.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so no chat template; use /v1/completions with token ids")
    _check_num_sequences(request, 1, body.n)
    prompt_ids, params = await _off_loop(request, _chat_prompt, async_engine, body)
    params_list = _per_choice(params, 1, body.n)
    return await _generate(request, body, "chatcmpl", [prompt_ids], params_list, async_engine, ignored, arrival_ts)


def _chat_prompt(async_engine: AsyncEngine, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """Off the event loop: the conversation's token ids, and its sampling parameters (by default the rest of the
    context is the reply's)."""
    max_model_len = async_engine.engine.info.max_model_len
    try:
        messages = [m.template_message() for m in body.messages]
        prompt_ids = async_engine.engine.tokenizer.apply_chat_template(messages, max_num_tokens=max_model_len)
        return prompt_ids, body.sampling_params(max(1, max_model_len - len(prompt_ids)))
    except PromptTooLong as error:
        message = f"the conversation is too long for the model's context of {max_model_len} tokens: {error}"
        raise ApiError(400, message, "messages") from None
    except ValueError as error:
        raise ApiError(400, str(error)) from None


async def _off_loop(request: web.Request, function, *args):
    """``function(*args)`` on a tokenizing thread, so the event loop keeps serving (probes, other streams)."""
    return await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZING], functools.partial(function, *args))


def _check_num_sequences(request: web.Request, num_prompts: int, n: int) -> None:
    """One request's sequences (prompts x n) within ``ServerConfig.max_sequences``, on either route."""
    max_sequences = request.app[SERVER_CONFIG].max_sequences
    if num_prompts * n > max_sequences:
        message = f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences; at most {max_sequences}"
        raise ApiError(400, message + " per request (--max-sequences-per-request)", "n")


def _per_choice(params: SamplingParams, num_prompts: int, n: int) -> list[SamplingParams]:
    """``n`` choices per prompt, in OpenAI's order; a seeded request's choices use seed, seed + 1, ... so each is
    reproducible and they differ."""
    if params.seed is None:
        return [params] * (num_prompts * n)
    return [replace(params, seed=(params.seed + i) % (MAX_SEED + 1)) for _ in range(num_prompts) for i in range(n)]


def _prompt_text(async_engine: AsyncEngine, prompt: str | list[int]) -> str:
    """What ``echo`` repeats: the prompt as text (token ids decoded)."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = async_engine.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, "echo of token ids needs a tokenizer; this model has none", "echo")
    return tokenizer.decode(prompt, skip_special_tokens=False)


def _check_model_and_engine(request: web.Request, model: str) -> AsyncEngine:
    config = request.app[SERVER_CONFIG]
    if model != config.served_model_name:
        raise ApiError(404, f"model '{model}' does not exist; this server serves '{config.served_model_name}'", "model")
    async_engine = request.app[ASYNC_ENGINE]
    problem = _liveness_problem(async_engine, config)
    if problem is not None:
        raise ApiError(503, f"engine unavailable: {problem}", error_type="server_error", headers={"Retry-After": "5"})
    return async_engine


async def _generate(
    request: web.Request,
    body: CompletionRequest | ChatCompletionRequest,
    id_prefix: str,
    prompts: Sequence[str | list[int]],
    params_list: Sequence[SamplingParams],
    async_engine: AsyncEngine,
    ignored: Sequence[str],
    arrival_ts: float,
) -> web.StreamResponse:
    """Each prompt's ``n`` choices (``params_list`` in OpenAI's order), prepared off the event loop, admitted all or
    none, then answered as JSON or SSE. Whatever ends this (the client going away cancels it at any await, the
    submission's included) aborts every sequence it queued that has not finished: none is left decoding for no one."""
    response_id = f"{id_prefix}-{uuid.uuid4().hex[:24]}"
    retry_key = retry_key_of(request.remote, request.headers.get("Authorization"), body.model_dump_json())
    is_chat = isinstance(body, ChatCompletionRequest)
    created = int(time.time())
    model = request.app[SERVER_CONFIG].served_model_name
    streams: list[RequestStream] = []
    try:
        prepared = await _off_loop(request, _prepare_all, async_engine, response_id, prompts, body.n, params_list,
                                   arrival_ts)  # fmt: skip
        streams = _submit_all(async_engine, prepared, retry_key)  # no await between queueing and holding them
        # Decoded only now: the engine checked every token id of the prompts before it took them.
        echo = isinstance(body, CompletionRequest) and body.echo
        echoes = [_prompt_text(async_engine, prompt) if echo else "" for prompt in prompts]
        assemblers = [ChoiceAssembler(async_engine.engine.tokenizer, is_chat, text) for text in echoes
                      for _ in range(body.n)]  # fmt: skip
        if body.stream:
            return await _stream(request, body, response_id, created, model, streams, assemblers, ignored)
        async for index, output in _merge(streams):
            assemblers[index].push(output)
        return web.json_response(
            final_response(body, response_id, created, model, assemblers).model_dump(exclude_none=False),
            headers=ignored_header(ignored),
        )
    except EngineFailure as failure:  # non-streaming: nothing sent yet, so a plain error response
        raise ApiError(500, str(failure), error_type="server_error") from None
    finally:
        for stream in streams:
            if not stream.finished:
                async_engine.abort(stream.request_id)


def retry_key_of(remote: str | None, authorization: str | None, body_json: str) -> str:
    """What admission recognises a retry by: the same body sent again by the same client (its address and its
    credentials), as a client that honours a Retry-After resends it; another client with the same body gets no
    place in line that was promised to the first."""
    identity = json.dumps([remote or "", authorization or "", body_json])
    return hashlib.sha256(identity.encode()).hexdigest()


def _prepare_all(
    async_engine: AsyncEngine,
    response_id: str,
    prompts: Sequence[str | list[int]],
    n: int,
    params_list: Sequence[SamplingParams],
    arrival_ts: float,
) -> list[PreparedRequest]:
    """On a tokenizing thread: each prompt tokenized and validated once, and its ``n`` choices made from it (only
    their ids and seeds differ); a 400 names the prompt at fault."""
    prepared: list[PreparedRequest] = []
    for index, prompt in enumerate(prompts):
        first = index * n
        try:
            one = async_engine.engine.prepare_request(prompt, params_list[first], f"{response_id}-{first}", arrival_ts)
        except InvalidRequest as error:
            raise ApiError(400, f"prompt {index}: {error}" if len(prompts) > 1 else str(error), error.param) from None
        prepared += [replace(one, request_id=f"{response_id}-{i}", sampling_params=params_list[i])
                     for i in range(first, first + n)]  # fmt: skip
    return prepared


def _submit_all(async_engine: AsyncEngine, prepared: Sequence[PreparedRequest], retry_key: str) -> list[RequestStream]:
    """Every sequence of the request queued, or none (``AsyncEngine.submit_prepared``): a 429 with Retry-After when
    admission refuses them, a 400 when they could never be admitted."""
    try:
        return async_engine.submit_prepared(prepared, retry_key)
    except AdmissionRefused as refusal:
        retry_after = {"Retry-After": str(refusal.retry_after_s)}
        error_type = "rate_limit_error"
        raise ApiError(429, str(refusal), error_type=error_type, headers=retry_after, reason=refusal.reason) from None
    except InvalidRequest as error:
        raise ApiError(400, str(error), error.param) from None


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all streams as they come; ``EngineFailure`` from any ends it. The hand-off holds
    one item: a consumer that cannot write leaves the outputs in the streams, whose back-pressure (the slow-client
    abort) then applies to every choice as it does to a lone one."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | EngineFailure | None]] = asyncio.Queue(maxsize=1)

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, None))
        except EngineFailure as failure:
            await queue.put((index, failure))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, EngineFailure):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _stream(
    request: web.Request,
    body: CompletionRequest | ChatCompletionRequest,
    response_id: str,
    created: int,
    model: str,
    streams: Sequence[RequestStream],
    assemblers: Sequence[ChoiceAssembler],
    ignored: Sequence[str],
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": ",".join(s.request_id for s in streams),
            **ignored_header(ignored),
        }
    )
    write_timeout_s = request.app[SERVER_CONFIG].write_timeout_s

    async def send(*payloads: dict | str) -> None:
        events = (p if isinstance(p, str) else json.dumps(p, separators=(",", ":")) for p in payloads)
        data = "".join(f"data: {data}\n\n" for data in events).encode()
        try:
            await asyncio.wait_for(response.write(data), write_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectionResetError(f"the client read nothing for {write_timeout_s:g} s") from None

    try:
        await response.prepare(request)  # the headers: a client gone already makes this the first failed write
        try:
            await _send_chunks(send, body, response_id, created, model, streams, assemblers)
        except EngineFailure as failure:
            await send({"error": {"message": str(failure), "type": "engine_error", "param": None, "code": 500}})
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError as error:  # the client went away, or stopped reading; the caller aborts its requests
        logger.info("client of %s disconnected: %s", response_id, error)
        if request.transport is not None:
            request.transport.close()
    return response


async def _send_chunks(
    send,
    body: CompletionRequest | ChatCompletionRequest,
    response_id: str,
    created: int,
    model: str,
    streams: Sequence[RequestStream],
    assemblers: Sequence[ChoiceAssembler],
) -> None:
    """One chunk per engine output (so one per token), the finish reason in the last; then usage if asked (in every
    chunk with continuous_usage_stats). A choice's role (chat) or echoed prompt (completions) leaves with its first
    token, in the same write: nothing with ``choices`` goes out before a token exists (see docs/architecture.md,
    "Stream timing")."""
    is_chat = isinstance(body, ChatCompletionRequest)
    include_usage = body.include_usage

    def usage() -> Usage | None:
        return usage_of(assemblers) if body.continuous_usage else None

    async for index, output in _merge(streams):
        assembler = assemblers[index]
        chunks = []
        if is_chat and not assembler.is_started:
            chunks.append(role_chunk(response_id, created, model, index, include_usage, usage()))
        delta, logprobs = assembler.push(output)
        formatted = assembler.format_logprobs(logprobs) if logprobs else None
        reason = output.finish_reason
        chunks.append(
            token_chunk(response_id, is_chat, created, model, index, delta, formatted, reason, include_usage, usage())
        )
        await send(*chunks)
    if include_usage:
        await send(usage_chunk(response_id, is_chat, created, model, assemblers))


# ---- probes and metrics ---------------------------------------------------------------------------


def _liveness_problem(async_engine: AsyncEngine, config: ServerConfig) -> str | None:
    if not async_engine.is_running:
        return "the engine loop is not running"
    stalled_s = async_engine.stalled_for_s()
    if stalled_s > config.stall_timeout_s:
        return (
            f"no engine step for {stalled_s:.1f} s with {async_engine.num_in_flight} requests in flight "
            f"(stall timeout {config.stall_timeout_s:g} s)"
        )
    return None


async def _health(request: web.Request) -> web.Response:
    async_engine = request.app[ASYNC_ENGINE]
    problem = _liveness_problem(async_engine, request.app[SERVER_CONFIG])
    status = "ok" if problem is None else "engine_stopped" if not async_engine.is_running else "stalled"
    body = HealthResponse(
        status=status, num_in_flight=async_engine.num_in_flight, stalled_for_s=round(async_engine.stalled_for_s(), 3)
    )
    return web.json_response(body.model_dump(), status=200 if problem is None else 503)


async def _ready(request: web.Request) -> web.Response:
    async_engine = request.app[ASYNC_ENGINE]
    reasons = []
    problem = _liveness_problem(async_engine, request.app[SERVER_CONFIG])
    if problem is not None:
        reasons.append(problem)
    if async_engine.is_paused:
        reasons.append("the engine is paused by an admin")
    if request.app[LIFECYCLE].is_draining:
        reasons.append(DRAINING)
    frozen_s = async_engine.freeze_remaining_s
    if frozen_s is not None:
        reasons.append(f"the engine loop is frozen by a fault for {frozen_s:.1f} s more")
    reasons.extend(async_engine.overload_reasons())
    body = ReadyResponse(ready=not reasons, reasons=reasons)
    return web.json_response(body.model_dump(), status=200 if not reasons else 503)


async def _models(request: web.Request) -> web.Response:
    config = request.app[SERVER_CONFIG]
    engine = request.app[ASYNC_ENGINE].engine
    card = ModelCard(id=config.served_model_name, created=int(time.time()), max_model_len=engine.info.max_model_len)
    return web.json_response(ModelList(data=[card]).model_dump())


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[ASYNC_ENGINE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


# ---- running it -----------------------------------------------------------------------------------


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen on ``host:port`` (0: any free port); returns the runner (``cleanup()`` stops it) and the port."""
    config = app[SERVER_CONFIG]
    runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=config.keepalive_timeout_s)
    await runner.setup()
    app[LIFECYCLE].count_connections = lambda: len(runner.server.connections)
    metrics = app[ASYNC_ENGINE].metrics
    peers = PeerConnections(config.max_connections_per_peer, lambda: metrics.observe_rejected("peer_connection_cap"))
    peers.install(runner.server)
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]


async def drain(app: web.Application, timeout_s: float) -> int:
    """Stop taking requests (503 with Retry-After, ``/ready`` 503) and wait up to ``timeout_s`` for the streams in
    flight to finish. Returns how many were left: the shutdown that follows ends each with an SSE error event."""
    app[LIFECYCLE].is_draining = True
    async_engine = app[ASYNC_ENGINE]
    deadline = time.monotonic() + timeout_s
    while async_engine.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return async_engine.num_in_flight
