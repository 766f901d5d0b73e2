"""`POST /cache/invalidate`: a weights version withdrawn from every local tier at once
(`invalidate_local`). The tiers themselves are asked by the engine's prepare
(`kvfleet_runtime.cache.LowerTier`, wired by `Replica.wire_tiers`), not by the HTTP layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet_runtime.server._state import Replica

__all__ = ["invalidate_local"]


def invalidate_local(replica: Replica, weights_digest: str) -> int:
    """Withdraw a weights version from T0/T1 and T3 (blocking: run it in a thread); returns the
    blocks removed from both. T3 goes first, so that a T3 load in flight cannot land it after
    the cache forgot it, and again after, for what T1 evicted into T3 meanwhile."""
    cache, tier = replica.cache, replica.nvme
    removed = 0 if tier is None else tier.invalidate(weights_digest)
    if cache is not None:
        removed += cache.invalidate(weights_digest)
    if tier is not None:
        removed += tier.invalidate(weights_digest)
    return removed
