"""The model (Llama-family GQA decoders over a paged KV), its checkpoints and tokenizer.

Which architectures are served and how a config is read: `kvfleet_runtime.architectures`."""

from kvfleet_runtime.model.checkpoint import (
    CheckpointReport,
    LoadedModel,
    args_from_hf_config,
    args_to_hf_config,
    checkpoint_args,
    default_device,
    generate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    read_config,
    weight_files,
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
    "CheckpointReport",
    "IncrementalDecoder",
    "LoadedModel",
    "ModelArgs",
    "PagedKV",
    "StreamDecoder",
    "Tokenizer",
    "Transformer",
    "args_from_hf_config",
    "args_to_hf_config",
    "checkpoint_args",
    "default_device",
    "generate_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_config",
    "weight_files",
    "weights_digest",
]
