"""The fleet's shadow-mode NVMe measurement (R6): replicas' read bandwidth per concurrency level,
aggregated at p95 concurrency, decides the tier; the status shows measured vs profile vs
break-even, the decision and why."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.api import KVCachePolicySpec
from kvfleet_operator.planning import aggregate_nvme, decide_tiers
from kvfleet_runtime.breakeven import GB
from kvfleet_runtime.nvme import BandwidthRecorder


def section(samples: list[tuple[int, int, float]]) -> dict[str, Any]:
    """A replica's `nvme.read_bandwidth` load-report section, made by the replica's recorder."""
    rec = BandwidthRecorder()
    for level, num_bytes, seconds in samples:
        rec.record(level, num_bytes, seconds)
    return {str(k): v for k, v in rec.snapshot().items()}


def test_p95_concurrency_and_per_read_bandwidth_over_the_fleet() -> None:
    # 100 reads: 90 alone at 10 GB/s, 6 at concurrency 4 (6 GB/s each), 4 at 8 (3 GB/s each).
    a = section([(1, 10 * GB, 1.0)] * 50 + [(4, 6 * GB, 1.0)] * 6)
    b = section([(1, 10 * GB, 1.0)] * 40 + [(8, 3 * GB, 1.0)] * 4)
    m = aggregate_nvme([a, b])
    assert m is not None
    # Cumulative share: 90% at level 1, 96% at level 4: p95 is 4, and its per-read figure rules.
    assert (m.p95_concurrency, m.num_reads, m.num_replicas) == (4, 100, 2)
    assert m.bytes_per_s == pytest.approx(6 * GB)
    assert m.source == "shadow: 2 replica(s), 100 reads, per-read bandwidth at p95 concurrency 4"


def test_nothing_measured_and_garbage_are_no_measurement() -> None:
    assert aggregate_nvme([]) is None
    assert aggregate_nvme([{}, {"1": {"num_reads": "x"}}]) is None
    good = section([(2, GB, 1.0)])
    m = aggregate_nvme([{"1": "garbage"}, good])
    assert m is not None and m.num_replicas == 1 and m.p95_concurrency == 2


def policy(**spec: Any) -> KVCachePolicySpec:
    return KVCachePolicySpec.model_validate({"selector": {"matchLabels": {"app": "llm"}}} | spec)


@pytest.mark.parametrize(
    ("gbps", "enabled", "reason"),
    [
        (12.0, True, "break-even 9.26 GB/s vs measured 12 GB/s: on"),
        (
            8.0,
            False,
            "break-even 9.26 GB/s vs measured 8 GB/s: off (capacity only: not for interactive)",
        ),
    ],
)
def test_the_measurement_crossing_the_break_even_flips_the_tier(
    gbps: float, enabled: bool, reason: str
) -> None:
    m = aggregate_nvme([section([(4, int(gbps * GB), 1.0)])])
    assert m is not None
    nvme = next(
        d
        for d in decide_tiers(policy(), {"nvme": m.bytes_per_s}, {"nvme": m.source}).decisions
        if d.tier == "nvme"
    )
    assert (nvme.enabled, nvme.reason) == (enabled, reason)
    assert nvme.profile_bytes_per_s == 7 * GB and nvme.measured_bytes_per_s == gbps * GB
    assert nvme.measurement.startswith("shadow: 1 replica(s)")


def test_the_spec_measurement_wins_over_the_fleets() -> None:
    spec = policy(tiers={"nvme": {"measuredBandwidthGBps": 6.1}})
    nvme = next(d for d in decide_tiers(spec, {"nvme": 20 * GB}).decisions if d.tier == "nvme")
    assert not nvme.enabled and nvme.measurement == "spec"
    assert nvme.measured_bytes_per_s == pytest.approx(6.1 * GB)
