"""Prometheus view of the fleet tier, built at scrape time (nothing on the fetch path): the T2
fetches this replica made and the tiers the fleet config turned on.

    kvfleet_t2_fetches_total{outcome}     every fetch asked, by how it ended (`FetchOutcome`)
    kvfleet_t2_fetched_bytes_total        KV bytes landed from peers
    kvfleet_t2_fetched_blocks_total       blocks landed from peers
    kvfleet_t2_fetch_seconds              transfer time of each landed run (histogram)
    kvfleet_replica_tier_enabled{tier}    1 where the published break-even decision (the
                                          operator's `KVCachePolicy` status) turned the tier on
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvfleet_runtime.config.fleet import TierToggles
from kvfleet_runtime.fleet.t2_fetch import FETCH_SECONDS_BUCKETS, FetchStats

__all__ = ["FleetTierCollector"]

# The tier names of the dashboards and the demo (T0..T3), for the fleet config's toggles.
_TIER_TOGGLES = (("t0", "t0_device"), ("t1", "t1_host"), ("t2", "t2_peer"), ("t3", "nvme"))


class FleetTierCollector(Collector):
    """`snapshot()` -> (the fetcher's stats, None before the tier started; the toggles in force)."""

    def __init__(self, snapshot: Callable[[], tuple[FetchStats | None, TierToggles]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats, toggles = self._snapshot()
        stats = stats if stats is not None else FetchStats()
        fetches = CounterMetricFamily("kvfleet_t2_fetches", "T2 fetches asked, by outcome.",
                                      labels=["outcome"])
        for outcome, count in sorted(stats.outcomes.items()):
            fetches.add_metric([outcome.value], count)
        yield fetches
        yield CounterMetricFamily("kvfleet_t2_fetched_bytes", "KV bytes landed from peers.",
                                  value=stats.bytes_fetched)
        yield CounterMetricFamily("kvfleet_t2_fetched_blocks", "Blocks landed from peers.",
                                  value=stats.blocks_fetched)
        cumulative, buckets = 0, []
        edges = (*(str(edge) for edge in FETCH_SECONDS_BUCKETS), "+Inf")
        for edge, count in zip(edges, stats.fetch_seconds_counts, strict=True):
            cumulative += count
            buckets.append((edge, cumulative))
        hist = HistogramMetricFamily("kvfleet_t2_fetch_seconds",
                                     "Transfer time of each run landed from a peer.")
        hist.add_metric([], buckets, sum_value=stats.fetch_seconds_sum)
        yield hist
        enabled = GaugeMetricFamily("kvfleet_replica_tier_enabled",
                                    "1 where the fleet config (the break-even decision) turns "
                                    "the tier on.", labels=["tier"])
        for tier, toggle in _TIER_TOGGLES:
            enabled.add_metric([tier], 1.0 if getattr(toggles, toggle) else 0.0)
        yield enabled
