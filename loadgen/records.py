"""What one request's measurement is, and the outcome classes (shared by the client, analysis, report, Locust)."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, computed_field


class Outcome(str, Enum):
    """How a request ended, from the client's side.

    - ``ok``: HTTP 200, a clean stream (finish_reason, ``[DONE]``, integrity checks passed).
    - ``rejected``: no stream started: a non-200 status (4xx, 429, 503, ...) or no connection.
    - ``broken_stream``: the stream started, then ended without a finish reason or ``[DONE]``, stalled longer than
      the stall timeout, or failed an integrity check (bad framing, data after the end, usage.completion_tokens
      different from the tokens delivered, an error event, a field of the wrong type: a ``protocol error``), or broke a
      bound the client keeps (more tokens than requested, an SSE line past its cap) and was cut.
    - ``client_timeout``: the whole request took longer than the client's request timeout.
    """

    OK = "ok"
    REJECTED = "rejected"
    BROKEN_STREAM = "broken_stream"
    CLIENT_TIMEOUT = "client_timeout"


class RequestRecord(BaseModel):
    """One request. Times are seconds; ``scheduled_s`` and ``sent_s`` are offsets from the run's start, the others
    durations from ``sent_s``. ``itl_s`` holds every gap between consecutive token chunks.

    TPOT follows vLLM's benchmark: (E2E - TTFT) / (output_tokens - 1), None with fewer than two tokens.
    ``output_tokens`` is usage.completion_tokens when the server sent usage, else the token chunks delivered.
    """

    index: int
    request_id: str
    scheduled_s: float
    sent_s: float
    outcome: Outcome
    error: str = ""
    # What the client noticed that did not make the request fail (a Retry-After it could not use).
    notes: list[str] = []
    http_status: int | None = None
    # Sends of the request: more than one when the client retried a refusal (429 or 503) after its Retry-After. Its
    # times (TTFT, E2E) run from the first send: the wait is its user's.
    attempts: int = 1
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = []
    prompt_tokens: int | None = None
    output_tokens: int = 0
    delivered_tokens: int = 0
    usage_completion_tokens: int | None = None
    requested_output_tokens: int = 0
    # Prompt tokens the server says it served from its prefix cache (usage.prompt_tokens_details.cached_tokens),
    # None when it did not say.
    cached_tokens: int | None = None
    # Leading prompt tokens an earlier request of the run sent first: the most a prefix cache could serve it.
    shared_prefix_tokens: int = 0
    # A multi-turn workload's session (in order of arrival) and turn (from 1); None for a single request.
    session: int | None = None
    turn: int | None = None

    @computed_field
    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        """Offset from the run's start at which the request ended (sent time when it never got an answer)."""
        return self.sent_s + (self.e2e_s or 0.0)
