"""No silent ignoring: each config the model cannot compute exactly is refused with a message that
names the field and its value (and the supported table, for architectures); the replica CLI says
so in one line without a traceback, and `kvfleet model inspect` agrees with
`kvfleet breakeven --model-config`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet_runtime.model import (
    ModelArgs,
    generate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
)
from kvfleet_runtime.model.architectures import ARCHITECTURES, parse_hf_config

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "dtype": "float32",
}


def with_(**change: Any) -> dict[str, Any]:
    return {**LLAMA, **change}


@pytest.mark.parametrize(("config", "message"), [
    (with_(architectures=["GraniteForCausalLM"], model_type="granite"),
     r"architecture 'GraniteForCausalLM' is not supported; supported: LlamaForCausalLM .*"
     r"MistralForCausalLM .*Qwen2ForCausalLM .*Qwen3ForCausalLM"),
    # A Llama-named config carrying Granite's multipliers: the extra field is named.
    (with_(embedding_multiplier=12.0),
     r"config field 'embedding_multiplier' = 12.0 is not understood for LlamaForCausalLM"),
    (with_(model_type="mistral"), r"model_type 'mistral' does not match architecture "
     r"LlamaForCausalLM"),
    (with_(architectures=["LlamaForCausalLM", "MistralForCausalLM"]),
     r"'architectures' must list exactly one"),
    ({k: v for k, v in LLAMA.items() if k != "architectures"} | {"model_type": "gemma"},
     r"model_type 'gemma' .* is not supported"),
    (with_(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                            "long_factor": [1.0]}),
     r"rope_type 'longrope' is not supported; supported: \['default', 'linear', 'dynamic', "
     r"'yarn', 'llama3'\]"),
    (with_(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                            "mrope_section": [4, 4]}),
     r"rope_type 'linear': parameter 'mrope_section' = \[4, 4\] is not understood"),
    (with_(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     r"rope_type 'llama3' needs the parameter 'high_freq_factor'"),
    (with_(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                            "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor 0.5 is not supported"),
    (with_(rope_scaling={"type": "linear", "rope_type": "dynamic", "factor": 2.0}),
     r"rope 'type' 'linear' contradicts 'rope_type' 'dynamic'"),
    (with_(hidden_act="gelu"), r"'hidden_act' = 'gelu' is not supported \(silu only\)"),
    (with_(quantization_config={"quant_method": "gptq"}),
     r"'quantization_config' .*quantized checkpoints are not supported"),
    (with_(auto_map={"AutoModelForCausalLM": "x.Y"}), r"remote code is never run"),
    (with_(text_config={}), r"'text_config': multimodal checkpoints are not supported"),
    (with_(attention_bias="yes"), r"'attention_bias' must be true or false, got 'yes'"),
    (with_(dtype="float8_e4m3fn"), r"'dtype' = 'float8_e4m3fn' is not a serving dtype"),
    (with_(num_attention_heads=3, head_dim=16), r"n_heads 3 is not a multiple of n_kv_heads 2"),
    ({**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
      "sliding_window": 0}, r"'sliding_window' must be a positive integer or null, got 0"),
    ({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"]},
     r"'layer_types' must list 'full_attention' or 'sliding_attention' for each of the 2 layers"),
    ({**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
      "layer_types": ["full_attention", "sliding_attention"]},
     r"config field 'layer_types' .* is not understood for MistralForCausalLM"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_refused_config_names_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hf_config(config)


def test_both_rope_styles_and_the_supported_table() -> None:
    t5 = parse_hf_config(with_(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}))
    t4 = parse_hf_config({**{k: v for k, v in LLAMA.items() if k != "rope_parameters"},
                          "rope_theta": 5e5,
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}})
    assert t4 == t5 and t5.rope_theta == 5e5
    assert t5.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert t4.rope_config_hash() != parse_hf_config(LLAMA).rope_config_hash()
    # transformers' defaults for omitted fields: Mistral's 4096 window, Llama's MHA
    mistral = parse_hf_config({**LLAMA, "architectures": ["MistralForCausalLM"],
                               "model_type": "mistral"})
    assert mistral.sliding_window == 4096
    assert parse_hf_config({k: v for k, v in LLAMA.items()
                            if k != "num_key_value_heads"}).n_kv_heads == 4
    assert set(ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                  "Qwen3ForCausalLM"}


def test_window_and_config_fields_change_the_cache_key() -> None:
    base = parse_hf_config({**LLAMA, "architectures": ["MistralForCausalLM"],
                            "model_type": "mistral", "sliding_window": 16})
    other = dataclasses.replace(base, sliding_window=32)
    eps = dataclasses.replace(base, norm_eps=1e-5)
    assert len({base.attn_impl_id(), other.attn_impl_id(), eps.attn_impl_id()}) == 3


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    out = tmp_path / "tiny"
    generate_checkpoint(out, ModelArgs.from_preset("tiny"))
    return out


def _rewrite_config(model_dir: Path, **change: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **change}))


def test_untied_checkpoint_without_lm_head_says_why(tiny: Path) -> None:
    state = load_file(str(tiny / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tiny / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lm_head\.weight is missing and tie_word_embeddings "
                                         r"is false"):
        load_checkpoint(tiny, device=torch.device("cpu"))
    _rewrite_config(tiny, tie_word_embeddings=True)
    assert load_checkpoint(tiny, device=torch.device("cpu")).args.tie_word_embeddings


def test_undeclared_attention_bias_says_why(tmp_path: Path) -> None:
    args = dataclasses.replace(ModelArgs.from_preset("tiny"), qkv_bias=True, o_bias=True)
    generate_checkpoint(tmp_path, args)
    assert load_checkpoint(tmp_path, device=torch.device("cpu")).args.qkv_bias
    _rewrite_config(tmp_path, attention_bias=False)
    with pytest.raises(ValueError, match=r"attention biases the config does not declare "
                                         r"\(attention_bias\).*q_proj.bias"):
        load_checkpoint(tmp_path, device=torch.device("cpu"))


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match=r"PyTorch \.bin weights only"):
        load_checkpoint(tmp_path, device=torch.device("cpu"))


def test_shape_mismatch_names_the_tensor(tiny: Path) -> None:
    _rewrite_config(tiny, intermediate_size=96)
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \[128, 64\], the config "
                                         r"implies \[96, 64\]"):
        load_checkpoint(tiny, device=torch.device("cpu"))


def kvfleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"})


def test_cli_replica_refuses_in_one_line_and_inspect_says_why(tiny: Path) -> None:
    _rewrite_config(tiny, architectures=["GraniteForCausalLM"], model_type="granite")
    result = kvfleet("replica", "--model-dir", str(tiny), "--device", "cpu")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: architecture 'GraniteForCausalLM' is not supported")
    inspected = kvfleet("model", "inspect", str(tiny), "--json")
    assert inspected.returncode == 1
    report = json.loads(inspected.stdout)
    assert report["supported"] is False and "GraniteForCausalLM" in report["reason"]


def test_inspect_agrees_with_breakeven(tmp_path: Path) -> None:
    args = dataclasses.replace(ModelArgs.from_preset("tiny"), qkv_bias=True, o_bias=True,
                               tie_word_embeddings=True, dtype="bfloat16")
    digest = generate_checkpoint(tmp_path, args)
    inspected = kvfleet("model", "inspect", str(tmp_path), "--json")
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report == report | {
        "architecture": "LlamaForCausalLM", "supported": True, "reason": None,
        "num_params": args.num_params, "checkpoint_dtype": "bfloat16",
        "serving_dtype": "bfloat16", "kv_bytes_per_token": 2 * 2 * 2 * 16 * 2,
        "weights_digest": digest, "num_files": 1}
    assert report == inspect_checkpoint(tmp_path).to_dict()
    planned = kvfleet("breakeven", "--model-config", str(tmp_path / "config.json"),
                      "--kv-dtype", "bf16", "--tp", "1", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["kv_bytes_per_token"] == report["kv_bytes_per_token"]
    # recompute costs 2N FLOPs per token: the planner's N is inspect's parameter count
    assert round(plan["recompute_s_per_token"] * plan["gpu_dense_flops"] / 2) == report[
        "num_params"]


# The config.json files of public checkpoints, complete and as published (transformers 4 style):
# every field they carry must be understood.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize(("config", "expect"), [
    (LLAMA_31_8B, dict(dtype="bfloat16", kv_bytes_per_token=131072, sliding_window=None,
                       rope_theta=500000.0, qkv_bias=False, tie_word_embeddings=False)),
    (MISTRAL_7B, dict(dtype="bfloat16", kv_bytes_per_token=131072, sliding_window=4096,
                      max_seq_len=32768)),
    (QWEN25_05B, dict(dtype="bfloat16", kv_bytes_per_token=12288, sliding_window=None,
                      qkv_bias=True, o_bias=False, tie_word_embeddings=True)),
    (QWEN3_06B, dict(dtype="bfloat16", kv_bytes_per_token=114688, qk_norm=True,
                     head_dim=128, tie_word_embeddings=True)),
], ids=["llama-3.1-8b", "mistral-7b", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_published_configs_are_read(config: dict[str, Any], expect: dict[str, Any]) -> None:
    args = parse_hf_config(config)
    assert {k: getattr(args, k) for k in expect} == expect
    # parameter counts as published: 8.03B, 7.24B, 0.49B, 0.60B (0.44B without the embedding)
    published = {"LlamaForCausalLM": 8.03e9, "MistralForCausalLM": 7.24e9,
                 "Qwen2ForCausalLM": 0.494e9, "Qwen3ForCausalLM": 0.596e9}
    assert args.num_params == pytest.approx(published[args.architecture], rel=0.005)
