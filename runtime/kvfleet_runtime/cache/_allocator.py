"""Block ids of one tier pool: which slots are free, and how to group ids into contiguous runs.

Pure bookkeeping (the tensors live in `_pool.py`). `BlockAllocator` is a pool the index owns
alone (T1); `BlockRefs` is the engine's device pool, ref-counted between sequences and the cache,
and `CachedSlots` is the index's view of it (T0 is the engine's KV). Free ids are handed out
lowest first so that a prefix written into a fresh or lightly fragmented pool lands in one
contiguous run, which the pool then moves with one copy instead of one per block.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

__all__ = ["BlockAllocator", "BlockRefs", "CachedSlots", "Slots", "contiguous_runs", "paired_runs"]


class BlockAllocator:
    """The free ids of a pool of `num_blocks` slots. Not enough room returns None."""

    __slots__ = ("_free", "_is_free", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # sorted, hence already a heap
        self._is_free = bytearray(b"\x01" * num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` ids, lowest first, or None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > len(self._free):
            return None
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for i in ids:
            self._is_free[i] = 0
        return ids

    def free(self, ids: Sequence[int]) -> None:
        for i in ids:
            # A double free would hand one slot to two blocks: that is silent corruption.
            assert 0 <= i < self.num_blocks and not self._is_free[i], f"double free of block {i}"
            self._is_free[i] = 1
            heapq.heappush(self._free, i)

    def is_free(self, block_id: int) -> bool:
        return bool(self._is_free[block_id])

    def all_free(self, ids: Sequence[int]) -> bool:
        is_free = self._is_free
        return all(is_free[i] for i in ids)

    def in_use(self, block_id: int) -> bool:
        """Held outside the index? Never: a plain pool's slots belong to the index alone."""
        return False


