"""The routing decision: tenant affinity with a headroom escape, prefixes spread over the homes,
and the cache-aware override.

    homes = rendezvous_top_k(tenant, ready replicas, k)        (or the published home set)
    open  = the homes with kv_occupancy < threshold
    base  = the home that owns this prompt's prefix: the first of `open` ranked by
            rendezvous(prefix_key, home) whose requests in flight stay within the load bound
            ceil(load_bound x (in flight over open + 1) / len(open)); without a prefix key
            (no ids, or a prompt shorter than one block) the first of `open`;
            no open home: the least loaded ready replica (a spill)
    warm  = the replica under the threshold, holding at least min_warm_fraction of the prompt,
            with the largest margin
            (matched[r] - matched[base]) x recompute_s_per_token - extra_queue_delay(r, base)
    choose warm when its margin is > 0, else base

Why each guard:
- A tenant's distinct prefixes are spread over its homes by a hash of the prefix, not all sent
  to its first home: one replica's KV may not hold them all (issue 42: one tenant, 12 prefixes
  of 1,024 tokens, 8,192 KV tokens per replica: the first home thrashed while the second stayed
  cold). The same prefix always has the same owner, so its requests meet its KV there; the load
  bound (consistent hashing with bounded loads, Mirrokni et al.) moves a prefix's overflow to the
  next home instead of queueing it.
- The override needs a real share of the prompt (`min_warm_fraction`): a replica that holds only
  a shared root (a system prompt every conversation starts with) would otherwise attract every
  new conversation and, turn after turn, the whole tenant onto one replica again.
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

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvfleet_runtime.affinity.rendezvous import rendezvous_rank, rendezvous_top_k

__all__ = ["LOAD_BOUND", "MIN_WARM_FRACTION", "PREFIX_KEY_TOKENS", "ReplicaLoad", "RouteDecision",
           "RouteReason", "choose_replica", "least_loaded", "owner_rank", "prefix_key"]

RouteReason = Literal["home", "spill", "warm"]

PREFIX_KEY_TOKENS = 256
"""A prompt's prefix, for its owner among the homes, is its first 256 tokens (whole 16-token
blocks): past a shared root of a conversation trace (128 tokens) and inside any long shared
document, so distinct prefixes get distinct owners and every request of one prefix the same."""
LOAD_BOUND = 1.25
"""A home owns a prefix's next request while its requests in flight stay within 1.25x the
homes' mean (plus the new one): Mirrokni, Thorup and Zadimoghaddam's bound, under which one
home gets at most 1.25x its share."""
MIN_WARM_FRACTION = 0.5
"""The override's least share of the prompt already held (sglang's and vllm-router's
`cache_threshold` default)."""
_BLOCK = 16


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """What the router knows about one replica at decision time."""

    name: str
    kv_occupancy: float
    """Fraction of the replica's KV capacity in use, 0..1."""
    queue_delay_s: float = 0.0
    """Estimated wait before a new request starts prefill on this replica."""
    ready: bool = True
    num_inflight: int = 0
    """Requests the router has there now (the load bound's count)."""


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


def prefix_key(tenant_id: str, token_ids: Sequence[int],
               num_tokens: int = PREFIX_KEY_TOKENS) -> bytes | None:
    """The identity of a prompt's prefix for its owner: the tenant and the first `num_tokens`
    ids, cut to whole 16-token blocks; None for a prompt shorter than one block (nothing of it
    is cached anywhere, so it goes to the first home)."""
    n = min(len(token_ids), num_tokens) // _BLOCK * _BLOCK
    if n == 0:
        return None
    h = hashlib.sha256(len(tenant_id).to_bytes(4, "big") + tenant_id.encode())
    # as decimal text: a client's ids may be any size (the replica refuses what it must)
    h.update(",".join(map(str, token_ids[:n])).encode())
    return h.digest()


def owner_rank(key: bytes, homes: Sequence[str]) -> list[str]:
    """`homes` ranked for the prefix `key`: rendezvous (highest weight first, ties by name), so
    a home joining or leaving moves only the prefixes it owns or takes."""
    def weight(home: str) -> tuple[int, str]:
        digest = hashlib.sha256(key + home.encode()).digest()
        return int.from_bytes(digest[:8], "big"), home
    return sorted(homes, key=weight, reverse=True)


def _owner(key: bytes, open_homes: Sequence[ReplicaLoad], load_bound: float) -> ReplicaLoad:
    """The first home in `key`'s rank whose requests in flight stay within the bound (one
    always does: they cannot all be at the cap, whose sum exceeds the total)."""
    total = sum(h.num_inflight for h in open_homes)
    cap = math.ceil(load_bound * (total + 1) / len(open_homes))
    by_name = {h.name: h for h in open_homes}
    ranked = [by_name[n] for n in owner_rank(key, list(by_name))]
    return next(h for h in ranked if h.num_inflight + 1 <= cap)


def choose_replica(
    tenant_id: str,
    loads: Sequence[ReplicaLoad],
    *,
    k: int,
    occupancy_threshold: float,
    home_set: Sequence[str] | None = None,
    matched_tokens: Mapping[str, int] | None = None,
    recompute_s_per_token: float | None = None,
    prefix: bytes | None = None,
    prompt_tokens: int | None = None,
    load_bound: float = LOAD_BOUND,
    min_warm_fraction: float = MIN_WARM_FRACTION,
) -> RouteDecision | None:
    """Pick the replica for one request of `tenant_id`; `None` when no replica is ready.

    `home_set` is the operator-published home set (used as given; homes that are not ready are
    replaced by the tenant's next rendezvous choices); without it the homes are computed by
    rendezvous over the ready replicas. `matched_tokens`
    maps replica name -> hinted prefix tokens it holds for this prompt; the override is off when
    it or `recompute_s_per_token` is missing. `prefix` (`prefix_key`) spreads the tenant's
    prefixes over its homes (without it the first open home is the base); `prompt_tokens` (the
    prompt's length) makes the override need `min_warm_fraction` of it.
    """
    if not 0 < occupancy_threshold <= 1:
        raise ValueError(f"occupancy_threshold must be in (0, 1], got {occupancy_threshold}")
    if load_bound < 1:
        raise ValueError(f"load_bound must be >= 1, got {load_bound}")
    if not 0 <= min_warm_fraction <= 1:
        raise ValueError(f"min_warm_fraction must be in [0, 1], got {min_warm_fraction}")
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

    open_homes = [by_name[r] for r in homes if by_name[r].kv_occupancy < occupancy_threshold]
    base: ReplicaLoad | None = None
    if open_homes:
        base = open_homes[0] if prefix is None else _owner(prefix, open_homes, load_bound)
    reason: RouteReason = "home"
    if base is None:
        spill = least_loaded(list(by_name.values()))
        assert spill is not None
        base, reason = spill, "spill"
    base_matched = matched.get(base.name, 0)

    least_warm = 0 if prompt_tokens is None else min_warm_fraction * prompt_tokens
    if recompute_s_per_token is not None and matched:
        best: tuple[float, str] | None = None
        for name in sorted(matched):
            tokens = matched[name]
            load = by_name.get(name)
            if load is None or tokens <= base_matched or load.kv_occupancy >= occupancy_threshold:
                continue
            if tokens < least_warm:
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
