"""Tokenizers the replica serves with (and the router routes with), behind one protocol.

`load_tokenizer(model_dir)` gives a model folder's own tokenizer: its Hugging Face
`tokenizer.json` and chat template (`HFTokenizer`, on the `tokenizers` library and Jinja), or the
byte tokenizer of the generated demo model when its config declares it (`ByteTokenizer`); any
other folder is refused. No torch here: the router imports this package.
"""

from kvfleet_runtime.tokenizer._byte import (
    BOS_ID,
    BYTE_TOKENIZER_NAME,
    EOS_ID,
    NUM_BYTE_TOKENS,
    PAD_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    StreamDecoder,
)
from kvfleet_runtime.tokenizer._chat import ChatTemplate
from kvfleet_runtime.tokenizer._hf import HFStreamDecoder, HFTokenizer
from kvfleet_runtime.tokenizer._load import (
    BYTE_TOKENIZER_DECLARATION,
    load_tokenizer,
    tokenizer_files_digest,
)
from kvfleet_runtime.tokenizer._protocol import IncrementalDecoder, Tokenizer

__all__ = [
    "BOS_ID",
    "BYTE_TOKENIZER_DECLARATION",
    "BYTE_TOKENIZER_NAME",
    "EOS_ID",
    "NUM_BYTE_TOKENS",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "ChatTemplate",
    "HFStreamDecoder",
    "HFTokenizer",
    "IncrementalDecoder",
    "StreamDecoder",
    "Tokenizer",
    "load_tokenizer",
    "tokenizer_files_digest",
]
