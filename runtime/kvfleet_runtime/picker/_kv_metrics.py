"""The router's Prometheus series for its KV event views (`picker._kv_events`), read from the
views at each scrape (pure: no sockets).

The views keep their own counts (the subscriber and `_kv_events` update them on the event loop,
where /metrics is answered too), so the series are a reading of them, not a second set of
counters to keep in step. A replica that leaves the fleet config is forgotten with its view:
its series end, and a replica that comes back counts from 0 again (a counter reset to
Prometheus' `rate`).

    kvfleet_router_kv_view_blocks{replica}                 vLLM blocks the view holds now
    kvfleet_router_kv_events_total{replica}                events applied
    kvfleet_router_kv_view_drops_total{replica,reason}     views dropped, by `DropReason`
    kvfleet_router_kv_unplaced_blocks_total{replica}       stored blocks left out of the view
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet_runtime.picker._kv_events import DropReason, KvEventViews

__all__ = ["DROP_REASONS", "KvEventCollector"]

DROP_REASONS: tuple[str, ...] = get_args(DropReason)


class KvEventCollector(Collector):
    """Series of the views `views()` returns (none while it returns None: not subscribed)."""

    def __init__(self, views: Callable[[], KvEventViews | None]) -> None:
        self.views = views

    def collect(self) -> Iterator[Metric]:
        views = self.views()
        blocks = GaugeMetricFamily(
            "kvfleet_router_kv_view_blocks",
            "vLLM blocks a replica's KV event view holds (its GPU prefix cache as its events "
            "describe it).", labels=["replica"])
        events = CounterMetricFamily(
            "kvfleet_router_kv_events", "KV events applied to a replica's view.",
            labels=["replica"])
        drops = CounterMetricFamily(
            "kvfleet_router_kv_view_drops",
            "Times a replica's view was dropped (it matches nothing until events rebuild it), "
            "by reason.", labels=["replica", "reason"])
        unplaced = CounterMetricFamily(
            "kvfleet_router_kv_unplaced_blocks",
            "Stored blocks left out of a replica's view (unknown parent, LoRA, extra keys, "
            "another tier or KV cache group).", labels=["replica"])
        if views is not None:
            for name, v in sorted(views.views.items()):
                blocks.add_metric([name], v.num_blocks)
                events.add_metric([name], v.num_events)
                unplaced.add_metric([name], v.num_unplaced_blocks)
                for reason in DROP_REASONS:
                    drops.add_metric([name, reason], v.drops[reason])
        yield from (blocks, events, drops, unplaced)
