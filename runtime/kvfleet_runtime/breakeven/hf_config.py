"""Read a model profile from a Hugging Face `config.json`.

Layers, KV heads, head dim and MLA latent dims are read directly. For an architecture the
replica serves (`kvfleet_runtime.model.architectures`), the config is read by the replica's own
parser and the parameter count is exact (biases, norms, tied embeddings), so the planner agrees with
`kvfleet model inspect`. Otherwise (MoE, MLA, ...) the count is estimated from the shapes
(embeddings, attention, MLP or the activated experts of a MoE layer), because `config.json` does
not carry it; `num_params` overrides either.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvfleet_runtime.breakeven.profiles import MLAShape, ModelProfile
from kvfleet_runtime.model.architectures import parse_hf_config


def _int_field(config: dict[str, Any], name: str, path: Path, default: int | None = None) -> int:
    value = config.get(name, default)
    if value is None:
        raise ValueError(f"{path}: missing field {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{path}: field {name!r} must be a positive integer, got {value!r}")
    return value


def load_hf_config(path: Path, num_params: float | None = None) -> ModelProfile:
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read model config {path}: {exc.strerror or exc}") from exc
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    # Multimodal configs nest the language model's config.
    if "text_config" in config and "num_hidden_layers" not in config:
        config = config["text_config"]
        if not isinstance(config, dict):
            raise ValueError(f"{path}: field 'text_config' must be an object")

    if num_params is not None and (not math.isfinite(num_params) or num_params <= 0):
        raise ValueError(f"parameter count must be positive, got {num_params!r}")
    try:
        served = parse_hf_config(config)
    except ValueError:
        served = None  # not an architecture the replica serves: plan from the shapes
    if served is not None:
        return ModelProfile(
            name=str(config.get("_name_or_path") or config.get("model_type")
                     or path.parent.name),
            num_layers=served.n_layers,
            num_kv_heads=served.n_kv_heads,
            head_dim=served.head_dim,
            num_params=float(num_params if num_params is not None else served.num_params),
            mla=None,
            description=f"read from {path} ({served.architecture})",
        )
    num_layers = _int_field(config, "num_hidden_layers", path)
    hidden = _int_field(config, "hidden_size", path)
    num_heads = _int_field(config, "num_attention_heads", path)
    num_kv_heads = _int_field(config, "num_key_value_heads", path, default=num_heads)
    head_dim = _int_field(config, "head_dim", path, default=hidden // num_heads or None)
    mla: MLAShape | None = None
    if "kv_lora_rank" in config and config["kv_lora_rank"] is not None:
        mla = MLAShape(
            _int_field(config, "kv_lora_rank", path),
            _int_field(config, "qk_rope_head_dim", path),
        )
    if num_params is None:
        num_params = _estimate_activated_params(
            config, path, hidden, num_heads, num_kv_heads, head_dim, num_layers, mla
        )
    elif not math.isfinite(num_params) or num_params <= 0:
        raise ValueError(f"parameter count must be positive, got {num_params!r}")
    name = str(config.get("_name_or_path") or config.get("model_type") or path.parent.name)
    return ModelProfile(
        name=name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_params=float(num_params),
        mla=mla,
        description=f"read from {path}",
    )


def _estimate_activated_params(
    config: dict[str, Any],
    path: Path,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int,
    mla: MLAShape | None,
) -> float:
    vocab = _int_field(config, "vocab_size", path)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)

    if mla is None:
        attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    else:
        nope = _int_field(config, "qk_nope_head_dim", path)
        v_dim = _int_field(config, "v_head_dim", path)
        q_rank = config.get("q_lora_rank")
        q_dim = num_heads * (nope + mla.qk_rope_head_dim)
        q_proj = hidden * q_dim if not q_rank else hidden * q_rank + q_rank * q_dim
        kv_proj = hidden * mla.elements_per_layer + mla.kv_lora_rank * num_heads * (nope + v_dim)
        attention = q_proj + kv_proj + num_heads * v_dim * hidden

    intermediate = _int_field(config, "intermediate_size", path)
    dense_mlp = 3 * hidden * intermediate
    num_experts = config.get("n_routed_experts") or config.get("num_local_experts")
    if not num_experts:
        mlp_total = dense_mlp * num_layers
    else:
        per_expert = (
            3 * hidden * _int_field(config, "moe_intermediate_size", path, default=intermediate)
        )
        active = _int_field(config, "num_experts_per_tok", path) + int(
            config.get("n_shared_experts") or 0
        )
        num_dense = int(config.get("first_k_dense_replace") or 0)
        moe_layer = active * per_expert + hidden * int(num_experts)  # + the router
        mlp_total = num_dense * dense_mlp + (num_layers - num_dense) * moe_layer

    return float(embeddings + num_layers * attention + mlp_total)
