"""Which Hugging Face checkpoints kvfleet serves, and what their `config.json` means.

Torch-free on purpose: the replica's loader, `kvfleet model inspect` and the planner
(`kvfleet breakeven --model-config`, imported by the operator) read a config through the same
`parse_hf_config`, so the three agree on the architecture, the KV bytes per token and the
parameter count.

No silent ignoring. `parse_hf_config` honours every field that changes what the model computes,
or raises a ValueError naming the field and its value. A field it does not know is refused as well
(it might change the computation); the fields known not to matter for inference (token ids,
training-only knobs, bookkeeping) are listed in `_INERT_FIELDS`. `architectures` and `model_type`
are checked against `ARCHITECTURES`; anything else is refused with that table in the message.

Both config styles are read: transformers 4 (`rope_theta`, `rope_scaling`) and transformers 5
(`rope_parameters`), with transformers 5's precedence (`rope_scaling` over `rope_parameters`, a
`rope_theta` inside the parameters over the top-level one). Missing fields take the defaults of
the transformers config class of that architecture, because that is what transformers computes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "ATTN_IMPLS",
    "DTYPE_ALIASES",
    "DTYPE_BYTES",
    "PRESETS",
    "ROPE_TYPES",
    "Architecture",
    "ModelArgs",
    "parse_dtype",
    "parse_hf_config",
    "supported_table",
]

ATTN_IMPLS = ("eager", "sdpa")
DEFAULT_HF_ATTN_IMPL = "sdpa"
"""The attention of a checkpoint whose config does not name one (`kvfleet_attn_impl`)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Serving dtypes (weights, activations and KV) and their element size."""

DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
                 "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16"}

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# Per rope type: the parameters it reads (each honoured; anything else in the dict is refused).
_ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}
_ROPE_REQUIRED: dict[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
    "yarn": frozenset(),
}


def parse_dtype(name: str) -> str:
    """`bf16`, `fp16`, `fp32` (or the torch names) -> the torch dtype name; ValueError otherwise."""
    dtype = DTYPE_ALIASES.get(str(name).lower())
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not supported; choose one of bf16, fp16, fp32")
    return dtype


@dataclass(slots=True, frozen=True)
class Architecture:
    """One supported `architectures` entry and how its config maps onto `ModelArgs`."""

    name: str
    model_type: str
    description: str
    qkv_bias: str | bool
    """True/False fixed by the architecture, or the config field that decides it."""
    o_bias: str | bool
    qk_norm: bool
    mlp_bias: str | bool
    window: str
    """How the sliding window is declared: "none", "mistral" (all layers) or "qwen" (per layer)."""
    defaults: Mapping[str, Any]
    """transformers' class defaults for the fields a config may omit."""
    fields: frozenset[str]
    """Architecture-specific fields that are read (beyond the common ones)."""


_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "rms_norm_eps": 1e-6,
}

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (
        Architecture(
            "LlamaForCausalLM", "llama",
            "Llama 2 / 3 / 3.1 / 3.2 (rope default, linear, dynamic, yarn, llama3)",
            qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=False,
            mlp_bias="mlp_bias", window="none",
            defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 2048},
            fields=frozenset({"attention_bias", "mlp_bias", "pretraining_tp"})),
        Architecture(
            "MistralForCausalLM", "mistral", "Mistral (sliding-window attention)",
            qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False, window="mistral",
            defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 4096 * 32,
                      "sliding_window": 4096, "num_key_value_heads": 8},
            fields=frozenset({"sliding_window"})),
        Architecture(
            "Qwen2ForCausalLM", "qwen2", "Qwen2 / Qwen2.5 (q/k/v bias)",
            qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False, window="qwen",
            defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 32768,
                      "use_sliding_window": False, "sliding_window": 4096,
                      "max_window_layers": 28, "num_key_value_heads": 32},
            fields=frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                              "layer_types"})),
        Architecture(
            "Qwen3ForCausalLM", "qwen3", "Qwen3 dense (q/k RMSNorm)",
            qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, mlp_bias=False,
            window="qwen",
            defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "head_dim": 128,
                      "use_sliding_window": False, "sliding_window": 4096,
                      "max_window_layers": 28, "num_key_value_heads": 32},
            fields=frozenset({"attention_bias", "use_sliding_window", "sliding_window",
                              "max_window_layers", "layer_types"})),
    )
}

_SHAPE_FIELDS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "hidden_act",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "dtype",
    "torch_dtype", "architectures", "model_type", "kvfleet_attn_impl",
})

