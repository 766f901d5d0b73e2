"""Hit-rate simulation of prefix caches over a request trace: pure, reusable, torch-free.

Each request is the list of chain hashes of its full 16-token blocks. The policies, all at a
capacity counted in blocks:

- `simulate_infinite`: every block ever seen stays (the upper bound of any policy);
- `simulate_lru`: hash map + LRU, vLLM-v1 style: a hit is the longest run of leading resident
  blocks, then every block of the request is touched, tail first so the head is the most recent;
- `simulate_vllm`: vLLM v1's prefix caching modelled block for block (`block_pool.py`): a free
  queue of block ids in eviction order, lazy eviction when a new block is allocated, duplicates of a
  hash allowed; replayed one request at a time it hits exactly what `simulate_lru` hits;
- `simulate_radix`: SGLang's RadixAttention (`radix_cache.py`, LRU): a radix tree of multi-block
  segments, whole leaves evicted least recently used first, `evict(n)` asked for the whole
  allocation whenever the free pool is short of it;
- `simulate_s3fifo`: S3-FIFO (Yang et al., SOSP'23) over blocks: a small probationary FIFO of 10%
  of the capacity, a main FIFO with a 2-bit frequency (reinserted while it is above 0, one less
  each time), and a ghost FIFO of evicted keys as long as the main FIFO; a block hit twice while
  in the small FIFO moves to the main one, a ghost that comes back goes straight there;
- `simulate_sieve`: SIEVE (Zhang et al., NSDI'24) over blocks: one FIFO with a visited bit and a
  hand that walks from the oldest block toward the newest, clearing bits, and evicts the first
  unvisited block it meets; newcomers go in at the new end;
- `simulate_belady`: Belady's offline optimum (MIN with bypass): evict the block whose next use is
  furthest away, deepest first among ties, never admit a block that would be that victim;
- `simulate_kvfleet`: the shipped policy, i.e. `kvfleet_runtime.cache.CacheManager` (sketch,
  admission from `CacheTuning.admit_min_sightings`, TinyLFU duel, pinning, thrash detector) via its
  `replay` with the same hashes: the lab's one kvfleet replay (the fleet simulator and the fleet
  routing replay drive the same manager).

S3-FIFO and SIEVE are per-block hash caches like `simulate_lru`: a hit is the leading run of
resident blocks (a block is only usable when its whole parent chain is), then every block of the
request is accessed, tail first so that the head is the newest (a resident block counts as a
hit for the policy, a missing one is inserted), as `simulate_lru` touches them.

`load_mooncake_trace` replays the Mooncake trace format: each 512-token `hash_id` expands into 32
blocks of deterministic tokens derived from (hash id, sub-block index), the last block cut to
`input_length` (only full blocks count). The `kvfleet bench` comparisons (issue 9) reuse this.
"""

from __future__ import annotations

import gzip
import heapq
import itertools
import json
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_runtime.breakeven import MODELS, ModelProfile, prefill_flops
from kvfleet_runtime.cache import BLOCK_SIZE, BlockHash, CacheKey, CacheManager, CacheTuning
from kvfleet_runtime.cache._keys import continue_chain, key_digest

__all__ = [
    "MOONCAKE_BLOCKS_PER_HASH_ID",
    "SimResult",
    "TraceRequest",
    "cached_prefix",
    "load_mooncake_trace",
    "mooncake_block_tokens",
    "simulate_belady",
    "simulate_infinite",
    "simulate_kvfleet",
    "simulate_lru",
    "simulate_popularity_oracle",
    "simulate_radix",
    "simulate_s3fifo",
    "simulate_sieve",
    "simulate_vllm",
    "unique_blocks",
]

MOONCAKE_TOKENS_PER_HASH_ID = 512
MOONCAKE_BLOCKS_PER_HASH_ID = MOONCAKE_TOKENS_PER_HASH_ID // BLOCK_SIZE

SIM_KEY = CacheKey("trace", "trace-model", "sha256:" + "0" * 64, "float16", "rope", "attn")

