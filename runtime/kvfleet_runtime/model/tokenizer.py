"""The model's tokenizer: `kvfleet_runtime.tokenizer` (torch-free, so the router can load the same
one), re-exported here for the model package's callers."""

from kvfleet_runtime.tokenizer import (
    BOS_ID,
    BYTE_TOKENIZER_NAME,
    EOS_ID,
    NUM_BYTE_TOKENS,
    PAD_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    StreamDecoder,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "BOS_ID",
    "BYTE_TOKENIZER_NAME",
    "EOS_ID",
    "NUM_BYTE_TOKENS",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDecoder",
    "StreamDecoder",
    "Tokenizer",
    "load_tokenizer",
]
