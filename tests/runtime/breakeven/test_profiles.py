from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from kvfleet_runtime.breakeven import (
    GPUS,
    MODELS,
    KVDtype,
    ModelProfile,
    break_even_bandwidth,
    check_tp_degree,
    kv_bytes_per_token,
    load_hf_config,
    plan,
)


@pytest.mark.parametrize(
    ("dtype", "width"), [(KVDtype.FP32, 4), (KVDtype.BF16, 2), (KVDtype.FP16, 2), (KVDtype.FP8, 1)]
)
def test_kv_bytes_scale_with_dtype_width(dtype: KVDtype, width: int) -> None:
    assert kv_bytes_per_token(MODELS["reference-70b"], dtype) == 2 * 80 * 8 * 128 * width


def test_mla_latent_is_stored_once_for_k_and_v() -> None:
    # DeepSeek-V3: 61 layers x (512 + 64) x 2 bytes
    assert kv_bytes_per_token(MODELS["deepseek-v3"], KVDtype.BF16) == 61 * 576 * 2 == 70_272


def test_mla_makes_every_tier_but_object_storage_a_latency_win_at_tp4() -> None:
    result = plan(MODELS["deepseek-v3"], KVDtype.BF16, GPUS["h100"], 4, 2000)
    assert [t.helps_latency for t in result.tiers] == [True, True, True, True, False]


def test_llama_3_8b_profile() -> None:
    assert kv_bytes_per_token(MODELS["llama-3-8b"], KVDtype.BF16) == 128 * 1024


@pytest.mark.parametrize("tp", [3, 5, 16])
def test_tp_that_does_not_divide_kv_heads_is_refused_with_the_reason(tp: int) -> None:
    with pytest.raises(ValueError, match=rf"TP degree {tp} does not divide the 8 KV heads"):
        check_tp_degree(MODELS["reference-70b"], tp)


@pytest.mark.parametrize("bad", [0, -1])
def test_non_positive_tp_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        check_tp_degree(MODELS["reference-70b"], bad)


@pytest.mark.parametrize("params", [0.0, -1.0, math.nan, math.inf])
def test_bad_parameter_counts_are_refused(params: float) -> None:
    with pytest.raises(ValueError, match="num_params must be positive"):
        ModelProfile("x", 1, 1, 1, params)


def test_break_even_scales_linearly_with_gpu_flops() -> None:
    model = MODELS["llama-3-8b"]
    ratio = break_even_bandwidth(model, KVDtype.FP16, GPUS["b200"], 1) / break_even_bandwidth(
        model, KVDtype.FP16, GPUS["a100"], 1
    )
    assert ratio == pytest.approx(2250 / 312)


LLAMA_3_8B_CONFIG = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}

DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 129280,
}


def _write(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_hf_config_of_llama_3_8b(tmp_path: Path) -> None:
    model = load_hf_config(_write(tmp_path, LLAMA_3_8B_CONFIG))
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.mla) == (32, 8, 128, None)
    assert model.num_params == pytest.approx(8.03e9, rel=0.01)


def test_hf_config_of_deepseek_v3_reads_the_latent_and_activated_params(tmp_path: Path) -> None:
    model = load_hf_config(_write(tmp_path, DEEPSEEK_V3_CONFIG))
    assert model.mla is not None and model.mla.elements_per_layer == 576
    assert kv_bytes_per_token(model, KVDtype.BF16) == 70_272
    assert model.num_params == pytest.approx(37e9, rel=0.05)


def test_hf_config_params_override(tmp_path: Path) -> None:
    assert load_hf_config(_write(tmp_path, LLAMA_3_8B_CONFIG), num_params=8e9).num_params == 8e9


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"hidden_size": 64}), "missing field 'num_hidden_layers'"),
        (
            json.dumps({**LLAMA_3_8B_CONFIG, "num_hidden_layers": -2}),
            "'num_hidden_layers' must be a positive integer",
        ),
        (
            json.dumps({**LLAMA_3_8B_CONFIG, "num_key_value_heads": "8"}),
            "'num_key_value_heads' must be a positive integer",
        ),
    ],
)
def test_malformed_hf_config_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_hf_config(path)


def test_missing_hf_config_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read model config .*nope\.json"):
        load_hf_config(tmp_path / "nope.json")


def test_prefill_flops_counts_2n_per_token_plus_attention_by_position() -> None:
    from kvfleet_runtime.breakeven import MODELS, prefill_flops

    model = MODELS["reference-70b"]
    per_pair = 4 * 80 * 64 * 128  # QK^T and AV per layer, query head and head dim
    assert prefill_flops(model, 16) == 2 * 70e9 * 16 + per_pair * (16 * 17 // 2)
    # a block deep in a long prompt costs more to recompute than the prompt's first block
    first = prefill_flops(model, 16)
    deep = prefill_flops(model, 40_016, start=40_000)
    assert deep == prefill_flops(model, 40_016) - prefill_flops(model, 40_000)
    assert deep / first == pytest.approx(1 + per_pair * 40_008.5 / (2 * 70e9), rel=1e-3)
    no_attention = dataclasses.replace(model, num_q_heads=None)
    assert prefill_flops(no_attention, 40_016, start=40_000) == 2 * 70e9 * 16
    with pytest.raises(ValueError, match="need 0 <= start <= num_tokens, got 17 and 16"):
        prefill_flops(model, 16, start=17)
    with pytest.raises(ValueError, match="num_q_heads must be a positive integer, got 0"):
        dataclasses.replace(model, num_q_heads=0)
