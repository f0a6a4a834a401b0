"""The OpenAI-compatible wire format: request and response models, errors, and the OpenAPI document.

Requests are validated by these pydantic models in strict mode (no "5" for 5, no
true for 1) with unknown fields refused, and ``/openapi.json`` is generated from
the same models, so the document describes exactly what the server accepts.
OpenAI parameters that kvstorm does not implement (penalties, logit bias) are
accepted at their neutral values only, since common clients send those by default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import models_json_schema

from engine.core.sampling_params import SamplingParams

MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1
NonEmptyString = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send a last chunk with token usage and no choices")


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
    stop: NonEmptyString | Annotated[list[NonEmptyString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="Strings that end the output (cut before them)"
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="No stop token before this many tokens")
    n: Literal[1] = Field(1, description="Only one choice per prompt is supported")
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0, le=0, description="Not implemented: only 0 is accepted")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="Not implemented: only 0 is accepted")
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = Field(
        None, description="Not implemented: only null or {} is accepted"
    )

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def num_logprobs(self) -> int | None:
        """How many of the most likely tokens to report beside each sampled one; None: no logprobs."""
        return None

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
            min_tokens=self.min_tokens,
            logprobs=self.num_logprobs(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: (
        str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description="Text, token ids, or a list of either (one choice per prompt)")
    logprobs: int | None = Field(
        None, ge=0, le=SamplingParams.MAX_LOGPROBS, description="Log-probability of each token and the N most likely"
    )

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = Field(False, description="Log-probability of each output token")
    top_logprobs: int | None = Field(
        None, ge=0, le=SamplingParams.MAX_LOGPROBS, description="With logprobs: also the N most likely tokens"
    )

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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
        return ApiError(400, f"unknown field '{param}'", param)
    union = [e for e in errors if e["loc"][:1] == loc[:1] and len(e["loc"]) > 1 and not str(e["loc"][1]).isdigit()]
    if len({str(e["loc"][1]) for e in union}) > 1:
        within_type = [e for e in union if not e["type"].endswith("_type")]
        if not within_type:
            kinds = ", ".join(dict.fromkeys(str(e["loc"][1]) for e in union))
            return ApiError(400, f"'{param}' must be one of: {kinds} ({first['msg']})", param)
        first = within_type[0]
        loc = (param, *first["loc"][2:])
    where = ".".join(str(part) for part in loc)
    return ApiError(400, f"'{where}': {first['msg']}", param)


_ERROR_STATUSES = {
    "400": "Invalid parameters, malformed or non-UTF-8 JSON, or a prompt that can never fit",
    "404": "Unknown model",
    "413": "Body over the size limit",
    "429": "Admission control refused the request; see Retry-After",
    "500": "The engine failed while generating (without stream; a stream ends with an error event instead)",
    "503": "Engine not running or stalled",
}


def openapi_document(include_admin: bool) -> dict[str, Any]:
    """OpenAPI 3.1 generated from the models the handlers validate with and answer with."""
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

    def ref(model: type[BaseModel]) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def json_content(model: type[BaseModel]) -> dict[str, Any]:
        return {"application/json": {"schema": ref(model)}}

    errors = {
        status: {"description": text, "content": json_content(ErrorResponse)}
        for status, text in _ERROR_STATUSES.items()
    }

    def generate(request_model: type[BaseModel], response_model: type[BaseModel], summary: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": json_content(request_model)},
                "responses": {
                    "200": {
                        "description": "The result, or with stream=true server-sent events ending with [DONE]",
                        "content": {
                            **json_content(response_model),
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **errors,
                },
            }
        }

    def get(description: str, content: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"get": {"responses": {"200": {"description": description, "content": content}, **(extra or {})}}}

    paths: dict[str, Any] = {
        "/v1/completions": generate(CompletionRequest, CompletionResponse, "Text completion"),
        "/v1/chat/completions": generate(ChatCompletionRequest, ChatCompletionResponse, "Chat completion"),
        "/v1/models": get("The served model", json_content(ModelList)),
        "/health": get(
            "The engine is stepping (or idle)",
            json_content(HealthResponse),
            {
                "503": {
                    "description": "Requests in flight and no step for --stall-timeout",
                    "content": json_content(HealthResponse),
                }
            },
        ),
        "/ready": get(
            "Ready for traffic",
            json_content(ReadyResponse),
            {"503": {"description": "Not ready; reasons say why", "content": json_content(ReadyResponse)}},
        ),
        "/metrics": get("Prometheus text exposition", {"text/plain": {"schema": {"type": "string"}}}),
    }
    if include_admin:
        paths.update(_admin_paths())
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvstorm", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": schemas["$defs"]},
    }
    if include_admin:
        document["components"]["securitySchemes"] = {"adminToken": {"type": "http", "scheme": "bearer"}}
    return document


def _admin_paths() -> dict[str, Any]:
    unauthorized = {"401": {"description": "Missing or wrong admin token"}}

    def route(method: str, description: str) -> dict[str, Any]:
        return {
            method: {
                "security": [{"adminToken": []}],
                "responses": {"200": {"description": description}, **unauthorized},
            }
        }

    return {
        "/admin/stats": route("get", "Pools, queues and every live request's phase"),
        "/admin/pause": route("post", "The engine loop stops between steps"),
        "/admin/resume": route("post", "The engine loop runs again"),
        "/admin/step": route("post", "A paused engine runs num_steps loop iterations (query, default 1)"),
        "/admin/faults": {
            **route("get", "Every fault's value (engine/faults.py, plus freeze) and the lease left (lease_s)"),
            **route("post", "Change some faults (a JSON object of them, optionally lease_s); answers with them all"),
            **route("delete", "Every fault off, the lease ended; answers with them all"),
        },
    }
