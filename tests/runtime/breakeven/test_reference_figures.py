"""Every figure of docs/design.md §1 for the reference case, to the precision shown there."""

from __future__ import annotations

import pytest

from kvfleet_runtime.breakeven import (
    GB,
    GPUS,
    MODELS,
    KVDtype,
    Verdict,
    break_even_bandwidth,
    kv_bytes_per_token,
    plan,
    recompute_s_per_token,
)

REF = MODELS["reference-70b"]
H100 = GPUS["h100"]
MiB = 1024 * 1024


def test_kv_per_token_is_320_kib() -> None:
    assert kv_bytes_per_token(REF, KVDtype.FP16) == 327_680 == 320 * 1024


def test_kv_of_a_2000_token_prefix_is_625_mib() -> None:
    assert kv_bytes_per_token(REF, KVDtype.FP16) * 2000 == 625 * MiB


@pytest.mark.parametrize(
    ("tp", "recompute_us", "break_even_gbps"),
    [(1, 141.5, 2.32), (2, 70.7, 4.63), (4, 35.4, 9.26), (8, 17.7, 18.53)],
)
def test_recompute_and_break_even_by_tp(
    tp: int, recompute_us: float, break_even_gbps: float
) -> None:
    assert round(recompute_s_per_token(REF, H100, tp) * 1e6, 1) == recompute_us
    assert round(break_even_bandwidth(REF, KVDtype.FP16, H100, tp) / GB, 2) == break_even_gbps


def test_recompute_2000_tokens_on_tp4_is_70_7_ms() -> None:
    result = plan(REF, KVDtype.FP16, H100, 4, 2000)
    assert round(result.recompute_prefix_s * 1e3, 1) == 70.7
    assert round(result.recompute_prefix_s * 1e3) == 71
    # R1: 71 ms x 4 GPUs; the design's 284 GPU-ms multiplies the rounded 71 ms.
    assert round(result.recompute_prefix_gpu_s * 1e3) == 283


def test_fp8_kv_halves_the_tp4_break_even() -> None:
    assert round(break_even_bandwidth(REF, KVDtype.FP8, H100, 4) / GB, 2) == 4.63


def test_prefix_length_cancels() -> None:
    short = plan(REF, KVDtype.FP16, H100, 4, 100)
    long = plan(REF, KVDtype.FP16, H100, 4, 20_000)
    assert short.break_even_bytes_per_s == long.break_even_bytes_per_s
    assert [t.verdict for t in short.tiers] == [t.verdict for t in long.tiers]


# (medium, fetch of 2,000 tokens in ms at the design's precision, margin, verdict)
MEDIA_TABLE = [
    ("hbm", 0.2, 1, 360, 2, Verdict.BUILD),
    ("dram-pcie5", 10, 0, 6.9, 1, Verdict.BUILD),
    ("rdma-200g", 26, 0, 2.7, 1, Verdict.BUILD),
    ("nvme-gen4", 94, 0, 0.76, 2, Verdict.BATCH_ONLY),
    ("object-storage", 655, 0, 0.11, 2, Verdict.NEVER),
]


@pytest.mark.parametrize(
    ("medium", "fetch_ms", "fetch_digits", "margin", "margin_digits", "verdict"), MEDIA_TABLE
)
def test_media_against_the_tp4_break_even(
    medium: str,
    fetch_ms: float,
    fetch_digits: int,
    margin: float,
    margin_digits: int,
    verdict: Verdict,
) -> None:
    tier = plan(REF, KVDtype.FP16, H100, 4, 2000).tier(medium)
    assert round(tier.fetch_s * 1e3, fetch_digits) == fetch_ms
    if margin >= 100:
        assert round(tier.margin, -1) == margin
    else:
        assert round(tier.margin, margin_digits) == margin
    assert tier.verdict is verdict


def test_media_bandwidths_are_the_designs() -> None:
    result = plan(REF, KVDtype.FP16, H100, 4, 2000)
    assert [t.medium.bandwidth_bytes_per_s / GB for t in result.tiers] == [3350, 64, 25, 7, 1]


def test_tp8_leaves_200gbe_only_1_35x_clear() -> None:
    assert round(plan(REF, KVDtype.FP16, H100, 8, 2000).tier("rdma-200g").margin, 2) == 1.35


def test_capacity_rule_keeps_nvme_for_batch_only() -> None:
    nvme = plan(REF, KVDtype.FP16, H100, 4, 2000).tier("nvme-gen4")
    assert not nvme.helps_latency
    assert nvme.helps_capacity
    assert nvme.fetch_gpu_s < nvme.recompute_gpu_s


def test_levers_match_the_design() -> None:
    levers = {lever.name: lever for lever in plan(REF, KVDtype.FP16, H100, 4, 2000).levers}
    assert levers["fp8-kv"].break_even_ratio == pytest.approx(0.5)
    assert ("nvme-gen4", Verdict.BATCH_ONLY, Verdict.BUILD) in levers["fp8-kv"].flips
    assert levers["tp-x2"].break_even_ratio == pytest.approx(2.0)
    assert round(levers["tp-x2"].break_even_bytes_per_s / GB, 2) == 18.53
    assert levers["mla"].break_even_ratio < 0.5
