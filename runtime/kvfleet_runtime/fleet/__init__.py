"""The fleet tier (T2): global hint index, hint publishing, and authenticated peer KV transfer.

    index = RedisHintIndex.from_url(url) if url else EmbeddedHintIndex()
    # or, no Redis but the peers are known: PeerProbeHintIndex(secret, peers, self_host)
    publisher = HintPublisher(index, host=replica_name); publisher.start()
    fetcher = PeerFetcher(session, secret, index, self_host=replica_name)
    app.add_routes(peer_routes(CacheBlockSource(cache), secret))

Every failure here degrades to recompute: a lookup that cannot answer says "nobody", a fetch that
fails for any reason returns None, a publish that fails is dropped.

Torch-free except `CacheBlockSource` and `PeerTier` (module `replica`), which load on first use
so that the router can import the hint index without pulling torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet_runtime.fleet.index import (
    DEFAULT_TTL_S,
    EmbeddedHintIndex,
    HintIndex,
    HintIndexStats,
    RedisHintIndex,
    best_peer,
    leading_runs,
)
from kvfleet_runtime.fleet.probe import DEFAULT_PROBE_BUDGET_S, PeerProbeHintIndex
from kvfleet_runtime.fleet.publisher import HintPublisher, PublisherStats
from kvfleet_runtime.fleet.transfer import (
    MAX_PROBE_BLOCKS,
    BlockSource,
    ExportedRun,
    FetchedRun,
    FetchStats,
    PeerFetcher,
    peer_routes,
    peer_token,
)

if TYPE_CHECKING:
    from kvfleet_runtime.fleet.replica import CacheBlockSource, PeerTier

__all__ = [
    "DEFAULT_PROBE_BUDGET_S",
    "DEFAULT_TTL_S",
    "MAX_PROBE_BLOCKS",
    "BlockSource",
    "CacheBlockSource",
    "EmbeddedHintIndex",
    "ExportedRun",
    "FetchStats",
    "FetchedRun",
    "HintIndex",
    "HintIndexStats",
    "HintPublisher",
    "PeerFetcher",
    "PeerProbeHintIndex",
    "PeerTier",
    "PublisherStats",
    "RedisHintIndex",
    "best_peer",
    "leading_runs",
    "peer_routes",
    "peer_token",
]

_TORCH_EXPORTS = {"CacheBlockSource", "PeerTier"}


def __getattr__(name: str) -> Any:
    # Deferred so that the router (which imports the index) never pulls torch.
    if name not in _TORCH_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvfleet_runtime.fleet import replica

    value = getattr(replica, name)
    globals()[name] = value
    return value
