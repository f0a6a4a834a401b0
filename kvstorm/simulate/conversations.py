"""Multi-turn sessions (``loadgen.sessions``) as the simulator takes them: each turn's new tokens, counted as the
server counts them when a tokenizer is at hand, else estimated from the words.

A turn sends the whole conversation so far. Its prompt is the previous turn's prompt, the previous answer (exactly
its ``max_tokens``: the load asks for exact output lengths) and its own new tokens: the chat template's end of the
answer, the new user message and the header of the next answer. Those new tokens are the difference between the
conversation with and without the new message, every earlier answer left empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from engine.core.simulator import SimulatedSession, SimulatedTurn
from loadgen.sessions import SessionPlan
from loadgen.workloads import WORDS_PER_TOKEN

Message = dict[str, str]
# A ChatML message's framing (``<|im_start|>role\n`` ... ``<|im_end|>\n``) and the header of the answer
# (``<|im_start|>assistant\n``), in tokens: what an estimate adds to the words.
ESTIMATED_MESSAGE_TOKENS = 5
ESTIMATED_HEADER_TOKENS = 3


class ChatTokens(Protocol):
    # How the counts were made, for the report.
    description: str

    def count(self, messages: Sequence[Message]) -> int:
        """Tokens of the conversation as a prompt: the chat template over it, then the answer's header."""
        ...

    def shared(self, system_prompt: str) -> int:
        """Leading tokens every session's first prompt has in common, given that system prompt."""
        ...


class TemplateTokens:
    """The counts of the served model's own tokenizer and chat template (a GGUF file or a Hugging Face folder)."""

    def __init__(self, path: Path) -> None:
        from engine.model.tokenizer import Tokenizer  # transformers: only a run with a tokenizer loads it

        self.tokenizer = Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_hf_dir(path)
        self.description = f"counted with the chat template and tokenizer of {path.name}"

    def count(self, messages: Sequence[Message]) -> int:
        return len(self.tokenizer.apply_chat_template(messages))

    def shared(self, system_prompt: str) -> int:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        first, second = (
            self.tokenizer.apply_chat_template([*system, {"role": "user", "content": text}]) for text in ("a", "b")
        )
        return next((i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y), len(first))


class EstimatedTokens:
    """Words / ``WORDS_PER_TOKEN`` per message, plus a ChatML template's framing: without the model's tokenizer."""

    description = (
        f"estimated from the words ({WORDS_PER_TOKEN} words per token, {ESTIMATED_MESSAGE_TOKENS} tokens of "
        "template per message): give the model's tokenizer to count them as its server does"
    )

    def count(self, messages: Sequence[Message]) -> int:
        return ESTIMATED_HEADER_TOKENS + sum(self._message(message) for message in messages)

    def shared(self, system_prompt: str) -> int:
        return self._message({"content": system_prompt}) if system_prompt else 0

    @staticmethod
    def _message(message: Message) -> int:
        return ESTIMATED_MESSAGE_TOKENS + round(len(message["content"].split()) / WORDS_PER_TOKEN)


def simulated_sessions(plan: SessionPlan, tokens: ChatTokens) -> list[SimulatedSession]:
    shared = tokens.shared(plan.system_prompt)
    sessions = []
    for planned in plan.sessions:
        messages: list[Message] = [{"role": "system", "content": plan.system_prompt}] if plan.system_prompt else []
        turns, counted = [], 0
        for user_message, max_tokens in zip(planned.user_messages, planned.max_tokens, strict=True):
            messages.append({"role": "user", "content": user_message})
            total = tokens.count(messages)
            turns.append(SimulatedTurn(total - counted, max_tokens))
            counted = total
            messages.append({"role": "assistant", "content": ""})
        sessions.append(SimulatedSession(planned.index, planned.offset_s, tuple(turns), plan.think_s, shared))
    return sessions
