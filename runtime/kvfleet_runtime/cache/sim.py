"""Hit-rate simulation of prefix caches over a request trace: pure, reusable, torch-free.

Each request is the list of chain hashes of its full 16-token blocks. The policies, all at a
capacity counted in blocks:

- `simulate_infinite`: every block ever seen stays (the upper bound of any policy);
- `simulate_lru`: hash map + LRU, vLLM-v1 style: a hit is the longest run of leading resident
  blocks, then every block of the request is touched, tail first so the head is the most recent;
- `simulate_belady`: Belady's offline optimum (MIN with bypass): evict the block whose next use is
  furthest away, deepest first among ties, never admit a block that would be that victim;
- `simulate_kvfleet`: the shipped policy, i.e. this package's `CacheManager` (sketch, admission on
  the second sighting, TinyLFU duel, pinning, thrash detector) driven with the same hashes.

`load_mooncake_trace` replays the Mooncake trace format: each 512-token `hash_id` expands into 32
blocks of deterministic tokens derived from (hash id, sub-block index), the last block cut to
`input_length` (only full blocks count). The `kvfleet bench` comparisons (issue 9) reuse this.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_runtime.cache._config import CacheConfig
from kvfleet_runtime.cache._keys import BLOCK_SIZE, BlockHash, CacheKey, continue_chain, key_digest
from kvfleet_runtime.cache._manager import CacheManager, StorePlan

__all__ = [
    "MOONCAKE_BLOCKS_PER_HASH_ID",
    "SimResult",
    "TraceRequest",
    "load_mooncake_trace",
    "mooncake_block_tokens",
    "simulate_belady",
    "simulate_infinite",
    "simulate_kvfleet",
    "simulate_lru",
    "unique_blocks",
]

MOONCAKE_TOKENS_PER_HASH_ID = 512
MOONCAKE_BLOCKS_PER_HASH_ID = MOONCAKE_TOKENS_PER_HASH_ID // BLOCK_SIZE

SIM_KEY = CacheKey("trace", "trace-model", "sha256:" + "0" * 64, "float16", "rope", "attn")


@dataclass(slots=True, frozen=True)
class TraceRequest:
    timestamp_s: float
    num_tokens: int
    blocks: tuple[BlockHash, ...]
    """Chain hashes of the request's full blocks, root first."""


@dataclass(slots=True)
class SimResult:
    policy: str
    capacity_blocks: int | None
    num_requests: int = 0
    num_tokens: int = 0
    num_hit_tokens: int = 0
    num_hit_requests: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def token_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.num_hit_requests / self.num_requests if self.num_requests else 0.0

    def record(self, request: TraceRequest, hit_blocks: int) -> None:
        self.num_requests += 1
        self.num_tokens += request.num_tokens
        self.num_hit_tokens += hit_blocks * BLOCK_SIZE
        self.num_hit_requests += 1 if hit_blocks else 0


def mooncake_block_tokens(hash_id: int, sub_block: int) -> list[int]:
    """The 16 deterministic token ids of sub-block `sub_block` of Mooncake hash id `hash_id`."""
    base = (hash_id * MOONCAKE_BLOCKS_PER_HASH_ID + sub_block) * BLOCK_SIZE
    return [(base + t) % 2**32 for t in range(BLOCK_SIZE)]


