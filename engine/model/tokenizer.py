"""Tokenizer and chat template, backed by the transformers tokenizer of the same checkpoint."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

ChatMessage = dict[str, str]


class Tokenizer:
    """Encodes text and chat conversations to token ids and back.

    ``eos_token_ids`` holds every id that ends generation (the tokenizer's EOS
    plus any listed in the checkpoint's generation config).
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        eos = {hf_tokenizer.eos_token_id} if hf_tokenizer.eos_token_id is not None else set()
        self.eos_token_ids = frozenset(eos | set(extra_eos_token_ids))

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        return cls(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))

    @classmethod
    def from_hf_dir(cls, directory: Path) -> Tokenizer:
        extra: list[int] = []
        generation_config = directory / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(AutoTokenizer.from_pretrained(str(directory)), extra)

    @property
    def vocab_size(self) -> int:
        return len(self.hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.hf_tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of the conversation followed by the assistant's turn header."""
        if self.hf_tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.hf_tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return self.hf_tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-emitting or splitting characters.

    A delta is only released once the token ids decode to complete characters:
    byte-level BPE can split one UTF-8 character across tokens. The last emitted
    tokens are decoded again with the new ones so merges across the boundary resolve.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]
