"""What the replica (and the router, for routing) needs of a tokenizer: the `Tokenizer` protocol.

The cache keys on token ids, never on strings, so a tokenizer only has to be deterministic; but the
ids must be the ones the model was trained on. Chat: `encode_chat(messages)` renders OpenAI-style
messages (`{"role", "content"}`) with the model's own template and encodes the result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["IncrementalDecoder", "Tokenizer"]


class IncrementalDecoder(Protocol):
    """Text of a token stream as it arrives: `push` returns only complete characters."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """What the replica (and the router, for routing) needs of a tokenizer."""

    name: str
    """Identifies the vocabulary and rules; equal names encode equal text to equal ids."""
    vocab_size: int
    stop_ids: frozenset[int]
    """Generation ends on any of these (the model's EOS ids)."""

    def encode(self, text: str, *, bos: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str: ...

    def stream_decoder(self, *, skip_special_tokens: bool = True,
                       spaces_between_special_tokens: bool = True) -> IncrementalDecoder:
        """`spaces_between_special_tokens` False (with specials kept): two special tokens in a
        row are joined as their bare text, without a space the decoder may put between them
        (vLLM's rule)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token as the vocabulary writes it (`/tokenize`'s `token_strs`)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (for logprobs: often part of a character, never U+FFFD)."""
        ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> list[int]: ...
