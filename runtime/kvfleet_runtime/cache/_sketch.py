"""Count-min sketch with TinyLFU aging: how often has this block been seen lately?

Counters saturate at 15 (4 bits of information, as in TinyLFU) and every counter is halved once
`sample_size` increments have been recorded, so a prefix that was hot an hour ago loses to one that
is hot now. Pure and allocation-free on the hot path: indices come from the block hash itself, which
is already a uniform 128-bit digest, so no extra hashing is needed.
"""

from __future__ import annotations

__all__ = ["CountMinSketch"]

_MAX_COUNT = 15
_HALVE = bytes(i >> 1 for i in range(256))


class CountMinSketch:
    """`depth` rows of `width` byte counters; an estimate is the minimum over the rows."""

    __slots__ = (
        "_counters",
        "_mask",
        "_num_increments",
        "depth",
        "num_resets",
        "sample_size",
        "width",
    )

    def __init__(
        self, width: int = 1 << 16, depth: int = 4, sample_size: int | None = None
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
        self._counters = bytearray(width * depth)
        self._num_increments = 0
        self.num_resets = 0

    def _slots(self, block_hash: bytes) -> list[int]:
        x = int.from_bytes(block_hash[:16], "little")
        # Each row uses its own 32-bit slice of the digest; rows are laid out one after another.
        return [((x >> (32 * row)) & self._mask) + row * self.width for row in range(self.depth)]

    def estimate(self, block_hash: bytes) -> int:
        counters = self._counters
        return min(counters[i] for i in self._slots(block_hash))

    def increment(self, block_hash: bytes) -> int:
        """Record one sighting and return the new estimate (conservative update: only the rows at
        the minimum are raised, which keeps over-estimation from collisions small)."""
        counters = self._counters
        slots = self._slots(block_hash)
        current = min(counters[i] for i in slots)
        if current < _MAX_COUNT:
            for i in slots:
                if counters[i] == current:
                    counters[i] = current + 1
            current += 1
        self._num_increments += 1
        if self._num_increments >= self.sample_size:
            self.age()
        return current

    def age(self) -> None:
        """Halve every counter (TinyLFU reset): frequencies decay so stale heat is forgotten."""
        self._counters = bytearray(self._counters.translate(_HALVE))
        self._num_increments //= 2
        self.num_resets += 1

    @property
    def num_bytes(self) -> int:
        return len(self._counters)
