"""`kvfleet bench fronts`' pure parts with exact expectations: percentiles, a Prometheus
histogram's quantile, clients merged, repeats folded, the targets compared, the front table."""

from __future__ import annotations

import pytest

from kvfleet_lab.fronts.figures import (
    RunRow,
    comparison,
    histogram_quantile,
    medians,
    merge_clients,
    percentile,
)
from kvfleet_lab.fronts.table import FRONTS, select

HISTOGRAM = """# TYPE kvfleet_router_decision_seconds histogram
kvfleet_router_decision_seconds_bucket{le="0.001"} 50.0
kvfleet_router_decision_seconds_bucket{le="0.002"} 90.0
kvfleet_router_decision_seconds_bucket{le="0.005"} 100.0
kvfleet_router_decision_seconds_bucket{le="+Inf"} 100.0
kvfleet_router_decision_seconds_count 100.0
"""


def row(front: str, cached: float, ttft: float, tenants: int = 1, *,
        decision: float | None = None) -> RunRow:
    return RunRow(front, tenants, "prefix_repetition", 120, 0, 1000.0, cached, ttft, 2 * ttft,
                  50.0, None, decision)


def test_percentiles_are_numpys_linear_ones() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_histogram_quantile_interpolates_in_the_bucket_like_prometheus() -> None:
    assert histogram_quantile(HISTOGRAM, "kvfleet_router_decision_seconds", 0.5) == 0.001
    assert histogram_quantile(HISTOGRAM, "kvfleet_router_decision_seconds", 0.7) == \
        pytest.approx(0.0015)
    assert histogram_quantile(HISTOGRAM, "kvfleet_router_decision_seconds", 0.99) == \
        pytest.approx(0.0047)
    assert histogram_quantile(HISTOGRAM, "other_seconds", 0.5) is None


def test_clients_merge_over_every_request() -> None:
    a = {"completed": 2, "failed": 0, "ttfts": [0.010, 0.030], "output_throughput": 10.0}
    b = {"completed": 2, "failed": 1, "ttfts": [0.020, 0.040], "output_throughput": 5.0}
    merged = merge_clients([a, b])
    assert merged == {"completed": 4, "failed": 1, "ttft_p50_ms": pytest.approx(25.0),
                      "ttft_p99_ms": pytest.approx(39.7), "output_throughput": 15.0}
    with pytest.raises(ValueError):
        merge_clients([{"completed": 0, "ttfts": [], "output_throughput": 0.0}])


def test_repeats_fold_into_medians() -> None:
    folded = medians([row("x", 100, 30), row("x", 300, 10), row("x", 200, 20)])
    assert len(folded) == 1
    assert (folded[0].cached_tokens, folded[0].ttft_p50_ms) == (200, 20)


def test_the_comparison_takes_the_best_peer_for_each_target() -> None:
    rows = [row("kvfleet-router", 800, 45, decision=1.5), row("sglang-router-cache-aware", 700, 50),
            row("vllm-router-round-robin", 400, 60)]
    got = comparison(rows)["1 tenant(s) / prefix_repetition"]
    assert got["best_peer_cached"] == "sglang-router-cache-aware"
    assert got["cached_vs_best_peer"] == pytest.approx(800 / 700)
    assert got["ttft_p50_vs_best_peer"] == pytest.approx(0.9)
    assert got["targets_met"] == {"cached": True, "ttft_p50": True, "decision_p99": True}
    slower = comparison([row("kvfleet-router", 800, 46), *rows[1:]])
    assert slower["1 tenant(s) / prefix_repetition"]["targets_met"] == {
        "cached": True, "ttft_p50": False, "decision_p99": False}


def test_fronts_are_chosen_by_name_in_the_order_given() -> None:
    assert select(None) == tuple(FRONTS)
    assert select("sglang-router-cache-aware, kvfleet-router") == (
        "sglang-router-cache-aware", "kvfleet-router")
    with pytest.raises(ValueError, match="known: kvfleet-router"):
        select("nginx")
