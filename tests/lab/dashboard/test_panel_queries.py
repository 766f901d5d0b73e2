"""Every panel's every query of the chart's Grafana dashboard, run against a real Prometheus that
scrapes real replicas and a real router on loopback (kvfleet_lab.dashboard.live): each must
return data over the time the traffic ran (a range query, as the panels ask). The replicas run
T2 (peer probe) and T3, their homes fill so requests spill, and one replica's pod is named as a
ModelRollout's canary pods are, so every panel has something to show.

Shown to fail: with the fleet's T3 folder missing (the replica then serves without T3) the
"t3 (read from NVMe)" query returned no series; without the fleet tier's collector the T2 and
tier-verdict queries do not either."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator

import pytest

from kvfleet_lab.dashboard.live import LiveDashboard, panel_results
from kvfleet_lab.dashboard.panels import PANELS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDashboard]:
    with LiveDashboard(tmp_path_factory.mktemp("dashboard")) as running:
        assert running.drive() > 0
        yield running


@pytest.fixture(scope="module")
def results(live: LiveDashboard) -> dict[tuple[str, str], list[dict[str, object]]]:
    return panel_results(live)


@pytest.mark.parametrize(
    ("title", "legend"), [(p.title, t.legend) for p in PANELS for t in p.targets])
def test_every_query_returns_data(
    results: dict[tuple[str, str], list[dict[str, object]]], title: str, legend: str
) -> None:
    series = results[(title, legend)]
    assert series, f"{title} / {legend}: no series"
    values = [float(v) for s in series for _, v in s["values"]]  # type: ignore[attr-defined]
    assert any(math.isfinite(v) for v in values), f"{title} / {legend}: {values}"


def test_per_tenant_series_need_the_metrics_token(live: LiveDashboard) -> None:
    """The per-tenant panel shows data above because Prometheus presents the metrics token; an
    anonymous scrape of the same replica carries no tenant at all (docs/security.md)."""
    assert live.fleet is not None
    url = next(iter(live.fleet.replica_urls.values())) + "/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        anonymous = response.read().decode()
    assert "kvfleet_replica_prompt_tokens_total" in anonymous  # the fleet-wide series stay
    assert 'tenant="' not in anonymous and "kvfleet_cache_lookup_tokens_total" not in anonymous
    authorized = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {live.metrics_token}"})
    with urllib.request.urlopen(authorized, timeout=5) as response:
        assert 'tenant="' in response.read().decode()


def test_the_canary_and_the_baseline_are_told_apart(
    results: dict[tuple[str, str], list[dict[str, object]]]
) -> None:
    """The rollout panel's two sides are different pods: the canary query sums one replica."""
    (title,) = [p.title for p in PANELS if p.row == "Rollout"]
    assert results[(title, "canary")] and results[(title, "baseline")]
