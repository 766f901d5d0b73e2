"""Block ids of one tier pool: which slots are free, and how to group ids into contiguous runs.

Pure bookkeeping (the tensors live in `_pool.py`). Free ids are handed out lowest first so that a
prefix written into a fresh or lightly fragmented pool lands in one contiguous run, which the pool
then moves with one copy instead of one per block.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["BlockAllocator", "contiguous_runs", "paired_runs"]


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
    if len(src) != len(dst):
        raise ValueError(f"src and dst must have equal lengths, got {len(src)} and {len(dst)}")
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((src[start], dst[start], i - start))
            start = i
    return runs if src else []
