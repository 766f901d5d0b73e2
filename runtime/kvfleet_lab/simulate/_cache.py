"""One replica's prefix cache in the fleet simulation, held by the shipped `CacheManager`.

The simulator keeps no cache policy of its own: admission, eviction and everything else the cache
decides come from `kvfleet_runtime.cache.CacheManager`, driven through its public replay boundary
(`replay`, `num_cached_blocks`, `stats`), so the fleet figures are the figures of the policy the
replicas run.

Granularity: one manager block per whole template prefix (`bytes_per_block` = the prefix's KV
bytes), not 16-token blocks. Every prefix of the simulated workload is exactly `prefix_tokens`
long and is either wholly cached or absent, so 16-token blocks would find the same hits. Time
decides it: `kvfleet simulate all` replays 2.5 million requests, and even a one-block replay
costs several times the rest of a request's simulation (a whole run went from 27 s to 210 s of
CPU with the manager; docs/benchmarks.md); a 93-block replay costs ~6x a one-block replay (420
vs 67 us measured on the shared machine), i.e. ~18 minutes of CPU per run. The knobs of
`CacheTuning` that count blocks rather than bytes are rescaled to the same number of tokens
(`scaled_config`), so that one prefix-sized block weighs what its 16-token blocks weigh in a
replica.

Tiers, as the product has them: the replica's host DRAM is the manager's T1 pool, T0 has no
blocks (HBM holds the in-flight requests' KV, which is how the fleet is sized). The optional
NVMe tier behind DRAM is not a tier the manager models, so it is a second manager of the same
policy: what DRAM evicts is offered to it (admitted on its first offer there: DRAM already
admitted it), a hit there is offered back to DRAM, and the NVMe copy stays (inclusive).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from kvfleet_runtime.cache import BLOCK_SIZE, BlockHash, CacheKey, CacheManager, CacheTuning

__all__ = [
    "TIER_DRAM",
    "TIER_MISS",
    "TIER_NVME",
    "ReplicaCache",
    "admission_sightings",
    "scaled_config",
    "sketch_width",
]

TIER_MISS = 0
TIER_DRAM = 1
TIER_NVME = 3

_MIN_SKETCH_WIDTH = 1 << 12
_SKETCH_WIDTH_PER_KEY = 8
"""Sketch counters per row per distinct prefix a replica may see: few collisions at depth 4."""

Chain = Sequence[BlockHash]


def sketch_width(num_distinct_keys: int) -> int:
    """A power-of-two sketch width for a replica that may see `num_distinct_keys` prefixes.

    Wide against the keys (the shipped width's own rule) but no wider than the shipped default:
    44 replicas x 16 MiB sketches would cost more memory than the whole simulation. The sketch
    ages after 10 x width sightings, beyond any run's sightings per replica at this width, as in
    a replica at the shipped width (hours of traffic before the first aging)."""
    wanted = max(_MIN_SKETCH_WIDTH, _SKETCH_WIDTH_PER_KEY * num_distinct_keys)
    width = 1 << (wanted - 1).bit_length()
    return min(width, CacheTuning(num_t0_blocks=1).sketch_width)


def admission_sightings(admit_after: int | None) -> int:
    """The sighting a prefix is stored on: `admit_after`, or the shipped cache's own admission."""
    if admit_after is not None:
        return admit_after
    return CacheTuning(num_t0_blocks=1).admit_min_sightings


def scaled_config(
    num_entries: int,
    prefix_tokens: int,
    *,
    sketch_width: int,
    admit_min_sightings: int | None = None,
) -> CacheTuning:
    """The shipped `CacheTuning` for a host pool of `num_entries` prefix-sized blocks.

    Block counts (`thrash_min_blocks`, `store_min_blocks`) are converted to prefixes of the same
    tokens, rounded up; byte figures (`pin_max_bytes`) need nothing since a block's bytes are the
    prefix's; the hash memo is off (replays are given hashes, nothing is hashed)."""
    shipped = CacheTuning(num_t0_blocks=0, num_t1_blocks=num_entries)
    admit = admission_sightings(admit_min_sightings)

    def per_prefix(num_blocks: int) -> int:
        return max(1, math.ceil(num_blocks * BLOCK_SIZE / prefix_tokens))

    return dataclasses.replace(
        shipped,
        admit_min_sightings=admit,
        hot_min_sightings=max(shipped.hot_min_sightings, admit),
        sketch_width=sketch_width,
        thrash_min_blocks=per_prefix(shipped.thrash_min_blocks),
        store_min_blocks=per_prefix(shipped.store_min_blocks),
        hash_memo_entries=0,
    )


class ReplicaCache:
    """DRAM, and NVMe when it has room, of one replica; entries are one-block chains."""

    __slots__ = ("_dram_entries", "_num_tokens", "_resident", "dram", "nvme")

    def __init__(
        self,
        dram: CacheTuning | None,
        nvme: CacheTuning | None,
        *,
        prefix_bytes: int,
        prefix_tokens: int,
        clock: Callable[[], float],
    ) -> None:
        self.dram = CacheManager(dram, bytes_per_block=prefix_bytes, clock=clock) if dram else None
        self.nvme = CacheManager(nvme, bytes_per_block=prefix_bytes, clock=clock) if nvme else None
        self._dram_entries = dram.num_t0_blocks + dram.num_t1_blocks if dram else 0
        self._num_tokens = prefix_tokens
        # What DRAM holds, kept only when NVMe needs to be told what DRAM evicted: the replay
        # boundary returns the hit, not the victims, so they are found by asking for each.
        self._resident: dict[BlockHash, tuple[CacheKey, Chain]] | None = (
            {} if self.nvme is not None and self.dram is not None else None
        )

    def tier(self, chain: Chain) -> int:
        """Where the prefix would be found now (no policy state changes)."""
        if self.dram is not None and self.dram.num_cached_blocks(chain):
            return TIER_DRAM
        if self.nvme is not None and self.nvme.num_cached_blocks(chain):
            return TIER_NVME
        return TIER_MISS

    def offer(self, key: CacheKey, chain: Chain) -> None:
        """One request for the prefix at DRAM: looked up, counted, stored if admitted. A hit is
        offered when it is looked up, a miss when its prefill has made the KV."""
        dram = self.dram
        if dram is None:
            return
        resident = self._resident
        if resident is None:  # no NVMe: nobody needs to know what DRAM drops
            dram.replay(key, chain, self._num_tokens)
            return
        head = chain[0]
        was_full = len(resident) >= self._dram_entries
        dram.replay(key, chain, self._num_tokens)
        if head in resident or not dram.num_cached_blocks(chain):
            return
        resident[head] = (key, chain)
        if was_full:  # a store into a full pool evicted (free slots are always used first)
            self._demote_evicted()

    def offer_nvme(self, key: CacheKey, chain: Chain) -> None:
        """A request served from NVMe, at its lookup."""
        if self.nvme is not None:
            self.nvme.replay(key, chain, self._num_tokens)

    def _demote_evicted(self) -> None:
        assert self.dram is not None and self.nvme is not None and self._resident is not None
        dram, resident = self.dram, self._resident
        gone = [head for head, (_, chain) in resident.items() if not dram.num_cached_blocks(chain)]
        for head in gone:
            key, chain = resident.pop(head)
            self.nvme.replay(key, chain, self._num_tokens)

    @property
    def dram_resident_bytes(self) -> int:
        if self.dram is None:
            return 0
        return sum(tier.num_bytes_used for tier in self.dram.stats().tiers)

    @property
    def num_dram_entries(self) -> int:
        """Capacity of DRAM in prefixes."""
        return self._dram_entries
