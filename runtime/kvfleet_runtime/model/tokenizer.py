"""A byte-level tokenizer: ids 0-255 are the UTF-8 bytes, then three special tokens.

The cache keys on token ids, never on strings, so the tokenizer only has to be deterministic.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
NUM_BYTE_TOKENS = 256
VOCAB_SIZE = 259


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < NUM_BYTE_TOKENS).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()


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