_INERT_FIELDS = frozenset({
    # bookkeeping and generation defaults (the tokenizer and generation config own token ids)
    "_name_or_path", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "use_cache", "id2label", "label2id",
    "output_attentions", "output_hidden_states", "return_dict", "problem_type",
    "is_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class", "task_specific_params",
    "torchscript", "finetuning_task", "prefix", "is_decoder", "add_cross_attention",
    "tf_legacy_loss", "use_bfloat16", "pruned_heads", "cross_attention_hidden_size",
    "output_scores", "return_dict_in_generate",
    # training only: no effect in an inference forward pass
    "initializer_range", "attention_dropout", "gradient_checkpointing",
})
"""Fields that never change what an inference forward pass computes."""

_REFUSED_HINTS = {
    "quantization_config": "quantized checkpoints are not supported",
    "auto_map": "remote code is never run (trust_remote_code)",
    "partial_rotary_factor": "partial rotary embeddings are not supported",
}


def supported_table() -> str:
    """The supported architectures, one per line (the refusal message carries it)."""
    return "; ".join(f"{a.name} (model_type {a.model_type!r}: {a.description})"
                     for a in ARCHITECTURES.values())


@dataclass(slots=True)
class ModelArgs:
    """Everything that decides what the model computes, in the model's own terms."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 259
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None for plain RoPE, else `{"rope_type": ..., <its parameters>}` (normalized)."""
    max_seq_len: int = 2048
    attn_impl: str = "eager"
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    """Keys further than this many positions back (counting the query) are not attended to."""
    sliding_layers: tuple[int, ...] | None = None
    """Layers the window applies to; None: every layer."""
    dtype: str = "float32"
    """Serving dtype: weights, activations and KV."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl {self.attn_impl!r} is not one of {ATTN_IMPLS}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    @classmethod
    def from_preset(cls, name: str) -> ModelArgs:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def window_of(self, layer: int) -> int | None:
        """The sliding window of one layer, or None (full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def num_params(self) -> int:
        """Exact parameter count of the checkpoint (tied embeddings counted once)."""
        d, hd = self.dim, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d
        attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
        mlp = 3 * d * self.intermediate_size
        mlp += (2 * self.intermediate_size + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * d
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * d + self.n_layers * per_layer + d

    def rope_config_hash(self) -> str:
        """SHA-256 of the canonical JSON of everything that decides the rotary embedding."""
        canonical = json.dumps(
            {"rope_theta": float(self.rope_theta), "rope_scaling": self.rope_scaling,
             "head_dim": self.head_dim},
            sort_keys=True, separators=(",", ":"),
        )
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    def attn_impl_id(self) -> str:
        """Names the attention arithmetic; bump the version when the computation changes.

        The suffix hashes what the weights digest does not cover but the KV depends on (the
        architecture, norm epsilon, biases, q/k norm, the sliding window and its layers): the same
        weights served under another config never share cache entries."""
        extra = json.dumps(
            {"architecture": self.architecture, "norm_eps": self.norm_eps,
             "qkv_bias": self.qkv_bias, "o_bias": self.o_bias, "mlp_bias": self.mlp_bias,
             "qk_norm": self.qk_norm, "sliding_window": self.sliding_window,
             "sliding_layers": self.sliding_layers},
            sort_keys=True, separators=(",", ":"),
        )
        # v2: prefill in large chunks (the engine appends its deterministic rule when it runs one)
        return f"{self.attn_impl}-v2-" + hashlib.sha256(extra.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor names -> shapes this config needs in the checkpoint."""
        d, hd, inter = self.dim, self.head_dim, self.intermediate_size
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, d),
                                            "model.norm.weight": (d,)}
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, d)
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (d,)
            out[p + "post_attention_layernorm.weight"] = (d,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                out[f"{p}self_attn.{name}.weight"] = (rows, d)
                if self.qkv_bias:
                    out[f"{p}self_attn.{name}.bias"] = (rows,)
            out[p + "self_attn.o_proj.weight"] = (d, q)
            if self.o_bias:
                out[p + "self_attn.o_proj.bias"] = (d,)
            if self.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (hd,)
                out[p + "self_attn.k_norm.weight"] = (hd,)
            for name, shape in (("gate_proj", (inter, d)), ("up_proj", (inter, d)),
                                ("down_proj", (d, inter))):
                out[f"{p}mlp.{name}.weight"] = shape
                if self.mlp_bias:
                    out[f"{p}mlp.{name}.bias"] = (shape[0],)
        return out


PRESETS: dict[str, dict[str, Any]] = {
    # Tests: as small as still exercises GQA (2 query heads per kv head) and 2 layers.
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
                 max_seq_len=2048),
    # Benchmarks and the demo: a few layers, 2,000-token prompts fit.
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
                  intermediate_size=688, max_seq_len=4096),
}


# ---- parsing -----------------------------------------------------------------------------------

def _pos_int(config: Mapping[str, Any], name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field {name!r} must be a positive integer, got {value!r}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"config field {name!r} must be a number, got {value!r}")
    return float(value)


def _flag(config: Mapping[str, Any], name: str) -> bool:
    value = config.get(name)
    if not isinstance(value, bool):
        raise ValueError(f"config field {name!r} must be true or false, got {value!r}")
    return value


def _architecture(config: Mapping[str, Any]) -> Architecture:
    names = config.get("architectures")
    model_type = config.get("model_type")
    if names is None:
        match = [a for a in ARCHITECTURES.values() if a.model_type == model_type]
        if not match:
            raise ValueError(f"model_type {model_type!r} (no 'architectures' field) is not "
                             f"supported; supported: {supported_table()}")
        return match[0]
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise ValueError(f"config field 'architectures' must list exactly one architecture, "
                         f"got {names!r}; supported: {supported_table()}")
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        raise ValueError(f"architecture {names[0]!r} is not supported; "
                         f"supported: {supported_table()}")
    if model_type is not None and model_type != arch.model_type:
        raise ValueError(f"model_type {model_type!r} does not match architecture {arch.name} "
                         f"(expects {arch.model_type!r}); supported: {supported_table()}")
    return arch


def _rope(config: Mapping[str, Any], max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized scaling) with transformers 5's precedence between the styles."""
    scaling = config.get("rope_scaling")
    parameters = config.get("rope_parameters")
    raw = scaling if scaling else parameters
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        which = "rope_scaling" if scaling else "rope_parameters"
        raise ValueError(f"config field {which!r} must be an object, got {raw!r}")
    params = dict(raw)
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    theta = _number(theta, "rope_theta")
    if theta <= 0:
        raise ValueError(f"config field 'rope_theta' must be positive, got {theta!r}")
    kind = params.pop("rope_type", None)
    legacy = params.pop("type", None)
    kind = kind if kind is not None else (legacy if legacy is not None else "default")
    if legacy is not None and legacy != kind:
        raise ValueError(f"rope 'type' {legacy!r} contradicts 'rope_type' {kind!r}")
    if kind not in _ROPE_KEYS:
        raise ValueError(f"rope_type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
        raise ValueError(f"rope partial_rotary_factor {params['partial_rotary_factor']!r} is "
                         "not supported (full rotary embeddings only)")
    params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - _ROPE_KEYS[kind])
    if unknown:
        raise ValueError(f"rope_type {kind!r}: parameter {unknown[0]!r} = "
                         f"{params[unknown[0]]!r} is not understood; it reads "
                         f"{sorted(_ROPE_KEYS[kind])}")
    missing = sorted(_ROPE_REQUIRED.get(kind, frozenset()) - set(params))
    if missing:
        raise ValueError(f"rope_type {kind!r} needs the parameter {missing[0]!r}")
    if kind == "default":
        return theta, None
    out: dict[str, Any] = {"rope_type": kind}
    for key, value in sorted(params.items()):
        if key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"rope parameter 'truncate' must be true or false, got {value!r}")
            out[key] = value
        elif key == "original_max_position_embeddings":
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"rope parameter {key!r} must be a positive integer, "
                                 f"got {value!r}")
            out[key] = value
        elif value is None and kind == "yarn":
            continue  # transformers reads a null yarn parameter as absent
        else:
            out[key] = _number(value, f"rope {key}")
    if kind in ("llama3", "yarn"):
        out.setdefault("original_max_position_embeddings", max_positions)
    if kind == "yarn" and "factor" not in out:
        out["factor"] = max_positions / out["original_max_position_embeddings"]
    if kind in ("linear", "dynamic", "llama3") and out["factor"] <= 0:
        raise ValueError(f"rope factor must be positive, got {out['factor']!r}")
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"rope high_freq_factor {out['high_freq_factor']!r} must exceed "
                         f"low_freq_factor {out['low_freq_factor']!r}")
    return theta, out


