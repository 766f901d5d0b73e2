"""The byte tokenizer: ids 0-255 are the UTF-8 bytes, then three special tokens.

It is the tokenizer of the generated demo model only (its config.json declares
`"kvfleet_tokenizer": "byte-v1"`); a folder with a real tokenizer is never served with it. The
chat template is documented on `ByteTokenizer.CHAT_TEMPLATE`.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvfleet_runtime.wire import BYTE_BOS_ID, BYTE_TOKENIZER_ID

__all__ = [
    "BOS_ID",
    "BYTE_TOKENIZER_NAME",
    "EOS_ID",
    "NUM_BYTE_TOKENS",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "StreamDecoder",
]

BOS_ID = BYTE_BOS_ID
EOS_ID = 257
PAD_ID = 258
NUM_BYTE_TOKENS = 256
VOCAB_SIZE = 259
BYTE_TOKENIZER_NAME = BYTE_TOKENIZER_ID
SPECIAL_TEXT = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>", PAD_ID: "<|pad|>"}
"""The special tokens as text, where a request keeps them (`skip_special_tokens: false`)."""


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

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if 0 <= i < NUM_BYTE_TOKENS).decode("utf-8",
                                                                            errors="replace")
        decoder = StreamDecoder(skip_special_tokens=False)
        return "".join(decoder.push(i) for i in ids) + decoder.flush()

    def stream_decoder(self, *, skip_special_tokens: bool = True,
                       spaces_between_special_tokens: bool = True) -> StreamDecoder:
        # Byte tokens have no decoder that adds spaces: the last flag changes nothing here.
        return StreamDecoder(skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        if token_id in SPECIAL_TEXT:
            return SPECIAL_TEXT[token_id]
        return self.token_bytes(token_id).decode("latin-1")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < NUM_BYTE_TOKENS else b""

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> list[int]:
        if not messages:
            raise ValueError("messages is empty; a chat needs at least one message")
        parts = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"messages[{i}] needs a string role and a string content, got "
                                 f"role {role!r} and content of type {type(content).__name__}")
            parts.append(self.CHAT_TEMPLATE.format(role=role, content=content))
        text = "".join(parts)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return self.encode(text)


class StreamDecoder:
    """Turns tokens into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, *, skip_special_tokens: bool = True) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip_special_tokens

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < NUM_BYTE_TOKENS:
            if self._skip or token_id not in SPECIAL_TEXT:
                return ""
            # A special token ends any incomplete character before it.
            return self._decoder.decode(b"", final=True) + SPECIAL_TEXT[token_id]
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
