"""Tokenizers the replica serves with, behind one protocol (`Tokenizer`).

`ByteTokenizer`: ids 0-255 are the UTF-8 bytes, then three special tokens. It is the tokenizer of
the generated demo model only (a checkpoint declares it); a folder with a real tokenizer is never
served with it. The cache keys on token ids, never on strings, so a tokenizer only has to be
deterministic; but the ids must be the ones the model was trained on.

Chat: `encode_chat(messages)` renders OpenAI-style messages (`{"role", "content"}`) with the
model's own template and encodes the result. The byte tokenizer's template is documented on
`ByteTokenizer.CHAT_TEMPLATE`.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from kvfleet_runtime.wire import BYTE_BOS_ID, BYTE_TOKENIZER_ID

__all__ = [
    "BOS_ID",
    "BYTE_TOKENIZER_NAME",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "IncrementalDecoder",
    "StreamDecoder",
    "Tokenizer",
]

BOS_ID = BYTE_BOS_ID
EOS_ID = 257
PAD_ID = 258
NUM_BYTE_TOKENS = 256
VOCAB_SIZE = 259
BYTE_TOKENIZER_NAME = BYTE_TOKENIZER_ID


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

    def decode(self, ids: Iterable[int]) -> str: ...

    def stream_decoder(self) -> IncrementalDecoder: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> list[int]: ...


class ByteTokenizer:
    name = BYTE_TOKENIZER_NAME
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE
    stop_ids = frozenset({EOS_ID})

    CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
    """Each message as `<|role|>`, newline, its content, newline; with a generation prompt the
    text ends in `<|assistant|>\\n`. Encoded as UTF-8 bytes after BOS."""

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < NUM_BYTE_TOKENS).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> list[int]:
        text = "".join(self.CHAT_TEMPLATE.format(role=m["role"], content=m["content"])
                       for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return self.encode(text)


class StreamDecoder:
    """Turns tokens into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < NUM_BYTE_TOKENS:
            return ""
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
