"""The engine as the serving layer sees it: one snapshot and a few commands. No torch here.

``engine.llm_engine.LLMEngine`` implements it; ``engine.serving`` may use nothing else of the engine (a test reads
the serving modules and enforces it), so the scheduler, the block pools and the model runner can change without
touching the server. Only plain data crosses (``engine.core.outputs``): the serving layer hands over a frozen
``PreparedRequest`` and gets outputs, timings and snapshots back; it never holds an object the engine thread changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.core.outputs import EngineInfo, EngineSnapshot, PreparedRequest, RequestOutput, StepResult
from engine.core.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class InvalidRequest(ValueError):
    """A request the engine refuses before it starts, the client's fault (an API answers 400); ``param`` names the
    field at fault. Any other error of the engine's is the server's."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(ValueError):
    """A text the tokenizer refused without tokenizing it: its length alone makes more tokens than allowed."""


class TextTokenizer(Protocol):
    """What the serving layer needs of a tokenizer: chat prompts in, token names out (for logprobs)."""

    def apply_chat_template(self, messages: Sequence[dict[str, str]], max_num_tokens: int | None = None) -> list[int]:
        """``PromptTooLong`` (without tokenizing, where the tokenizer can tell from the text's length) if the prompt
        would be more than ``max_num_tokens`` tokens; ``ValueError`` if the tokenizer has no chat template."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class EngineClient(Protocol):
    """Commands run on the engine's own thread, one at a time, except ``prepare_request`` (safe from any thread:
    it touches no engine state). ``snapshot`` describes the engine between two steps."""

    info: EngineInfo
    # None for a model without one (prompts are token ids).
    tokenizer: TextTokenizer | None

    def prepare_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, arrival_ts: float | None = None
    ) -> PreparedRequest:
        """Tokenize and validate; ``InvalidRequest`` with the numbers if it is malformed or can never fit."""
        ...

    def add_prepared_request(self, prepared: PreparedRequest, first_attempt_ts: float | None = None) -> None:
        """Queue it (``first_attempt_ts``: a retry keeps its place in line from then); ``ValueError`` if its id is in
        use."""
        ...

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End it now (its blocks are free on return); its final output, or None if it is unknown or done."""
        ...

    def step(self) -> StepResult:
        """One iteration: every output of it, each complete (a finished one carries its finish reason), and the
        snapshot after it."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def snapshot(self, include_requests: bool = False) -> EngineSnapshot: ...

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were cached."""
        ...

    def update_faults(self, **changes: object) -> dict[str, object]:
        """Change run-time faults (``ValueError`` for a bad one, nothing changed); returns every fault's value."""
        ...

    def cut_fault_delays(self) -> None:
        """End the delay faults now, a sleep of the step in progress included; the one command safe from any thread
        while a step runs."""
        ...

    def clear_faults(self) -> dict[str, object]:
        """Every run-time fault off; returns every fault's value."""
        ...