COST_MODEL: ModelProfile = MODELS["reference-70b"]
"""Whose prefill FLOPs (`breakeven.prefill_flops`: 2N per token plus attention, which grows with
the position) weigh a hit in `SimResult.compute_saved`."""


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
    prompt_flops: float = 0.0
    """What prefilling every prompt whole costs on `COST_MODEL` (no cache)."""
    saved_flops: float = 0.0
    """Of it, the positions the hits supplied: each request's first `hit` positions."""
    extra: dict[str, float] = field(default_factory=dict)
    hit_blocks: list[int] = field(default_factory=list)
    """Each request's hit, in blocks, in trace order."""

    @property
    def token_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0

    @property
    def compute_saved(self) -> float:
        """Share of the prefill compute the hits saved. Above the token hit rate when the hits
        are deep in long prompts: a cached position p saves its attention over p keys too."""
        return self.saved_flops / self.prompt_flops if self.prompt_flops else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.num_hit_requests / self.num_requests if self.num_requests else 0.0

    def record(self, request: TraceRequest, hit_blocks: int) -> None:
        self.num_requests += 1
        self.num_tokens += request.num_tokens
        self.num_hit_tokens += hit_blocks * BLOCK_SIZE
        self.num_hit_requests += 1 if hit_blocks else 0
        self.hit_blocks.append(hit_blocks)
        self.prompt_flops += prefill_flops(COST_MODEL, request.num_tokens)
        if hit_blocks:
            self.saved_flops += prefill_flops(COST_MODEL, hit_blocks * BLOCK_SIZE)


def mooncake_block_tokens(hash_id: int, sub_block: int) -> list[int]:
    """The 16 deterministic token ids of sub-block `sub_block` of Mooncake hash id `hash_id`."""
    base = (hash_id * MOONCAKE_BLOCKS_PER_HASH_ID + sub_block) * BLOCK_SIZE
    return [(base + t) % 2**32 for t in range(BLOCK_SIZE)]


def load_mooncake_trace(
    path: Path, *, max_requests: int | None = None, key: CacheKey = SIM_KEY
) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace (gzip-compressed if its name ends in .gz) into
    requests of chained block hashes.

    Equal hash ids at equal positions mean an equal prefix, so the 32 chain hashes of a hash id
    are computed once, chained onto the last hash of the id before it."""
    if not path.is_file():
        raise ValueError(f"trace file not found: {path}")
    try:
        return _read_mooncake_trace(path, max_requests, key)
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable Mooncake trace ({exc})") from exc


def _read_mooncake_trace(
    path: Path, max_requests: int | None, key: CacheKey
) -> list[TraceRequest]:
    expanded: dict[int, list[BlockHash]] = {}
    requests: list[TraceRequest] = []
    root = key_digest(key)
    with gzip.open(path, "rt") if path.name.endswith(".gz") else path.open() as f:
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


def cached_prefix(blocks: Sequence[BlockHash], held: Container[BlockHash]) -> int:
    """How many leading blocks of a chain `held` has: a hit is a prefix."""
    hit = 0
    for b in blocks:
        if b not in held:
            break
        hit += 1
    return hit


def unique_blocks(requests: Sequence[TraceRequest]) -> int:
    return len({b for r in requests for b in r.blocks})


def simulate_infinite(requests: Sequence[TraceRequest]) -> SimResult:
    result = SimResult("infinite", None)
    seen: set[BlockHash] = set()
    for request in requests:
        result.record(request, cached_prefix(request.blocks, seen))
        seen.update(request.blocks)
    return result


def simulate_lru(requests: Sequence[TraceRequest], capacity_blocks: int) -> SimResult:
    result = SimResult("lru", capacity_blocks)
    cache: OrderedDict[BlockHash, None] = OrderedDict()
    for request in requests:
        result.record(request, cached_prefix(request.blocks, cache))
        for b in reversed(request.blocks):
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return result


def simulate_s3fifo(
    requests: Sequence[TraceRequest],
    capacity_blocks: int,
    *,
    small_fraction: float = 0.1,
    move_to_main_threshold: int = 2,
    on_evict: Callable[[BlockHash], None] | None = None,
) -> SimResult:
    """S3-FIFO as the paper's Algorithm 1 has it, one block an object.

    A miss goes to the small FIFO S (to the main FIFO M when its key is in the ghost G), after
    `evict` made room. `evict` takes from S while S holds at least `small_fraction` of the
    capacity, else from M. From S: the oldest block moves to M when it was hit at least
    `move_to_main_threshold` times (its count cleared), else it leaves for G (the first block that
    leaves ends the eviction). From M: the oldest block is reinserted with its count less one while
    the count is above 0, else evicted. Counts are capped at 3 (2 bits); G keeps as many keys as M
    may hold, oldest dropped first. `on_evict` sees each block that leaves the cache, in order."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    result = SimResult("s3fifo", capacity_blocks)
    small_target = max(1, round(small_fraction * capacity_blocks))
    main_target = max(1, capacity_blocks - small_target)
    small: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first
    main: OrderedDict[BlockHash, None] = OrderedDict()
    ghost: OrderedDict[BlockHash, None] = OrderedDict()
    freq: dict[BlockHash, int] = {}
    num_evictions = num_to_main = 0

    def evict_main() -> None:
        nonlocal num_evictions
        while main:
            b = next(iter(main))
            if freq[b] > 0:
                freq[b] -= 1
                main.move_to_end(b)
                continue
            del main[b], freq[b]
            num_evictions += 1
            if on_evict is not None:
                on_evict(b)
            return

    def evict_small() -> None:
        nonlocal num_evictions, num_to_main
        while small:
            b, _ = small.popitem(last=False)
            if freq[b] >= move_to_main_threshold:
                freq[b] = 0
                main[b] = None
                num_to_main += 1
                if len(main) > main_target:
                    evict_main()
                continue
            del freq[b]
            ghost[b] = None
            if len(ghost) > main_target:
                ghost.popitem(last=False)
            num_evictions += 1
            if on_evict is not None:
                on_evict(b)
            return

    for request in requests:
        result.record(request, cached_prefix(request.blocks, freq))
        for b in reversed(request.blocks):
            if b in freq:
                freq[b] = min(freq[b] + 1, 3)
                continue
            while len(small) + len(main) >= capacity_blocks:
                if len(small) >= small_target or not main:
                    evict_small()
                else:
                    evict_main()
            freq[b] = 0
            if b in ghost:
                del ghost[b]
                main[b] = None
            else:
                small[b] = None
    result.extra["evictions"] = num_evictions
    result.extra["moved_to_main"] = num_to_main
    return result


