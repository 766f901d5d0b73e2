"""Checkpoints in the Hugging Face layout: `config.json` + `model.safetensors`.

`generate_checkpoint` writes a deterministic random checkpoint (same preset and seed -> the same
bytes, so the same weights digest on every machine). `load_checkpoint` reads any Llama-format
checkpoint this model can express. The weights digest is "sha256:" + SHA-256 over the bytes of the
`*.safetensors` files concatenated in file-name order (for one file: `sha256sum model.safetensors`);
it is the cache key's weights field, never a tag.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvfleet_runtime.model.model import ModelArgs, Transformer
from kvfleet_runtime.tokenizer import BYTE_TOKENIZER_DECLARATION, BYTE_TOKENIZER_NAME

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Our module names are Hugging Face's minus the "model." prefix (lm_head has none).
_HF_PREFIX = "model."


@dataclass(slots=True)
class LoadedModel:
    model: Transformer
    args: ModelArgs
    weights_digest: str
    model_dir: Path


def weights_digest(model_dir: Path) -> str:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir}")
    h = hashlib.sha256()
    for path in files:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def args_to_hf_config(args: ModelArgs) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "kvfleet_attn_impl": args.attn_impl,
    }


def args_from_hf_config(config: dict[str, Any], *, attn_impl: str | None = None) -> ModelArgs:
    try:
        n_heads = int(config["num_attention_heads"])
        dim = int(config["hidden_size"])
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu only)")
        return ModelArgs(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads", n_heads)),
            head_dim=int(config.get("head_dim") or dim // n_heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=config.get("rope_scaling"),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            attn_impl=attn_impl or str(config.get("kvfleet_attn_impl", "eager")),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks the field {exc.args[0]!r}") from exc


def generate_checkpoint(out_dir: Path, args: ModelArgs, *, seed: int = 0) -> str:
    """Write a deterministic random checkpoint; returns its weights digest."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.state_dict().items()):
        if name.endswith("norm.weight"):
            # Near 1, not exactly 1, so a loader that drops a norm weight fails the tests.
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            fan_in = param.shape[-1] if name != "embed_tokens.weight" else 1
            value = torch.randn(param.shape, generator=gen) / fan_in**0.5
        tensors[_hf_name(name)] = value.to(torch.float32).contiguous()
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    # The generated model has no trained tokenizer: it declares the byte tokenizer (a folder
    # without a tokenizer or a declaration is refused).
    hf_config = {**args_to_hf_config(args), BYTE_TOKENIZER_DECLARATION: BYTE_TOKENIZER_NAME}
    config = json.dumps(hf_config, indent=2, sort_keys=True)
    (out_dir / CONFIG_FILE).write_text(config + "\n")
    return weights_digest(out_dir)


def load_checkpoint(model_dir: Path, *, device: torch.device | None = None,
                    attn_impl: str | None = None) -> LoadedModel:
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{config_path} does not exist")
    args = args_from_hf_config(json.loads(config_path.read_text()), attn_impl=attn_impl)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    model = Transformer(args)
    own = {_module_name(k): v.to(torch.float32) for k, v in state.items()}
    missing = sorted(set(model.state_dict()) - set(own))
    unexpected = sorted(set(own) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not match its config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(own, strict=False)
    model.eval()
    model.to(device or default_device())
    return LoadedModel(model=model, args=args, weights_digest=weights_digest(model_dir),
                       model_dir=model_dir)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else _HF_PREFIX + name


def _module_name(name: str) -> str:
    return name.removeprefix(_HF_PREFIX)