class Slots(Protocol):
    """What the index needs of a tier's slots: `BlockAllocator`, or `CachedSlots` when T0 is the
    engine's KV (then `free` means "the cache lets go", and the block may live on in a sequence)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def allocate(self, n: int) -> list[int] | None: ...
    def free(self, ids: Sequence[int]) -> None: ...
    def is_free(self, block_id: int) -> bool: ...
    def all_free(self, ids: Sequence[int]) -> bool:
        """`is_free` of every id, in one call (a prompt's blocks before they are adopted)."""
        ...
    def in_use(self, block_id: int) -> bool: ...


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split `ids` into runs of consecutive ids: (offset in `ids`, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs if ids else []


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs along which both `src` and `dst` ids are consecutive: (first src, first dst, length).

    One run is one copy, so a block-by-block copy loop becomes a handful of large copies."""
    n = len(src)
    if n != len(dst):
        raise ValueError(f"src and dst must have equal lengths, got {n} and {len(dst)}")
    # The common case, one run on both sides (a hit copied into fresh blocks), compared in C:
    # 2 us instead of the loop's 8 on 125 ids (warm), on the T1 hit's copy path.
    if n and list(src) == list(range(src[0], src[0] + n)) and (
            list(dst) == list(range(dst[0], dst[0] + n))):
        return [(src[0], dst[0], n)]
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((src[start], dst[start], i - start))
            start = i
    return runs if src else []


class BlockRefs:
    """The free list of one device pool shared by in-flight sequences and the cache (T0).

    A block is free, or held by users (sequences and pending stores, counted: a prefix hit shares
    a cached block with every sequence that uses it), or held by the cache (one flag: the index
    files it under a chain hash), or both. It returns to the free list only when no user holds it
    and the cache does not either, so a block a sequence still reads is never handed out again.
    Not thread-safe: the pool's lock serializes callers."""

    __slots__ = ("_cached", "_free", "_refs", "num_blocks", "num_cache_only", "num_cached")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # sorted, hence already a heap
        self._refs = [0] * num_blocks
        self._cached = bytearray(num_blocks)
        self.num_cached = 0
        """Blocks the cache holds (with or without users)."""
        self.num_cache_only = 0
        """Blocks only the cache holds: what reclaiming can give back to in-flight work."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def is_cached(self, block_id: int) -> bool:
        return bool(self._cached[block_id])

    def is_free(self, block_id: int) -> bool:
        return not self._refs[block_id] and not self._cached[block_id]

    def _pop(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        free = self._free
        if n > len(free):
            return None
        if 8 * n >= len(free):
            # Most of the heap (a full pool's reclaim just freed about n): one sort, then the
            # lowest n, as n pops would give them; a sorted list is still a heap.
            free.sort()
            ids = free[:n]
            del free[:n]
            return ids
        return [heapq.heappop(free) for _ in range(n)]

    def allocate(self, n: int) -> list[int] | None:
        """`n` free ids, lowest first, each with one user ref; None when fewer are free."""
        ids = self._pop(n)
        refs = self._refs  # bound once: these loops run once per block of a prompt
        for i in ids or ():
            refs[i] = 1
        return ids

    def allocate_cached(self, n: int) -> list[int] | None:
        """`n` free ids held by the cache alone (a block written into T0 by copy)."""
        ids = self._pop(n)
        for i in ids or ():
            self._cached[i] = 1
        if ids:
            self.num_cached += len(ids)
            self.num_cache_only += len(ids)
        return ids

    def share(self, ids: Sequence[int]) -> None:
        """One more user of each (held) block: a sequence placing a cached block in its table."""
        for i in ids:
            assert not self.is_free(i), f"share of free block {i}"
            if self._cached[i] and not self._refs[i]:
                self.num_cache_only -= 1
            self._refs[i] += 1

    def release(self, ids: Sequence[int]) -> None:
        """One user fewer on each block; a block nobody holds any more is free again."""
        refs, cached, free = self._refs, self._cached, self._free
        num_cache_only = 0
        for i in ids:
            held = refs[i]
            assert held > 0, f"release of block {i} that no user holds"
            refs[i] = held = held - 1
            if not held:
                if cached[i]:
                    num_cache_only += 1
                else:
                    heapq.heappush(free, i)
        self.num_cache_only += num_cache_only

    def cache(self, ids: Sequence[int]) -> None:
        """The cache starts holding user-held blocks (a prompt's blocks indexed in place)."""
        refs, cached = self._refs, self._cached
        for i in ids:
            assert refs[i] > 0 and not cached[i], f"cache of block {i}"
            cached[i] = 1
        self.num_cached += len(ids)

    def uncache(self, ids: Sequence[int]) -> None:
        """The cache stops holding the blocks (evicted, demoted or invalidated)."""
        cached, refs = self._cached, self._refs
        freed = []
        for i in ids:
            assert cached[i], f"uncache of block {i} the cache does not hold"
            cached[i] = 0
            if not refs[i]:
                freed.append(i)
        self.num_cached -= len(ids)
        self.num_cache_only -= len(freed)
        free = self._free
        if len(freed) > len(free):  # more than the heap holds: one heapify, not a push each
            free.extend(freed)
            heapq.heapify(free)
        else:
            for i in freed:
                heapq.heappush(free, i)


class CachedSlots:
    """The cache's side of a shared `BlockRefs`, with `BlockAllocator`'s interface: what the
    index sees of T0 when T0 is the engine's KV. "Used" means held by the cache."""

    __slots__ = ("refs",)

    def __init__(self, refs: BlockRefs) -> None:
        self.refs = refs

    @property
    def num_blocks(self) -> int:
        return self.refs.num_blocks

    @property
    def num_free(self) -> int:
        return self.refs.num_free

    @property
    def num_used(self) -> int:
        return self.refs.num_cached

    def allocate(self, n: int) -> list[int] | None:
        return self.refs.allocate_cached(n)

    def free(self, ids: Sequence[int]) -> None:
        self.refs.uncache(ids)

    def is_free(self, block_id: int) -> bool:
        return not self.refs.is_cached(block_id)

    def all_free(self, ids: Sequence[int]) -> bool:
        cached = self.refs._cached
        return not any(map(cached.__getitem__, ids))

    def in_use(self, block_id: int) -> bool:
        """A sequence (or a pending write) still holds it: evicting it frees no room."""
        return self.refs._refs[block_id] > 0  # once per eviction victim: no second call

    def adopt(self, ids: Sequence[int]) -> None:
        self.refs.cache(ids)
