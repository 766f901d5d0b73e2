"""The reference model (Llama-style GQA decoder over a paged KV), its checkpoints and tokenizer."""

from kvfleet_runtime.model.checkpoint import (
    LoadedModel,
    args_from_hf_config,
    args_to_hf_config,
    default_device,
    generate_checkpoint,
    load_checkpoint,
    weights_digest,
)
from kvfleet_runtime.model.model import (
    PRESETS,
    ModelArgs,
    PagedKV,
    Transformer,
)
from kvfleet_runtime.model.tokenizer import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    IncrementalDecoder,
    StreamDecoder,
    Tokenizer,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PRESETS",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "IncrementalDecoder",
    "LoadedModel",
    "ModelArgs",
    "PagedKV",
    "StreamDecoder",
    "Tokenizer",
    "Transformer",
    "args_from_hf_config",
    "args_to_hf_config",
    "default_device",
    "generate_checkpoint",
    "load_checkpoint",
    "weights_digest",
]
