"""How a request samples and when it stops. No torch here: the scheduler reads these too."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 means greedy. ``seed`` makes sampling reproducible for
    this request whatever else is in the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Text that ends the request; the output is cut before it.
    stop: tuple[str, ...] = field(default_factory=tuple)
    # No stop token (EOS or stop_token_ids) can be sampled before this many tokens are out.
    min_tokens: int = 0
    # Return the sampled token's log-probability and this many most likely alternatives; None: no logprobs.
    logprobs: int | None = None
    # OpenAI's penalties on the output so far: presence subtracts once per token that occurred, frequency once per
    # occurrence; vLLM's repetition penalty divides a positive logit (multiplies a negative one) of every token in
    # the prompt or the output. They change greedy decoding too.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Drops tokens less likely than min_p times the most likely one (sampling only).
    min_p: float = 0.0
    # (token id, value added to its logit) pairs.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    MAX_LOGPROBS = 20
    MAX_PENALTY = 2.0
    MAX_LOGIT_BIAS = 100.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -self.MAX_PENALTY <= getattr(self, name) <= self.MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or token_id < 0 or not -self.MAX_LOGIT_BIAS <= bias <= self.MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {token_id}: {bias}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the tokens so far (the prompt and the output)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
