"""The tier decision: the break-even arithmetic (docs/design.md §1) and measured bandwidth (R6)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.api import KVCachePolicySpec
from kvfleet_operator.planning import decide_tiers
from kvfleet_runtime.breakeven import GB


def policy(**spec: Any) -> KVCachePolicySpec:
    return KVCachePolicySpec.model_validate({"selector": {"matchLabels": {"app": "llm"}}} | spec)


def test_reference_fleet_builds_t0_t1_t2_and_not_nvme() -> None:
    result = decide_tiers(policy())
    assert result.break_even_bytes_per_s == pytest.approx(9.26e9, rel=1e-3)
    assert result.summary == "device,host,peer"
    reasons = {d.tier: d.reason for d in result.decisions}
    assert reasons == {
        "device": "break-even 9.26 GB/s vs hbm profile 3,350 GB/s: on",
        "host": "break-even 9.26 GB/s vs dram-pcie5 profile 64 GB/s: on",
        "peer": "break-even 9.26 GB/s vs rdma-200g profile 25 GB/s: on",
        "nvme": "break-even 9.26 GB/s vs nvme-gen4 profile 7 GB/s: off "
        "(capacity only: not for interactive)",
    }
    toggles = result.toggles
    assert (toggles.t0_device, toggles.t1_host, toggles.t2_peer, toggles.nvme) == (
        True,
        True,
        True,
        False,
    )
    assert toggles.nvme_shadow is True
    assert result.recompute_s_per_token == pytest.approx(35.4e-6, rel=1e-2)


@pytest.mark.parametrize(
    ("spec", "measured", "enabled", "reason"),
    [
        (
            {"tiers": {"nvme": {"measuredBandwidthGBps": 6.1}}},
            None,
            False,
            "break-even 9.26 GB/s vs measured 6.1 GB/s: off (capacity only: not for interactive)",
        ),
        (
            {"tiers": {"nvme": {"measuredBandwidthGBps": 12}}},
            None,
            True,
            "break-even 9.26 GB/s vs measured 12 GB/s: on",
        ),
        ({}, {"nvme": 10 * GB}, True, "break-even 9.26 GB/s vs measured 10 GB/s: on"),
        (
            {"tiers": {"nvme": {"measuredBandwidthGBps": 6.1}}},
            {"nvme": 10 * GB},
            False,
            "break-even 9.26 GB/s vs measured 6.1 GB/s: off (capacity only: not for interactive)",
        ),
        (
            {"fleet": "Batch"},
            None,
            True,
            "break-even 9.26 GB/s vs nvme-gen4 profile 7 GB/s: on (capacity only: batch fleet)",
        ),
        (
            {"model": {"kvDtype": "fp8"}},
            None,
            True,
            "break-even 4.63 GB/s vs nvme-gen4 profile 7 GB/s: on",
        ),
        ({"tiers": {"nvme": {"mode": "Enabled"}}}, None, True, "Enabled by spec"),
        (
            {"tiers": {"nvme": {"mode": "Auto", "medium": "object-storage"}, "fleet": "Batch"}},
            None,
            False,
            "break-even 9.26 GB/s vs object-storage profile 1 GB/s: off",
        ),
    ],
)
def test_nvme_decision(
    spec: dict[str, Any], measured: dict[str, float] | None, enabled: bool, reason: str
) -> None:
    if "fleet" in spec.get("tiers", {}):
        spec = {"tiers": {"nvme": spec["tiers"]["nvme"]}, "fleet": spec["tiers"]["fleet"]}
    decision = decide_tiers(policy(**spec), measured).decisions[3]
    assert (decision.tier, decision.enabled, decision.reason) == ("nvme", enabled, reason)


def test_disabled_tier_is_off_whatever_the_arithmetic() -> None:
    result = decide_tiers(policy(tiers={"host": {"mode": "Disabled"}}))
    assert result.toggles.t1_host is False
    assert result.decisions[1].reason == "Disabled by spec"


def test_tp8_raises_the_break_even_and_turns_peer_rdma_100g_off() -> None:
    result = decide_tiers(policy(model={"tpDegree": 8}, tiers={"peer": {"medium": "rdma-100g"}}))
    assert result.break_even_bytes_per_s == pytest.approx(18.53e9, rel=1e-3)
    assert result.decisions[2].enabled is False


def test_impossible_tp_degree_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="TP degree 3"):
        decide_tiers(policy(model={"tpDegree": 3}))