def simulate_sieve(
    requests: Sequence[TraceRequest],
    capacity_blocks: int,
    *,
    on_evict: Callable[[BlockHash], None] | None = None,
) -> SimResult:
    """SIEVE, one block an object: a FIFO (`newer` links oldest to newest), a visited bit set by
    a hit, and a hand that starts at the oldest block, clears the bits it passes on its way to the
    newer end (wrapping round to the oldest), and evicts the first unvisited block; it then rests
    on the next newer block. Newcomers are never where the hand is about to look first."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    result = SimResult("sieve", capacity_blocks)
    visited: dict[BlockHash, bool] = {}
    newer: dict[BlockHash, BlockHash | None] = {}
    older: dict[BlockHash, BlockHash | None] = {}
    oldest: BlockHash | None = None
    newest: BlockHash | None = None
    hand: BlockHash | None = None
    num_evictions = 0
    for request in requests:
        result.record(request, cached_prefix(request.blocks, visited))
        for b in reversed(request.blocks):
            if b in visited:
                visited[b] = True
                continue
            if len(visited) >= capacity_blocks:
                h = hand if hand is not None else oldest
                assert h is not None
                while visited[h]:
                    visited[h] = False
                    nxt = newer[h]
                    h = nxt if nxt is not None else oldest
                    assert h is not None
                hand = newer[h]
                before, after = older.pop(h), newer.pop(h)
                if before is None:
                    oldest = after
                else:
                    newer[before] = after
                if after is None:
                    newest = before
                else:
                    older[after] = before
                del visited[h]
                num_evictions += 1
                if on_evict is not None:
                    on_evict(h)
            visited[b] = False
            older[b], newer[b] = newest, None
            if newest is None:
                oldest = b
            else:
                newer[newest] = b
            newest = b
    result.extra["evictions"] = num_evictions
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
        result.record(request, cached_prefix(request.blocks, resident))
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


def simulate_popularity_oracle(
    requests: Sequence[TraceRequest], capacity_blocks: int, *, admit_min_sightings: int = 2
) -> SimResult:
    """Not an online policy: a frequency ranking that knows how often every block is requested
    over the WHOLE trace, with the shipped admission (from the second sighting) and no other
    foresight. It bounds what ranking by frequency can reach: an online policy only ever sees
    the counts so far. The lowest total goes first (deepest, then least recent, among equals,
    and newcomers included: it may bypass); a block is requested at least as often as any block
    after it, so this order only ever drops leaves."""
    total = Counter(b for request in requests for b in request.blocks)
    result = SimResult("popularity_oracle", capacity_blocks)
    sightings: Counter[BlockHash] = Counter()
    last_use: dict[BlockHash, int] = {}  # resident block -> the request that last pushed it
    heap: list[tuple[int, int, int, BlockHash]] = []  # (total, -depth, last use); lazily stale
    for r, request in enumerate(requests):
        result.record(request, cached_prefix(request.blocks, last_use))
        sightings.update(request.blocks)
        for depth, b in enumerate(request.blocks):
            if sightings[b] < admit_min_sightings:
                break  # only a prefix can be stored
            last_use[b] = r
            heapq.heappush(heap, (total[b], -depth, r, b))
        while len(last_use) > capacity_blocks:
            _, _, used, b = heapq.heappop(heap)
            if last_use.get(b) == used:
                del last_use[b]
        if len(heap) > 4 * capacity_blocks + 4096:
            heap = [e for e in heap if last_use.get(e[3]) == e[2]]
            heapq.heapify(heap)
    return result


def simulate_kvfleet(
    requests: Sequence[TraceRequest],
    capacity_blocks: int,
    *,
    config: Callable[[int], CacheTuning] | None = None,
    bytes_per_block: int = BLOCK_SIZE * 327_680,
) -> SimResult:
    """The shipped admission and eviction policy, one tier of `capacity_blocks`, with each
    request's store committed before the next request (an always-drained store queue)."""
    cfg = config(capacity_blocks) if config else CacheTuning(num_t0_blocks=capacity_blocks)
    now = [0.0]
    manager = CacheManager(cfg, bytes_per_block=bytes_per_block, clock=lambda: now[0])
    result = SimResult("kvfleet", capacity_blocks)
    for request in requests:
        now[0] = request.timestamp_s
        result.record(request, manager.replay(SIM_KEY, request.blocks, request.num_tokens))
    stats = manager.stats()
    result.extra["thrash_episodes"] = stats.num_thrash_episodes
    result.extra["evictions"] = stats.tiers[0].num_evictions
    return result


