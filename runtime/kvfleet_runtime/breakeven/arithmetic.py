"""The decisive arithmetic of the design (docs/design.md §1), as pure functions.

Fetching cached KV beats recomputing it when bytes / BW < 2N / FLOPS, so the break-even
bandwidth is kv_bytes_per_token x aggregate_FLOPS / (2N): the prefix length cancels.
"""

from __future__ import annotations

from kvfleet_runtime.breakeven.profiles import GpuProfile, KVDtype, ModelProfile

FLOPS_PER_PARAM_PER_TOKEN = 2


def kv_bytes_per_token(model: ModelProfile, kv_dtype: KVDtype) -> int:
    """Bytes of KV one token adds: 2 (K, V) x layers x kv_heads x head_dim x element width, or
    layers x latent width for an MLA model, whose one latent serves both K and V."""
    if model.mla is not None:
        return model.num_layers * model.mla.elements_per_layer * kv_dtype.bytes_per_element
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * kv_dtype.bytes_per_element


def check_tp_degree(model: ModelProfile, tp_degree: int) -> None:
    """KV is stored head-major and rank r of a TP-t replica takes heads h % t == r, so every rank
    must own the same whole number of heads. An MLA latent is not split by heads."""
    if not isinstance(tp_degree, int) or tp_degree <= 0:
        raise ValueError(f"TP degree must be a positive integer, got {tp_degree!r}")
    if model.mla is None and model.num_kv_heads % tp_degree != 0:
        raise ValueError(
            f"TP degree {tp_degree} does not divide the {model.num_kv_heads} KV heads of "
            f"{model.name}: each rank materializes heads h % {tp_degree} == rank, so the ranks "
            f"would hold unequal shares; use a divisor of {model.num_kv_heads}"
        )


def aggregate_flops(gpu: GpuProfile, tp_degree: int) -> float:
    return gpu.dense_flops * tp_degree


def recompute_s_per_token(model: ModelProfile, gpu: GpuProfile, tp_degree: int) -> float:
    return FLOPS_PER_PARAM_PER_TOKEN * model.num_params / aggregate_flops(gpu, tp_degree)


ATTENTION_FLOPS_PER_PAIR_PER_HEAD_DIM = 4
"""One query against one key, per layer, head and head dimension: a multiply-add in QK^T and one
in the weighted sum of V."""


def prefill_flops(model: ModelProfile, num_tokens: int, start: int = 0) -> float:
    """FLOPs of prefilling positions [start, num_tokens) of a prompt whose positions before
    `start` are cached: 2N per token (the dense layers) plus, when the profile has its query
    heads, attention, where the query at position p reads p + 1 keys. So a block deep in a long
    prompt costs more to recompute than one at its start (70B: +1.9% of 2N per 1,000 positions)."""
    if not 0 <= start <= num_tokens:
        raise ValueError(f"need 0 <= start <= num_tokens, got {start} and {num_tokens}")
    dense = FLOPS_PER_PARAM_PER_TOKEN * model.num_params * (num_tokens - start)
    if model.num_q_heads is None:
        return dense
    pairs = (num_tokens * (num_tokens + 1) - start * (start + 1)) // 2
    per_pair = (
        ATTENTION_FLOPS_PER_PAIR_PER_HEAD_DIM * model.num_layers * model.num_q_heads
        * model.head_dim
    )
    return dense + per_pair * pairs


def break_even_bandwidth(
    model: ModelProfile, kv_dtype: KVDtype, gpu: GpuProfile, tp_degree: int
) -> float:
    """Bytes/s at which fetching a prefix's KV takes as long as recomputing it."""
    return kv_bytes_per_token(model, kv_dtype) / recompute_s_per_token(model, gpu, tp_degree)


def fetch_s(num_bytes: float, bandwidth_bytes_per_s: float) -> float:
    return num_bytes / bandwidth_bytes_per_s