def _window(arch: Architecture, config: Mapping[str, Any], n_layers: int
            ) -> tuple[int | None, tuple[int, ...] | None]:
    if arch.window == "none":
        return None, None
    window = config.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):
        raise ValueError(f"config field 'sliding_window' must be a positive integer or null, "
                         f"got {window!r}")
    if arch.window == "mistral":
        return window, None
    if not _flag(config, "use_sliding_window"):
        window = None
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"config field 'max_window_layers' must be a non-negative integer, "
                             f"got {first!r}")
        layer_types = ["sliding_attention" if window is not None and i >= first
                       else "full_attention" for i in range(n_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != n_layers
            or any(t not in ("full_attention", "sliding_attention") for t in layer_types)):
        raise ValueError(f"config field 'layer_types' must list 'full_attention' or "
                         f"'sliding_attention' for each of the {n_layers} layers, "
                         f"got {layer_types!r}")
    if window is None:
        return None, None
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if not sliding:
        return None, None
    return window, (None if len(sliding) == n_layers else sliding)


def parse_hf_config(config: Mapping[str, Any], *, attn_impl: str | None = None,
                    dtype: str | None = None) -> ModelArgs:
    """A Hugging Face `config.json` (as a dict) -> ModelArgs, or ValueError naming the field.

    `dtype` (bf16/fp16/fp32) overrides the config's `dtype`/`torch_dtype` (the loader passes the
    checkpoint tensors' own dtype when no serving dtype was chosen)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a JSON object, got {type(config).__name__}")
    if "text_config" in config:
        raise ValueError("config field 'text_config': multimodal checkpoints are not supported; "
                         f"supported: {supported_table()}")
    arch = _architecture(config)
    merged: dict[str, Any] = {**arch.defaults, **config}  # an explicit null stays null
    known = _SHAPE_FIELDS | _INERT_FIELDS | arch.fields
    for key, value in config.items():
        if key in _REFUSED_HINTS:
            raise ValueError(f"config field {key!r} = {value!r}: {_REFUSED_HINTS[key]}")
        if key not in known and not key.startswith("kvfleet_"):
            raise ValueError(f"config field {key!r} = {value!r} is not understood for "
                             f"{arch.name}; it may change the computation, so the checkpoint is "
                             "refused rather than served approximately")
    if merged.get("hidden_act") != "silu":
        raise ValueError(f"config field 'hidden_act' = {merged.get('hidden_act')!r} is not "
                         "supported (silu only)")
    dim = _pos_int(merged, "hidden_size")
    n_heads = _pos_int(merged, "num_attention_heads")
    n_layers = _pos_int(merged, "num_hidden_layers")
    if merged.get("num_key_value_heads") is None:
        merged["num_key_value_heads"] = n_heads  # transformers: no KV head count means MHA
    head_dim = merged.get("head_dim")
    if head_dim is None:
        if dim % n_heads != 0:
            raise ValueError(f"hidden_size {dim} is not a multiple of num_attention_heads "
                             f"{n_heads} and no head_dim is given")
        merged["head_dim"] = dim // n_heads
    max_positions = _pos_int(merged, "max_position_embeddings")
    theta, scaling = _rope(config, max_positions)
    window, sliding_layers = _window(arch, merged, n_layers)
    eps = _number(merged.get("rms_norm_eps"), "rms_norm_eps")

    def decided(rule: str | bool) -> bool:
        return rule if isinstance(rule, bool) else _flag(merged, rule)

    if attn_impl is None:
        # A config that names none (any checkpoint transformers wrote) gets transformers' own
        # default: SDPA, whose CPU flash kernel prefills a 601-token prompt of the tiny preset
        # in a quarter of the eager arithmetic's time (masked scores, a float32 softmax).
        attn_impl = str(config.get("kvfleet_attn_impl", DEFAULT_HF_ATTN_IMPL))
    if dtype is None:
        raw_dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        try:
            dtype = parse_dtype(raw_dtype)
        except ValueError:
            raise ValueError(f"config field 'dtype' = {raw_dtype!r} is not a serving dtype; "
                             "choose one with --dtype (bf16, fp16, fp32)") from None
    return ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=_pos_int(merged, "num_key_value_heads"),
        head_dim=_pos_int(merged, "head_dim"),
        intermediate_size=_pos_int(merged, "intermediate_size"),
        vocab_size=_pos_int(merged, "vocab_size"),
        norm_eps=eps, rope_theta=theta, rope_scaling=scaling, max_seq_len=max_positions,
        attn_impl=attn_impl, architecture=arch.name,
        qkv_bias=decided(arch.qkv_bias), o_bias=decided(arch.o_bias),
        mlp_bias=decided(arch.mlp_bias), qk_norm=arch.qk_norm,
        tie_word_embeddings=_flag(merged, "tie_word_embeddings"),
        sliding_window=window, sliding_layers=sliding_layers, dtype=parse_dtype(dtype),
    )
