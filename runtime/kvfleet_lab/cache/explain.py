"""What Belady keeps that a policy drops (issue 46): the hits Belady's offline optimum has and an
online policy (kvfleet's, by default) misses, and what came between their two uses.

Given both policies' per-request hits on the same requests at the same capacity, a *lost block*
is one Belady hits and the policy does not: position `i` of request `r` with `policy hit <= i <
Belady hit` (the policy evicted it, or never stored it, since its last use). For each lost block
the trace alone tells, between its previous use (request `p`) and request `r`:

- `accesses`: blocks requested (every block of requests p+1 .. r-1): the reuse distance counted as
  LRU sees it, an upper bound of the distinct blocks in between;
- `new`: first sightings among them: blocks that had to be stored, a lower bound of the distinct
  blocks in between;
- `once`: of those, blocks the whole trace requests only once (they never return: a cache that
  stored none of them would have kept their room for the lost block);
- `new - once`: first sightings that do come back later.

Distances are given as multiples of the capacity. Block-weighted (a lost block is a lost 16-token
hit). Beside them, `simulate_lru_returning_only`: LRU told which blocks will be requested again,
storing (and refreshing) only those: how far admission alone, with perfect knowledge, takes
recency toward Belady. Pure and torch-free; returns records, prints nothing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_lab.cache.sim import SimResult, TraceRequest, cached_prefix
from kvfleet_runtime.cache import BlockHash

__all__ = ["LostHits", "explain_lost_hits", "simulate_lru_returning_only"]


@dataclass(slots=True, frozen=True)
class LostHits:
    policy: str
    capacity_blocks: int
    num_lost_blocks: int
    """Blocks Belady hits and `policy` does not (summed over requests)."""
    num_gained_blocks: int
    """The other way round: blocks `policy` hits and Belady does not (Belady maximises the total,
    not every request)."""
    num_first_reuse_blocks: int
    """Lost blocks at their second sighting: seen once before, then lost."""
    accesses_quartiles: tuple[float, float, float]
    """Blocks requested between the lost block's two uses, x capacity: p25, p50, p75."""
    new_quartiles: tuple[float, float, float]
    """First sightings between them, x capacity."""
    once_quartiles: tuple[float, float, float]
    """Once-seen blocks (requested once in the whole trace) between them, x capacity."""
    returning_quartiles: tuple[float, float, float]
    """First sightings between them that are requested again later, x capacity."""
    once_share_of_new: float
    """Of the first sightings between the uses of lost blocks, the once-seen share (weighted)."""
    share_returning_below_capacity: float
    """Lost blocks whose returning first sightings in between take less than the capacity: a
    policy that stored no once-seen block had room to keep them (as Belady's bypass does)."""
    share_new_below_capacity: float
    """Lost blocks with fewer first sightings in between than the capacity."""
    returning_only_lru_hit_blocks: int
    """What LRU hits at this capacity when it stores only blocks that are requested again
    (`simulate_lru_returning_only`: offline, a bound of admission in front of recency)."""

    @property
    def first_reuse_share(self) -> float:
        return self.num_first_reuse_blocks / self.num_lost_blocks if self.num_lost_blocks else 0.0


def simulate_lru_returning_only(
    requests: Sequence[TraceRequest], capacity_blocks: int
) -> SimResult:
    """`simulate_lru` with an oracle admission: at each request, a block that no later request
    holds is neither stored nor refreshed (a resident one ages out as LRU has it). Not online."""
    remaining = Counter(b for r in requests for b in r.blocks)
    result = SimResult("lru_returning_only", capacity_blocks)
    cache: OrderedDict[BlockHash, None] = OrderedDict()
    for request in requests:
        result.record(request, cached_prefix(request.blocks, cache))
        for b in reversed(request.blocks):
            remaining[b] -= 1
            if not remaining[b]:
                continue
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return result


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (0.0, 0.0, 0.0)
    values.sort()
    n = len(values)
    return (values[n // 4], values[n // 2], values[min(n - 1, 3 * n // 4)])


def explain_lost_hits(
    requests: Sequence[TraceRequest], policy: SimResult, belady: SimResult
) -> LostHits:
    """The lost blocks of `policy` against `belady`, both replayed on `requests` at one capacity
    (their `hit_blocks` in trace order)."""
    capacity = policy.capacity_blocks
    if capacity is None or capacity != belady.capacity_blocks:
        raise ValueError(
            f"both results need the same capacity, got {capacity} and {belady.capacity_blocks}"
        )
    if not len(policy.hit_blocks) == len(belady.hit_blocks) == len(requests):
        raise ValueError(
            f"hits for {len(policy.hit_blocks)} and {len(belady.hit_blocks)} requests, "
            f"trace of {len(requests)}"
        )
    total = Counter(b for r in requests for b in r.blocks)
    # Running counts before request r: blocks requested, first sightings, once-seen blocks.
    cum_accesses, cum_new, cum_once = [0], [0], [0]
    last_use: dict[bytes, int] = {}
    sightings: Counter[bytes] = Counter()
    accesses: list[float] = []
    new: list[float] = []
    once: list[float] = []
    returning: list[float] = []
    num_lost = num_gained = num_first_reuse = 0
    sum_new = sum_once = 0
    below_returning = below_new = 0
    for r, request in enumerate(requests):
        kv_hit, best_hit = policy.hit_blocks[r], belady.hit_blocks[r]
        num_gained += max(0, kv_hit - best_hit)
        for b in request.blocks[kv_hit:best_hit]:
            p = last_use[b] + 1  # Belady hit it: it was requested before
            n_new = cum_new[r] - cum_new[p]
            n_once = cum_once[r] - cum_once[p]
            accesses.append((cum_accesses[r] - cum_accesses[p]) / capacity)
            new.append(n_new / capacity)
            once.append(n_once / capacity)
            returning.append((n_new - n_once) / capacity)
            sum_new += n_new
            sum_once += n_once
            below_returning += 1 if n_new - n_once < capacity else 0
            below_new += 1 if n_new < capacity else 0
            num_first_reuse += 1 if sightings[b] == 1 else 0
            num_lost += 1
        first = once_seen = 0
        for b in request.blocks:
            if b not in last_use:
                first += 1
                once_seen += 1 if total[b] == 1 else 0
            last_use[b] = r
            sightings[b] += 1
        cum_accesses.append(cum_accesses[-1] + len(request.blocks))
        cum_new.append(cum_new[-1] + first)
        cum_once.append(cum_once[-1] + once_seen)
    return LostHits(
        policy.policy,
        capacity,
        num_lost,
        num_gained,
        num_first_reuse,
        _quartiles(accesses),
        _quartiles(new),
        _quartiles(once),
        _quartiles(returning),
        sum_once / sum_new if sum_new else 0.0,
        below_returning / num_lost if num_lost else 0.0,
        below_new / num_lost if num_lost else 0.0,
        sum(simulate_lru_returning_only(requests, capacity).hit_blocks),
    )
