"""The routing decision: tenant affinity with a headroom escape, and the cache-aware override.

    homes = rendezvous_top_k(tenant, ready replicas, k)
    base  = first home with kv_occupancy < threshold, else the least loaded ready replica (a spill)
    warm  = the replica under the threshold with the largest margin
            (matched[r] - matched[base]) x recompute_s_per_token - extra_queue_delay(r, base)
    choose warm when its margin is > 0, else base

Why each guard:
- Only replicas under the occupancy threshold may win the override, so a warm but hot replica
  cannot attract the traffic that makes it hotter (the "death spiral" onto one worker).
- Spilling is per tenant: a hot replica sends away only the tenants whose homes are all hot; every
  other tenant keeps its affinity (no fleet-wide fallback to load balancing).
- Every tie is broken by the replica name, never by input order, time or randomness, so every
  router replica given the same inputs makes the same choice.

Pure: no I/O, no clock. The router feeds it the loads it last saw plus the requests it has in
flight itself, which keeps a burst from landing on one replica between two load reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvfleet_runtime.affinity.rendezvous import rendezvous_rank, rendezvous_top_k

__all__ = ["ReplicaLoad", "RouteDecision", "RouteReason", "choose_replica", "least_loaded"]

RouteReason = Literal["home", "spill", "warm"]


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """What the router knows about one replica at decision time."""

    name: str
    kv_occupancy: float
    """Fraction of the replica's KV capacity in use, 0..1."""
    queue_delay_s: float = 0.0
    """Estimated wait before a new request starts prefill on this replica."""
    ready: bool = True


@dataclass(slots=True, frozen=True)
class RouteDecision:
    replica: str
    reason: RouteReason
    homes: tuple[str, ...]
    matched_tokens: int = 0
    """Hinted prefix tokens already held by the chosen replica (0 when unknown)."""
    saving_s: float = 0.0
    """For `warm`: recompute time saved minus extra queueing, which made the override win."""


def _load_key(load: ReplicaLoad) -> tuple[float, float, str]:
    return (load.kv_occupancy, load.queue_delay_s, load.name)


def least_loaded(loads: Sequence[ReplicaLoad]) -> ReplicaLoad | None:
    """Lowest occupancy, then shortest queue, then name; `None` when no replica is ready."""
    ready = [load for load in loads if load.ready]
    return min(ready, key=_load_key) if ready else None


def choose_replica(
    tenant_id: str,
    loads: Sequence[ReplicaLoad],
    *,
    k: int,
    occupancy_threshold: float,
    home_set: Sequence[str] | None = None,
    matched_tokens: Mapping[str, int] | None = None,
    recompute_s_per_token: float | None = None,
) -> RouteDecision | None:
    """Pick the replica for one request of `tenant_id`; `None` when no replica is ready.

    `home_set` is the operator-published home set (used as given; homes that are not ready are
    replaced by the tenant's next rendezvous choices); without it the homes are computed by
    rendezvous over the ready replicas. `matched_tokens`
    maps replica name -> hinted prefix tokens it holds for this prompt; the override is off when
    it or `recompute_s_per_token` is missing.
    """
    if not 0 < occupancy_threshold <= 1:
        raise ValueError(f"occupancy_threshold must be in (0, 1], got {occupancy_threshold}")
    by_name = {load.name: load for load in loads if load.ready}
    if not by_name:
        return None
    if home_set is not None:
        # Published homes that are not ready are replaced by the tenant's next rendezvous choices
        # among ready replicas, so one replica going away moves only its own tenants.
        kept = [r for r in home_set if r in by_name][:k]
        if len(kept) < k:  # ranking every replica is one hash each: only when homes are missing
            extra = [r for r in rendezvous_rank(tenant_id, sorted(by_name)) if r not in kept]
            kept += extra[: k - len(kept)]
        homes = tuple(kept)
    else:
        homes = tuple(rendezvous_top_k(tenant_id, sorted(by_name), k))
    matched = matched_tokens or {}

    base = next((by_name[r] for r in homes if by_name[r].kv_occupancy < occupancy_threshold), None)
    reason: RouteReason = "home"
    if base is None:
        spill = least_loaded(list(by_name.values()))
        assert spill is not None
        base, reason = spill, "spill"
    base_matched = matched.get(base.name, 0)

    if recompute_s_per_token is not None and matched:
        best: tuple[float, str] | None = None
        for name in sorted(matched):
            tokens = matched[name]
            load = by_name.get(name)
            if load is None or tokens <= base_matched or load.kv_occupancy >= occupancy_threshold:
                continue
            saving = (tokens - base_matched) * recompute_s_per_token
            extra_queue_delay = max(0.0, load.queue_delay_s - base.queue_delay_s)
            margin = saving - extra_queue_delay
            # Highest margin wins; names are visited in order, so a tie keeps the smaller name.
            if margin > 0 and (best is None or margin > best[0]):
                best = (margin, name)
        if best is not None:
            return RouteDecision(best[1], "warm", homes, matched[best[1]], best[0])
    return RouteDecision(base.name, reason, homes, base_matched)
