"""Count-min sketch with TinyLFU aging: how often has this block been seen lately?

Counters are bytes (saturating at 255) and every counter is halved once `sample_size` increments
have been recorded, so a prefix that was hot an hour ago loses to one that is hot now. Row indices
come from the block hash itself, which is already a uniform 128-bit digest: each row uses its own
32-bit slice, so no extra hashing is needed. A whole chain is counted in one vectorized call
(numpy over the same bytes), which keeps `store` cheap on the request path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["CountMinSketch"]

MAX_COUNT = 255


class CountMinSketch:
    """`depth` rows of `width` byte counters; an estimate is the minimum over the rows."""

    __slots__ = (
        "_array",
        "_counters",
        "_mask",
        "_num_increments",
        "depth",
        "num_resets",
        "sample_size",
        "width",
    )

    def __init__(
        self, width: int = 1 << 22, depth: int = 4, sample_size: int | None = None
    ) -> None:
        if width <= 0 or width & (width - 1):
            raise ValueError(f"sketch width must be a positive power of two, got {width}")
        if not 1 <= depth <= 4:
            raise ValueError(
                f"sketch depth must be in [1, 4] (32-bit slices of a 128-bit hash), got {depth}"
            )
        self.width = width
        self.depth = depth
        self.sample_size = 10 * width if sample_size is None else sample_size
        if self.sample_size <= 0:
            raise ValueError(f"sample_size must be positive, got {self.sample_size}")
        self._mask = width - 1
        # One buffer, two views: bytes for single lookups (fast in pure Python), numpy for chains.
        self._counters = bytearray(width * depth)
        self._array = np.frombuffer(self._counters, dtype=np.uint8).reshape(depth, width)
        self._num_increments = 0
        self.num_resets = 0

    def _slots(self, block_hash: bytes) -> list[int]:
        x = int.from_bytes(block_hash[:16], "little")
        return [((x >> (32 * row)) & self._mask) + row * self.width for row in range(self.depth)]

    def _columns(self, hashes: Sequence[bytes]) -> np.ndarray:
        raw = np.frombuffer(b"".join(h[:16] for h in hashes), dtype="<u4").reshape(-1, 4)
        return raw[:, : self.depth] & np.uint32(self._mask)  # [n, depth]

    def estimate(self, block_hash: bytes) -> int:
        if self.depth != 4:
            counters = self._counters
            return min(counters[i] for i in self._slots(block_hash))
        # Unrolled for the default depth: this runs once per eviction candidate.
        x = int.from_bytes(block_hash[:16], "little")
        c, m, w = self._counters, self._mask, self.width
        return min(
            c[x & m], c[w + ((x >> 32) & m)], c[2 * w + ((x >> 64) & m)], c[3 * w + ((x >> 96) & m)]
        )

    def estimate_many(self, hashes: Sequence[bytes]) -> list[int]:
        if not hashes:
            return []
        cols = self._columns(hashes)
        rows = np.arange(self.depth)
        values: list[int] = self._array[rows, cols].min(axis=1).tolist()
        return values

    def increment(self, block_hash: bytes) -> int:
        """Record one sighting and return the new estimate (conservative update: only the rows at
        the minimum are raised, which keeps over-estimation from collisions small)."""
        return self.increment_many([block_hash])[0]

    def increment_many(self, hashes: Sequence[bytes]) -> list[int]:
        """Record one sighting of each hash; returns their new estimates, in order."""
        if not hashes:
            return []
        cols = self._columns(hashes)
        rows = np.arange(self.depth)
        current = self._array[rows, cols]  # [n, depth]
        new = np.minimum(current.min(axis=1).astype(np.int32) + 1, MAX_COUNT).astype(np.uint8)
        # Conservative update: raise each row's counter to the new estimate, never beyond it.
        self._array[rows, cols] = np.maximum(current, new[:, None])
        self._num_increments += len(hashes)
        if self._num_increments >= self.sample_size:
            self.age()
        counts: list[int] = new.tolist()
        return counts

    def age(self) -> None:
        """Halve every counter (TinyLFU reset): frequencies decay so stale heat is forgotten."""
        np.right_shift(self._array, 1, out=self._array)
        self._num_increments //= 2
        self.num_resets += 1

    @property
    def num_bytes(self) -> int:
        return len(self._counters)
