"""The fleet tier (T2): global hint index, hint publishing, and authenticated peer KV transfer
(T2: `t2_protocol` the format both sides share, `t2_serve` the peer routes, `t2_fetch` the fetcher).

    index = RedisHintIndex.from_url(url) if url else EmbeddedHintIndex()
    # or a Redis Cluster: RedisClusterHintIndex.from_urls([seed, ...])
    # or, no Redis but the peers are known: PeerProbeHintIndex(secret, peers, self_host)
    publisher = HintPublisher(index, host=replica_name); publisher.start()
    fetcher = PeerFetcher(secret, index, self_host=replica_name)
    app.add_routes(peer_routes(CacheBlockSource(cache), secret))

Every failure here degrades to recompute: a lookup that cannot answer says "nobody", a fetch that
fails for any reason returns None, a publish that fails is dropped.

Torch-free except `CacheBlockSource` (module `t2_source`, T2's serving side), `PeerTier` (module
`peer_tier`, T2 as a tier below the cache: the engine's prepare asks it), and `FleetSettings` and
`hint_index_for` (module `fleet_tier`, beside `FleetTier`: a replica's fleet settings from its
environment, and the hint index they choose; the vLLM connector reads the same), which load on
first use so that the router can import the hint index without pulling torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet_runtime._lazy import lazy_exports
from kvfleet_runtime.fleet.hint_index import (
    DEFAULT_TTL_S,
    EmbeddedHintIndex,
    HintIndex,
    HintIndexStats,
    RedisClusterHintIndex,
    RedisHintIndex,
    best_peer,
    leading_runs,
)
from kvfleet_runtime.fleet.probe import DEFAULT_PROBE_BUDGET_S, PeerProbeHintIndex
from kvfleet_runtime.fleet.publisher import HintPublisher, PublisherStats
from kvfleet_runtime.fleet.t2_fetch import FetchedRun, FetchOutcome, FetchStats, PeerFetcher
from kvfleet_runtime.fleet.t2_protocol import (
    MAX_PROBE_BLOCKS,
    PeerSecrets,
    WireOrder,
    chunk_axes,
    peer_token,
)
from kvfleet_runtime.fleet.t2_serve import BlockSource, ExportedRun, peer_routes

if TYPE_CHECKING:
    from kvfleet_runtime.fleet.fleet_tier import FleetSettings, hint_index_for
    from kvfleet_runtime.fleet.peer_tier import PeerTier
    from kvfleet_runtime.fleet.t2_source import CacheBlockSource

__all__ = [
    "DEFAULT_PROBE_BUDGET_S",
    "DEFAULT_TTL_S",
    "MAX_PROBE_BLOCKS",
    "BlockSource",
    "CacheBlockSource",
    "EmbeddedHintIndex",
    "ExportedRun",
    "FetchOutcome",
    "FetchStats",
    "FetchedRun",
    "FleetSettings",
    "HintIndex",
    "HintIndexStats",
    "HintPublisher",
    "PeerFetcher",
    "PeerProbeHintIndex",
    "PeerSecrets",
    "PeerTier",
    "PublisherStats",
    "RedisClusterHintIndex",
    "RedisHintIndex",
    "WireOrder",
    "best_peer",
    "chunk_axes",
    "hint_index_for",
    "leading_runs",
    "peer_routes",
    "peer_token",
]

_TORCH_EXPORTS = {"CacheBlockSource": "t2_source", "PeerTier": "peer_tier",
                  "FleetSettings": "fleet_tier", "hint_index_for": "fleet_tier"}

# Deferred so that the router (which imports the index) never pulls torch.
__getattr__ = lazy_exports(__name__, _TORCH_EXPORTS, globals())
