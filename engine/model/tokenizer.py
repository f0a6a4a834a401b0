"""Tokenizer and chat template, backed by the transformers tokenizer of the same checkpoint."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import decoders
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.core.interface import PromptTooLong

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
        self.max_bytes_per_token = _max_bytes_per_token(hf_tokenizer)

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

    def encode(self, text: str, max_num_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; ``PromptTooLong`` without tokenizing if its bytes alone make more than
        ``max_num_tokens`` (``check_length``)."""
        self.check_length(text, max_num_tokens)
        return self._token_ids(text, add_special_tokens=True)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[ChatMessage], max_num_tokens: int | None = None) -> list[int]:
        """Token ids of the conversation followed by the assistant's turn header; ``PromptTooLong`` without
        tokenizing if the rendered conversation's bytes alone make more than ``max_num_tokens`` (``check_length``)."""
        if self.hf_tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.hf_tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        self.check_length(text, max_num_tokens)
        return self._token_ids(text, add_special_tokens=False)

    def _token_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """transformers' ``encode``, through the Rust tokenizer's batch call where there is one: that call lets other
        threads run while it works (its single-text ``encode`` holds the GIL throughout, 0.77 s for 660 KB during
        which not even the event loop ran), and the fast variant skips the offsets (90 ms more under the GIL)."""
        backend = getattr(self.hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def check_length(self, text: str, max_num_tokens: int | None) -> None:
        """``PromptTooLong`` if ``text`` must be more than ``max_num_tokens`` tokens, from its UTF-8 bytes alone: no
        token stands for more than ``max_bytes_per_token`` bytes, so a text of B bytes is at least
        B / max_bytes_per_token tokens, and a text that could fit is never refused. Linear in the text and far
        cheaper than tokenizing it (a megabyte takes a second to tokenize on a CPU core)."""
        if max_num_tokens is None or self.max_bytes_per_token is None:
            return
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        min_num_tokens = -(-num_bytes // self.max_bytes_per_token)
        if min_num_tokens > max_num_tokens:
            raise PromptTooLong(
                f"{num_bytes} bytes of text are at least {min_num_tokens} tokens (no token of this tokenizer is "
                f"longer than {self.max_bytes_per_token} bytes), more than {max_num_tokens}"
            )


def _max_bytes_per_token(hf_tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most bytes of text one token stands for, where that bounds a text's tokens: a byte-level BPE without a
    normalizer (GPT-2, Llama 3, SmolLM, Qwen), where every byte of a text is in exactly one token and a vocabulary
    entry is written one character per byte. None for any other tokenizer: there a normalizer may delete text, or
    one unknown token stand for any run of characters, so a text's length bounds nothing."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    longest_entry = max(map(len, backend.get_vocab(with_added_tokens=False)), default=1)
    # Added tokens (special ones, say) match the text as written: their UTF-8 bytes.
    added = (len(token.content.encode()) for token in backend.get_added_tokens_decoder().values())
    return max([longest_entry, *added])


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
