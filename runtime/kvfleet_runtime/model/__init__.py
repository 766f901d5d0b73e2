"""The model (Llama-family GQA decoders over a paged KV) and its checkpoints.

Which architectures are served and how a config is read: `kvfleet_runtime.model.architectures`; the
model's tokenizer: `kvfleet_runtime.tokenizer` (torch-free, so the router loads the same one)."""

from typing import TYPE_CHECKING

from kvfleet_runtime._lazy import lazy_exports

if TYPE_CHECKING:
    from kvfleet_runtime.model._graphs import DecodeGraphs
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
        PREFILL_CHUNK_TOKENS,
        PRESETS,
        ModelArgs,
        PackedLinear,
        PagedKV,
        Transformer,
        onednn_packing_supported,
    )

__all__ = [
    "PREFILL_CHUNK_TOKENS",
    "PRESETS",
    "CheckpointReport",
    "DecodeGraphs",
    "LoadedModel",
    "ModelArgs",
    "PackedLinear",
    "PagedKV",
    "Transformer",
    "args_from_hf_config",
    "args_to_hf_config",
    "checkpoint_args",
    "default_device",
    "generate_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "onednn_packing_supported",
    "read_config",
    "weight_files",
    "weights_digest",
]

# Every name but the torch-free architecture table is torch's: they load on first use, so that
# whoever reads only a config.json (breakeven, the operator, `kvfleet model inspect`'s parser)
# imports this package without torch.
_EXPORTS = {
    "DecodeGraphs": "_graphs",
    **dict.fromkeys(
        ["CheckpointReport", "LoadedModel", "args_from_hf_config", "args_to_hf_config",
         "checkpoint_args", "default_device", "generate_checkpoint", "inspect_checkpoint",
         "load_checkpoint", "read_config", "weight_files", "weights_digest"],
        "checkpoint",
    ),
    **dict.fromkeys(["PREFILL_CHUNK_TOKENS", "PRESETS", "ModelArgs", "PackedLinear", "PagedKV",
                     "Transformer", "onednn_packing_supported"], "model"),
}

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