def _max_hit_blocks(request: TraceRequest, recompute_last_token: bool) -> int:
    """vLLM and SGLang both compute at least the prompt's last token (its logits give the first
    output token): `max_cache_hit_length = num_tokens - 1`, floored to whole blocks."""
    if not recompute_last_token:
        return len(request.blocks)
    return min(len(request.blocks), max(request.num_tokens - 1, 0) // BLOCK_SIZE)


def simulate_vllm(
    requests: Sequence[TraceRequest], capacity_blocks: int, *, recompute_last_token: bool = False
) -> SimResult:
    """vLLM v1's automatic prefix caching, one request at a time, `capacity_blocks` usable blocks.

    As `BlockPool` does: `cached_block_hash_to_block` maps a hash to the block ids holding it
    (no de-duplication: a block filled again under a cached hash is a second copy; a lookup takes
    the first); the free queue holds every unreferenced block, least recently freed first. A hit
    (`find_longest_cache_hit`) is the leading run of cached hashes and takes those blocks out of
    the free queue (`touch`); each missing block is popped from the queue's head and, if it still
    holds a hash, that hash is evicted (`_maybe_evict_cached_block`) — whatever hangs below it stays
    cached but unreachable until its own turn comes. At the end the request's blocks are freed
    tail first (`free`: `reversed(req_blocks)`), so its head is the last to go. A request larger
    than the free pool (which vLLM would not schedule) caches the blocks that fit.

    `recompute_last_token`: cap hits at `num_tokens - 1` as vLLM does; the block given up is
    filled again into a duplicate. Off by default so that every policy counts hits alike."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    result = SimResult("vllm", capacity_blocks)
    free: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity_blocks))
    block_hash: list[BlockHash | None] = [None] * capacity_blocks
    cached: dict[BlockHash, dict[int, None]] = {}
    num_evictions = num_duplicates = 0
    for request in requests:
        blocks = request.blocks
        hit_ids: list[int] = []
        for h in blocks[: _max_hit_blocks(request, recompute_last_token)]:
            copies = cached.get(h)
            if not copies:
                break
            hit_ids.append(next(iter(copies)))
        result.record(request, len(hit_ids))
        for block_id in hit_ids:
            del free[block_id]  # ref_cnt 0 -> 1 (sequential replay: every cached block is free)
        new_ids: list[int] = []
        for h in blocks[len(hit_ids) : len(hit_ids) + len(free)]:
            block_id, _ = free.popitem(last=False)
            old = block_hash[block_id]
            if old is not None:
                copies = cached[old]
                del copies[block_id]
                if not copies:
                    del cached[old]
                num_evictions += 1
            copies = cached.setdefault(h, {})
            num_duplicates += 1 if copies else 0
            copies[block_id] = None
            block_hash[block_id] = h
            new_ids.append(block_id)
        for block_id in reversed(hit_ids + new_ids):
            free[block_id] = None
    result.extra["evictions"] = num_evictions
    result.extra["duplicate_blocks"] = num_duplicates
    return result


@dataclass(slots=True, eq=False)
class _RadixNode:
    segment: tuple[BlockHash, ...]
    parent: _RadixNode | None
    last_access: int
    seq: int
    children: dict[BlockHash, _RadixNode] = field(default_factory=dict)


class _RadixTree:
    """SGLang's `RadixCache` with the LRU strategy, counted in blocks (page size 16).

    Nodes hold segments of blocks; `match` refreshes the access time of every node on the path and
    splits the node its match ends inside (`_match_prefix_helper`, `_split_node`); `insert` adds
    the rest as one new leaf. `evict(n)` drops whole unlocked leaves, least recently accessed first
    (ties: oldest node first), a parent joining the candidates when its last child goes, until at
    least `n` blocks are gone: a leaf is never cut, so a short need can cost a long segment."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self.root = _RadixNode((), None, 0, next(self._seq))
        self.num_blocks = 0
        self.tick = 0
        self._heap: list[tuple[int, int, _RadixNode]] = []
        self.locked: set[int] = set()

    def _push(self, node: _RadixNode) -> None:
        if node is not self.root and not node.children:
            heapq.heappush(self._heap, (node.last_access, node.seq, node))

    def _split(self, child: _RadixNode, at: int) -> _RadixNode:
        parent = child.parent
        assert parent is not None
        head = _RadixNode(child.segment[:at], parent, child.last_access, next(self._seq))
        child.segment = child.segment[at:]
        child.parent = head
        head.children[child.segment[0]] = child
        parent.children[head.segment[0]] = head
        self._push(child)  # refreshed by the match that split it
        return head

    def match(self, blocks: Sequence[BlockHash]) -> tuple[int, list[_RadixNode]]:
        self.tick += 1
        node, depth, path = self.root, 0, []
        while depth < len(blocks):
            child = node.children.get(blocks[depth])
            if child is None:
                break
            child.last_access = self.tick
            seg = child.segment
            n = 0
            while n < len(seg) and depth + n < len(blocks) and seg[n] == blocks[depth + n]:
                n += 1
            if n < len(seg):
                child = self._split(child, n)
            path.append(child)
            node, depth = child, depth + n
            if n < len(child.segment):
                break
        if path:
            self._push(path[-1])  # the only node of the path that can be a leaf
        return depth, path

    def insert(self, blocks: Sequence[BlockHash]) -> int:
        """Index `blocks`; returns how many were new (one new leaf)."""
        depth, path = self.match(blocks)
        if depth == len(blocks):
            return 0
        parent = path[-1] if path else self.root
        leaf = _RadixNode(tuple(blocks[depth:]), parent, self.tick, next(self._seq))
        parent.children[leaf.segment[0]] = leaf
        self.num_blocks += len(leaf.segment)
        self._push(leaf)
        return len(leaf.segment)

    def evict(self, num_blocks: int) -> int:
        evicted = 0
        skipped: list[tuple[int, int, _RadixNode]] = []
        while evicted < num_blocks and self._heap:
            entry = heapq.heappop(self._heap)
            last_access, _, node = entry
            parent = node.parent
            if parent is None or node.children or node.last_access != last_access:
                continue  # stale: no longer a leaf, already dropped, or touched since
            if parent.children.get(node.segment[0]) is not node:
                continue
            if id(node) in self.locked:
                skipped.append(entry)
                continue
            del parent.children[node.segment[0]]
            node.parent = None
            evicted += len(node.segment)
            self.num_blocks -= len(node.segment)
            self._push(parent)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return evicted


def simulate_radix(
    requests: Sequence[TraceRequest], capacity_blocks: int, *, recompute_last_token: bool = False
) -> SimResult:
    """SGLang's RadixAttention cache with LRU eviction, one request at a time.

    Per request, as SGLang's scheduler does: `match_prefix` (capped like vLLM's when
    `recompute_last_token`), lock the matched path, allocate the missing blocks — when fewer are
    free, `evict(the whole allocation)`, not just the shortfall (`alloc_token_slots`) — then
    `cache_finished_req` inserts the prompt and unlocks. A request larger than the free pool
    caches the blocks that fit."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    result = SimResult("radix", capacity_blocks)
    tree = _RadixTree()
    num_evicted = 0
    for request in requests:
        blocks = request.blocks
        hit, path = tree.match(blocks[: _max_hit_blocks(request, recompute_last_token)])
        result.record(request, hit)
        need = len(blocks) - hit
        if need > capacity_blocks - tree.num_blocks:
            tree.locked = {id(n) for n in path}
            num_evicted += tree.evict(need)
            tree.locked = set()
        fits = max(0, capacity_blocks - tree.num_blocks)
        tree.insert(blocks[: hit + min(need, fits)])
    result.extra["evictions"] = num_evicted
    return result
