"""Prometheus view of the cache stats, built at scrape time.

A collector rather than live counters: the lookup path then pays nothing for metrics, and every
scrape is a consistent snapshot. Each cache registers into the registry it is given, so tests and
several caches in one process never collide on the global default registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet_runtime.cache._stats import CacheStats

__all__ = ["CacheCollector"]

_TENANT_COUNTERS = (
    ("lookups", "num_lookups", "Prefix lookups."),
    ("hits", "num_hits", "Lookups that matched at least one block."),
    ("lookup_tokens", "num_lookup_tokens", "Tokens looked up."),
    ("matched_tokens", "num_matched_tokens", "Tokens served from the cache."),
    ("blocks_offered", "num_blocks_offered", "Full blocks passed to store."),
    ("blocks_stored", "num_blocks_stored", "Blocks written into the cache."),
    ("admissions_refused", "num_admissions_refused", "Blocks refused as not yet reused."),
    ("first_sighting_admissions", "num_first_sighting_admissions",
     "Blocks admitted at their first sighting."),
    ("store_drops", "num_store_drops", "Pending writes dropped from a full store queue."),
    ("evictions", "num_evictions", "Blocks dropped from the cache."),
    ("invalidated_blocks", "num_invalidated", "Blocks removed because their weights version "
     "was invalidated."),
)
_TIER_COUNTERS = (
    ("tier_stored_blocks", "num_stored", "Blocks written into the tier."),
    ("tier_evictions", "num_evictions", "Blocks dropped from the cache out of the tier."),
    ("tier_demotions", "num_demotions", "Blocks moved out of the tier into a colder one."),
    ("tier_promotions", "num_promotions", "Blocks moved out of the tier into a hotter one."),
)
_TIER_GAUGES = (
    ("tier_used_blocks", "num_blocks_used", "Blocks held in the tier."),
    ("tier_capacity_blocks", "num_blocks_capacity", "Capacity of the tier in blocks."),
    ("tier_pinned_blocks", "num_blocks_pinned", "Pinned blocks in the tier."),
    ("tier_used_bytes", "num_bytes_used", "KV bytes held in the tier."),
    ("tier_capacity_bytes", "num_bytes_capacity", "Capacity of the tier in bytes."),
)


class CacheCollector(Collector):
    def __init__(
        self, snapshot: Callable[[], tuple[CacheStats, dict[str, CacheStats]]], prefix: str
    ) -> None:
        self._snapshot = snapshot
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        total, per_tenant = self._snapshot()
        p = self._prefix
        for name, attr, doc in _TENANT_COUNTERS:
            family = CounterMetricFamily(f"{p}_{name}", doc, labels=["tenant"])
            for tenant, stats in sorted(per_tenant.items()):
                family.add_metric([tenant], getattr(stats.totals, attr))
            yield family
        blocks = GaugeMetricFamily(
            f"{p}_tenant_blocks", "Blocks resident per tenant.", labels=["tenant"]
        )
        for tenant, stats in sorted(per_tenant.items()):
            blocks.add_metric([tenant], stats.totals.num_blocks)
        yield blocks
        for name, attr, doc in _TIER_COUNTERS:
            family = CounterMetricFamily(f"{p}_{name}", doc, labels=["tier"])
            for tier in total.tiers:
                family.add_metric([tier.tier], getattr(tier, attr))
            yield family
        for name, attr, doc in _TIER_GAUGES:
            gauge = GaugeMetricFamily(f"{p}_{name}", doc, labels=["tier"])
            for tier in total.tiers:
                gauge.add_metric([tier.tier], getattr(tier, attr))
            yield gauge
        scalars: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, float], ...]
        scalars = (
            (GaugeMetricFamily, "thrashing", "1 while the thrash detector is engaged.",
             1.0 if total.thrashing else 0.0),
            (CounterMetricFamily, "thrash_episodes", "Times thrashing was detected.",
             total.num_thrash_episodes),
            (GaugeMetricFamily, "eviction_strictness",
             "Position of the followed eviction ranking in eviction_rankings (0: recency).",
             total.strictness),
            (CounterMetricFamily, "eviction_ranking_switches",
             "Times the ghosts moved the cache to another eviction ranking.",
             total.num_ranking_switches),
            (CounterMetricFamily, "ghost_hit_blocks",
             "Blocks the followed ranking's ghost held that the cache did not.",
             total.num_ghost_hit_blocks),
            (GaugeMetricFamily, "store_queue_entries", "Pending writes in the store queue.",
             total.store_queue_len),
            (GaugeMetricFamily, "indexed_blocks", "Blocks in the radix index.",
             total.num_indexed_blocks),
            (CounterMetricFamily, "hash_memo_hits",
             "Chain steps the hash memo answered without hashing.", total.num_memo_hits),
            (CounterMetricFamily, "hash_memo_misses", "Chain steps hashed.",
             total.num_memo_misses),
        )
        for kind, name, doc, value in scalars:
            yield kind(f"{p}_{name}", doc, value=value)
