"""From a request's outputs to OpenAI choices: text deltas, logprobs in each endpoint's shape, chunks.

The engine releases text that is final (``engine.core.stopping`` holds back a tail that may begin a stop string and
never releases the stop string itself), so a choice only appends what each output brings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.core.interface import TextTokenizer
from engine.core.outputs import RequestOutput, TokenLogprobs
from engine.serving.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)


class ChoiceAssembler:
    """One choice: its text, its logprobs, its finish reason and token counts."""

    def __init__(self, tokenizer: TextTokenizer | None, chat: bool, echo: str = "") -> None:
        self.tokenizer = tokenizer  # names the tokens of logprobs; the engine decodes the text
        self.chat = chat  # which OpenAI shape its logprobs take
        self.text = echo  # a completion with echo starts with its prompt
        self.is_started = False  # whether an output reached this choice yet
        self.logprobs: list[TokenLogprobs] | None = None  # every token's, once the request's outputs carry them
        self.finish_reason: str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def push(self, output: RequestOutput) -> tuple[str, tuple[TokenLogprobs, ...]]:
        """The text delta this output brings, and its tokens' logprobs (none unless the request asked). The first
        delta starts with the echoed prompt: it leaves with the first generated token, as vLLM sends it, because
        benchmark clients stamp the first token at the first chunk that carries text."""
        echo = "" if self.is_started else self.text
        self.is_started = True
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens or 0
        self.finish_reason = output.finish_reason
        self.text += output.new_text
        if output.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(output.logprobs)
        return echo + output.new_text, output.logprobs or ()

    def format_logprobs(self, values: Sequence[TokenLogprobs]) -> CompletionLogprobs | ChatLogprobs:
        """``values`` in this choice's endpoint's shape."""
        return self._chat_logprobs(values) if self.chat else self._completion_logprobs(values)

    def all_logprobs(self) -> CompletionLogprobs | ChatLogprobs | None:
        """Every token's logprobs so far in this endpoint's shape; None when the request did not ask for them."""
        return None if self.logprobs is None else self.format_logprobs(self.logprobs)

    def _completion_logprobs(self, values: Sequence[TokenLogprobs]) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=[self._token_text(v.token_id) for v in values],
            token_logprobs=[v.logprob for v in values],
            top_logprobs=[
                {self._token_text(t): lp for t, lp in zip(v.top_token_ids, v.top_logprobs, strict=True)} for v in values
            ],
        )

    def _chat_logprobs(self, values: Sequence[TokenLogprobs]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> ChatTopLogprob:
            text = self._token_text(token_id)
            return ChatTopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8", errors="replace")))

        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **entry(v.token_id, v.logprob).model_dump(),
                    top_logprobs=[entry(t, lp) for t, lp in zip(v.top_token_ids, v.top_logprobs, strict=True)],
                )
                for v in values
            ]
        )

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def usage_of(choices: Sequence[ChoiceAssembler]) -> Usage:
    prompt = sum(c.num_prompt_tokens for c in choices)
    completion = sum(c.num_output_tokens for c in choices)
    cached = PromptTokensDetails(cached_tokens=sum(c.num_cached_tokens for c in choices))
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=cached,
    )


def role_chunk(
    response_id: str, created: int, model: str, index: int, include_usage: bool, usage: Usage | None = None
) -> dict[str, Any]:
    """A chat choice's first chunk: the assistant's role, no text. It is sent with the choice's first token, never
    before it: vLLM's benchmark client (and others) stamp the first token at the first chunk that carries choices."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return _chunk(response_id, True, created, model, choice, include_usage, usage)


def token_chunk(
    response_id: str,
    is_chat: bool,
    created: int,
    model: str,
    index: int,
    text: str,
    logprobs: CompletionLogprobs | ChatLogprobs | None,
    finish_reason: str | None,
    include_usage: bool,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One choice's new text (a chat delta or completion text), its logprobs and, in the last, the finish reason;
    ``usage``: the usage so far (continuous_usage_stats)."""
    choice: dict[str, Any] = {"index": index, **({"delta": {"content": text}} if is_chat else {"text": text})}
    choice["logprobs"] = logprobs.model_dump() if logprobs else None
    choice["finish_reason"] = finish_reason
    return _chunk(response_id, is_chat, created, model, choice, include_usage, usage)


def usage_chunk(
    response_id: str, is_chat: bool, created: int, model: str, choices: Sequence[ChoiceAssembler]
) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage: no choices, the token counts of all of them."""
    chunk = _chunk(response_id, is_chat, created, model, None, include_usage=True)
    chunk["usage"] = usage_of(choices).model_dump()
    return chunk


def _chunk(
    response_id: str,
    is_chat: bool,
    created: int,
    model: str,
    choice: dict[str, Any] | None,
    include_usage: bool,
    usage: Usage | None = None,
) -> dict[str, Any]:
    object_name = "chat.completion.chunk" if is_chat else "text_completion"
    choices = [choice] if choice is not None else []
    chunk = {"id": response_id, "object": object_name, "created": created, "model": model, "choices": choices}
    if include_usage:
        # The last chunk carries the total; others null, or the usage so far with continuous_usage_stats.
        chunk["usage"] = None if usage is None else usage.model_dump()
    return chunk


def final_response(
    body: CompletionRequest | ChatCompletionRequest,
    response_id: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceAssembler],
) -> CompletionResponse | ChatCompletionResponse:
    usage = usage_of(choices)
    if isinstance(body, ChatCompletionRequest):
        return ChatCompletionResponse(
            id=response_id,
            created=created,
            model=model,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatMessageOut(content=c.text),
                    logprobs=c.all_logprobs(),
                    finish_reason=c.finish_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage,
        )
    return CompletionResponse(
        id=response_id,
        created=created,
        model=model,
        choices=[
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=c.all_logprobs(),
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ],
        usage=usage,
    )
