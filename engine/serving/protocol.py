"""The OpenAI-compatible wire format: request and response models, errors, and the OpenAPI document.

Requests are validated by these pydantic models in strict mode (no "5" for 5, no
true for 1), and ``/openapi.json`` is generated from the same models, so the
document describes exactly what the server accepts. Unknown fields are refused by
the models; the server drops and reports them unless ``--strict-api``
(``engine.serving.server``), as vLLM does. OpenAI parameters that change the
output and that kvstorm does not implement (``suffix``, tools, a JSON response
format, ``best_of`` above ``n``) are accepted at their neutral values only, since
common clients send those by default; anything else gets a 400 naming them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import models_json_schema

from engine.core.sampling_params import SamplingParams

# Caps that keep one request from slowing its neighbours: its per-token work (bias, banned ids, stop matching) and
# its submission stay small whatever it asks.
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_SEED = 2**63 - 1
MAX_CHOICES = 128  # n: choices per prompt (OpenAI's bound)
NonEmptyString = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send a last chunk with token usage and no choices")
    continuous_usage_stats: bool = Field(False, description="Also carry the usage so far in every chunk")


def _not_supported(name: str, neutral: str) -> ValueError:
    return ValueError(f"{name} is not supported by kvstorm; only {neutral} is accepted")


class _SamplingRequest(_Strict):
    """Fields both completion routes share."""

    model: str = Field(description="The served model name (GET /v1/models)")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens to generate at most (default: 16 for completions, the rest of the context for chat)",
    )
    temperature: float = Field(1.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Makes sampling reproducible for this request")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Strings that end the output (cut before them); at most {MAX_STOP_STRINGS}"
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="No stop token before this many tokens")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per prompt (with a seed: seed, seed + 1, ...)")
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(
        0.0, ge=-2, le=2, description="Subtracted from the logit of every token the output already has"
    )
    frequency_penalty: float | None = Field(
        0.0, ge=-2, le=2, description="Subtracted once per occurrence of a token in the output so far"
    )
    repetition_penalty: float | None = Field(
        1.0, gt=0, description="vLLM's: divides positive (multiplies negative) logits of prompt and output tokens"
    )
    min_p: float | None = Field(0.0, ge=0, le=1, description="Drop tokens below min_p x the top probability")
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)] | None
    ) = Field(None, description=f"Token id (as a string) -> value added to its logit; at most {MAX_LOGIT_BIAS}")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="Token ids that end the output"
    )

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def num_logprobs(self) -> int | None:
        """How many of the most likely tokens to report beside each sampled one; None: no logprobs."""
        return None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"keys are token ids (strings of digits), got {key!r}")
        return value

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``ValueError`` for combinations the fields alone cannot express (e.g. min_tokens > max_tokens)."""
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens,
            logprobs=self.num_logprobs(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items()),
        )

    @property
    def include_usage(self) -> bool:
        """A last chunk with usage; with continuous_usage_stats, usage in every chunk too."""
        return self.stream_options is not None and (
            self.stream_options.include_usage or self.stream_options.continuous_usage_stats
        )

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    prompt: (
        str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description="Text, token ids, or a list of either (one choice per prompt)")
    logprobs: int | None = Field(
        None, ge=0, le=SamplingParams.MAX_LOGPROBS, description="Log-probability of each token and the N most likely"
    )
    echo: bool = Field(False, description="The prompt's text before each choice's output")
    best_of: int | None = Field(None, ge=1, description="Only n (or null) is supported: every choice is returned")
    suffix: str | None = Field(None, description="Not supported: only null is accepted")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value is not None:
            raise _not_supported("suffix (insertion)", "null")

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) other than n ({self.n}) is not supported by kvstorm")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (the prompt's logprobs) is not supported by kvstorm")
        return self

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="developer is OpenAI's newer name for system"
    )
    content: str | list[dict[str, Any]] = Field(description="Text, or a list of text parts {type: text, text}")
    name: str | None = Field(None, description="Accepted; the chat template has no place for it")

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(value, str):
            return value
        for part in value:
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported: this model reads text parts only")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError("a text part is {type: text, text: string}")
        return value

    def template_message(self) -> dict[str, str]:
        """What the chat template reads: parts joined by newlines (as vLLM does), developer as system."""
        text = self.content if isinstance(self.content, str) else "\n".join(p["text"] for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseFormat(_Strict):
    type: Literal["text"] = Field(description="Only text: JSON modes and schemas are not supported")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = Field(False, description="Log-probability of each output token")
    top_logprobs: int | None = Field(
        None, ge=0, le=SamplingParams.MAX_LOGPROBS, description="With logprobs: also the N most likely tokens"
    )
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = Field(None, description="Not supported: only null or [] is accepted")
    tool_choice: Literal["none"] | None = Field(None, description="Only none: tools are not supported")
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise _not_supported("tools (function calling)", "null or []")
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _text_format_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") in ("json_object", "json_schema"):
            raise _not_supported(f"response_format {value['type']}", '{"type": "text"}')
        return value

    @model_validator(mode="after")
    def _one_output_limit(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache, not computed")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# A request the engine gives up on ("error") ends with an error event or a 500, never with a choice.
FinishReason = Literal["stop", "length", "abort"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvstorm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ok", "stalled", "engine_stopped"]
    num_in_flight: int
    stalled_for_s: float


class ReadyResponse(BaseModel):
    ready: bool
    reasons: list[str]


class ApiError(Exception):
    """An error the client caused or must act on, answered as OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        """``reason`` labels the rejection metric (default: one per status)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.headers = headers or {}
        self.reason = reason

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.error_type, param=self.param, code=self.status)
        return ErrorResponse(error=detail).model_dump()


def api_error_from_validation(error: ValidationError) -> ApiError:
    """One readable message naming the first offending field.

    For a field that takes one of several types, the error worth reporting comes from the type the
    value has (a list that is too long), not from the types it does not have.
    """
    errors = error.errors()
    first = errors[0]
    loc = first["loc"]
    param = str(loc[0]) if loc else None
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field '{'.'.join(str(part) for part in loc)}'", param)
    union = [e for e in errors if e["loc"][:1] == loc[:1] and len(e["loc"]) > 1 and not str(e["loc"][1]).isdigit()]
    if len({str(e["loc"][1]) for e in union}) > 1:
        within_type = [e for e in union if not e["type"].endswith("_type")]
        if not within_type:
            kinds = ", ".join(dict.fromkeys(str(e["loc"][1]) for e in union))
            return ApiError(400, f"'{param}' must be one of: {kinds} ({first['msg']})", param)
        first = within_type[0]
        loc = (param, *first["loc"][2:])
    where = ".".join(str(part) for part in loc)
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"'{where}': {message}" if where else message, param)


_ERROR_STATUSES = {
    "400": "Invalid parameters, malformed or non-UTF-8 JSON, or a prompt that can never fit",
    "404": "Unknown model",
    "413": "Body over the size limit",
    "429": "Admission control refused the request; see Retry-After",
    "500": "The engine failed while generating (without stream; a stream ends with an error event instead)",
    "503": "Engine not running or stalled",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json_content(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


_ERRORS = {
    status: {"description": text, "content": _json_content(ErrorResponse)} for status, text in _ERROR_STATUSES.items()
}


def _generate(request_model: type[BaseModel], response_model: type[BaseModel], summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json_content(request_model)},
        "responses": {
            "200": {
                "description": "The result, or with stream=true server-sent events ending with [DONE]",
                "content": {**_json_content(response_model), "text/event-stream": {"schema": {"type": "string"}}},
            },
            **_ERRORS,
        },
    }


def _read(description: str, content: dict[str, Any], not_now: str | None = None) -> dict[str, Any]:
    """A GET; ``not_now``: what its 503 (same content) means."""
    responses = {"200": {"description": description, "content": content}}
    if not_now is not None:
        responses["503"] = {"description": not_now, "content": content}
    return {"responses": responses}


def _admin(description: str) -> dict[str, Any]:
    return {
        "security": [{"adminToken": []}],
        "responses": {"200": {"description": description}, "401": {"description": "Missing or wrong admin token"}},
    }


def _admin_exit() -> dict[str, Any]:
    """POST /admin/exit answers 202 (then the process ends), not an admin route's 200."""
    operation = _admin("")
    del operation["responses"]["200"]
    operation["responses"] |= {
        "202": {"description": "Sent in full, then the process ends, for its supervisor to start it again"},
        "400": {"description": 'A body other than {"signal": "SIGKILL"} (the default) or {"signal": "SIGTERM"}'},
        "403": {"description": "The server was started without --admin-exit"},
    }
    return operation


@dataclass(frozen=True)
class Route:
    """One route of the server: the router registers the handler named ``name``, the OpenAPI document describes it
    with ``operation``; both read this table, so neither lists a route the other lacks."""

    method: str
    path: str
    name: str
    operation: dict[str, Any]


_TEXT = {"text/plain": {"schema": {"type": "string"}}}
ROUTES = (
    Route(
        "POST", "/v1/completions", "completions", _generate(CompletionRequest, CompletionResponse, "Text completion")
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        "chat_completions",
        _generate(ChatCompletionRequest, ChatCompletionResponse, "Chat completion"),
    ),
    Route("GET", "/v1/models", "models", _read("The served model", _json_content(ModelList))),
    Route(
        "GET",
        "/health",
        "health",
        _read(
            "The engine is stepping (or idle)",
            _json_content(HealthResponse),
            not_now="Requests in flight and no step for --stall-timeout",
        ),
    ),
    Route(
        "GET",
        "/ready",
        "ready",
        _read("Ready for traffic", _json_content(ReadyResponse), not_now="Not ready; reasons say why"),
    ),
    Route("GET", "/metrics", "metrics", _read("Prometheus text exposition", _TEXT)),
    Route("GET", "/openapi.json", "openapi", _read("This document", {"application/json": {"schema": {}}})),
)
# Only on a server with an admin token (engine.serving.admin).
ADMIN_ROUTES = (
    Route("GET", "/admin/stats", "stats", _admin("Pools, queues and every live request's phase")),
    Route("POST", "/admin/pause", "pause", _admin("The engine loop stops between steps")),
    Route("POST", "/admin/resume", "resume", _admin("The engine loop runs again")),
    Route("POST", "/admin/step", "step", _admin("A paused engine runs num_steps loop iterations (query, default 1)")),
    Route(
        "GET",
        "/admin/steps",
        "steps",
        _admin("The last busy loop iterations: each step's shape and wall time (what kvstorm simulate profile fits)"),
    ),
    Route(
        "GET",
        "/admin/faults",
        "get_faults",
        _admin("Every fault's value (engine/faults.py, plus freeze) and the lease left (lease_s)"),
    ),
    Route(
        "POST",
        "/admin/faults",
        "set_faults",
        _admin("Change some faults (a JSON object of them, optionally lease_s); answers with them all"),
    ),
    Route("DELETE", "/admin/faults", "clear_faults", _admin("Every fault off, the lease ended; answers with them all")),
    Route(
        "POST",
        "/admin/reset_prefix_cache",
        "reset_prefix_cache",
        _admin("Forget every cached prefix, so that a benchmark starts cold (vLLM's /reset_prefix_cache)"),
    ),
    Route("GET", "/admin/exit", "exit_state", _admin("Whether POST /admin/exit ends this server (--admin-exit)")),
    Route("POST", "/admin/exit", "exit", _admin_exit()),
)


def route_definitions(routes: tuple[Route, ...], handlers: dict[str, Any]) -> list[web.RouteDef]:
    """The router's entries for ``routes``, each to the handler of its name; ``handlers`` must name exactly them."""
    if set(handlers) != {route.name for route in routes}:
        raise ValueError(f"handlers {sorted(handlers)} do not match the routes {sorted(r.name for r in routes)}")
    return [web.route(route.method, route.path, handlers[route.name]) for route in routes]


def openapi_document(include_admin: bool) -> dict[str, Any]:
    """OpenAPI 3.1 of the route table, its schemas generated from the models the handlers validate and answer with."""
    models = [
        CompletionRequest,
        ChatCompletionRequest,
        CompletionResponse,
        ChatCompletionResponse,
        ModelList,
        ErrorResponse,
        HealthResponse,
        ReadyResponse,
    ]
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for route in ROUTES + (ADMIN_ROUTES if include_admin else ()):
        paths.setdefault(route.path, {})[route.method.lower()] = route.operation
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvstorm", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": schemas["$defs"]},
    }
    if include_admin:
        document["components"]["securitySchemes"] = {"adminToken": {"type": "http", "scheme": "bearer"}}
    return document