def load_mooncake_trace(
    path: Path, *, max_requests: int | None = None, key: CacheKey = SIM_KEY
) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace into requests of chained block hashes.

    Equal hash ids at equal positions mean an equal prefix, so the 32 chain hashes of a hash id
    are computed once, chained onto the last hash of the id before it."""
    if not path.is_file():
        raise ValueError(f"trace file not found: {path}")
    expanded: dict[int, list[BlockHash]] = {}
    requests: list[TraceRequest] = []
    root = key_digest(key)
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if max_requests is not None and len(requests) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                timestamp_s = float(row["timestamp"]) / 1000.0
                num_tokens = int(row["input_length"])
                hash_ids = [int(x) for x in row["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{line_no}: not a Mooncake trace row: {line[:80]!r}"
                ) from exc
            num_blocks = min(num_tokens // BLOCK_SIZE, len(hash_ids) * MOONCAKE_BLOCKS_PER_HASH_ID)
            blocks: list[BlockHash] = []
            prev = root
            for hash_id in hash_ids:
                if len(blocks) >= num_blocks:
                    break
                chunk = expanded.get(hash_id)
                if chunk is None:
                    tokens = [
                        t
                        for j in range(MOONCAKE_BLOCKS_PER_HASH_ID)
                        for t in mooncake_block_tokens(hash_id, j)
                    ]
                    chunk = expanded[hash_id] = continue_chain(prev, tokens)
                blocks.extend(chunk)
                prev = chunk[-1]
            requests.append(TraceRequest(timestamp_s, num_tokens, tuple(blocks[:num_blocks])))
    return requests


def unique_blocks(requests: Sequence[TraceRequest]) -> int:
    return len({b for r in requests for b in r.blocks})


def simulate_infinite(requests: Sequence[TraceRequest]) -> SimResult:
    result = SimResult("infinite", None)
    seen: set[BlockHash] = set()
    for request in requests:
        hit = 0
        for b in request.blocks:
            if b not in seen:
                break
            hit += 1
        result.record(request, hit)
        seen.update(request.blocks)
    return result


def simulate_lru(requests: Sequence[TraceRequest], capacity_blocks: int) -> SimResult:
    result = SimResult("lru", capacity_blocks)
    cache: OrderedDict[BlockHash, None] = OrderedDict()
    for request in requests:
        hit = 0
        for b in request.blocks:
            if b not in cache:
                break
            hit += 1
        result.record(request, hit)
        for b in reversed(request.blocks):
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return result


def simulate_belady(requests: Sequence[TraceRequest], capacity_blocks: int) -> SimResult:
    result = SimResult("belady", capacity_blocks)
    never = len(requests)
    # next_use[r][i]: index of the next request that uses block i of request r.
    next_seen: dict[BlockHash, int] = {}
    next_use: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        blocks = requests[r].blocks
        next_use[r] = [next_seen.get(b, never) for b in blocks]
        for b in blocks:
            next_seen[b] = r
    resident: dict[BlockHash, int] = {}  # block -> its current next use
    heap: list[tuple[int, int, BlockHash]] = []  # (-next use, -depth, block), lazily invalidated
    for r, request in enumerate(requests):
        hit = 0
        for b in request.blocks:
            if b not in resident:
                break
            hit += 1
        result.record(request, hit)
        for depth, (b, nu) in enumerate(zip(request.blocks, next_use[r], strict=True)):
            resident[b] = nu
            heapq.heappush(heap, (-nu, -depth, b))
        while len(resident) > capacity_blocks:
            neg_nu, _, b = heapq.heappop(heap)
            if resident.get(b) == -neg_nu:
                del resident[b]
        if len(heap) > 4 * capacity_blocks + 4096:
            # Entries are unique per (block, next use): keep only the live ones.
            heap = [e for e in heap if resident.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    return result


def simulate_kvfleet(
    requests: Sequence[TraceRequest],
    capacity_blocks: int,
    *,
    config: Callable[[int], CacheConfig] | None = None,
    bytes_per_block: int = BLOCK_SIZE * 327_680,
) -> SimResult:
    """The shipped admission and eviction policy, one tier of `capacity_blocks`, with each
    request's store committed before the next request (an always-drained store queue)."""
    cfg = config(capacity_blocks) if config else CacheConfig(num_t0_blocks=capacity_blocks)
    now = [0.0]
    manager = CacheManager(cfg, bytes_per_block=bytes_per_block, clock=lambda: now[0])
    result = SimResult("kvfleet", capacity_blocks)
    for request in requests:
        now[0] = request.timestamp_s
        path = manager.lookup(SIM_KEY, request.blocks, request.num_tokens)
        result.record(request, len(path))
        manager.release(path)
        plan = manager.plan_store(SIM_KEY, list(request.blocks))
        if isinstance(plan, StorePlan):
            manager.finish_commit(manager.commit(plan))
        manager.events.clear()
    result.extra["thrash_episodes"] = manager.thrash.num_episodes
    result.extra["evictions"] = manager.index.counters[0].num_evictions
    return result
