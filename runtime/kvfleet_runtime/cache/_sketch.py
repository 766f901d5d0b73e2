"""Count-min sketch with TinyLFU aging: how often has this block been seen lately?

Counters are bytes (saturating at 255) and every counter is halved once `sample_size` increments
have been recorded, so a prefix that was hot an hour ago loses to one that is hot now. A long
chain is counted in one vectorized call (numpy over the same bytes), which keeps `store` cheap on
the request path; a short one (up to `_SCALAR_MAX_HASHES`) in plain Python over the bytes, where
numpy's per-call overhead is most of the cost (the fleet simulator's one-block chains paid ~10x).
Both paths give the same counters and the same estimates: the scalar path is only taken when no
two ids of the batch share a counter (then updating them one after another is the batch update).

Row indices mix the whole 128-bit id (multiply-shift over both 64-bit halves, one pair of odd
constants per row), so the policy never depends on what the ids look like: taking each row's index
from a raw 32-bit slice of the id was fine for digests but gave sequential integer ids one shared
counter in three of four rows, which capped every estimate (a different policy, not a better
sketch). Where ids of one batch share a counter, the batch update keeps the largest write, so no
id's increment is lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["CountMinSketch"]

MAX_COUNT = 255

_SCALAR_MAX_HASHES = 8
"""Chains up to this many blocks take the pure-Python path (numpy wins beyond ~10 on the bench)."""

_SATURATED_NEXT = np.minimum(np.arange(MAX_COUNT + 1) + 1, MAX_COUNT).astype(np.uint8)
"""A count after one more sighting, saturating at `MAX_COUNT` (indexed by the count before)."""

_M64 = (1 << 64) - 1
_ROW_MULTIPLIERS = (
    (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F),
    (0xBF58476D1CE4E5B9, 0x94D049BB133111EB),
    (0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD),
    (0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D),
)
"""Odd 64-bit constants (golden ratio, splitmix64, murmur3 finalizers): row r's index is the top
bits of `lo * a_r ^ hi * b_r` mod 2^64, where lo and hi are the id's two little-endian halves."""


class CountMinSketch:
    """`depth` rows of `width` byte counters; an estimate is the minimum over the rows."""

    __slots__ = (
        "_array",
        "_counters",
        "_flat_counters",
        "_mask",
        "_mults",
        "_np_mask",
        "_np_mults",
        "_np_row_offsets",
        "_np_shift",
        "_num_increments",
        "_shift",
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
        self._shift = 64 - (width.bit_length() - 1)  # keeps the top log2(width) bits
        self._mults = _ROW_MULTIPLIERS[:depth]
        self._np_mults = np.array(self._mults, dtype=np.uint64).T  # [2, depth]
        # (numpy's shift by 64 is undefined: width 1 shifts by 63 and masks to 0)
        self._np_shift = np.uint64(min(self._shift, 63))
        self._np_mask = np.uint64(self._mask)
        self._np_row_offsets = np.arange(depth, dtype=np.uint64) * np.uint64(width)
        # One buffer, two views: bytes for single lookups (fast in pure Python), numpy for chains.
        self._counters = bytearray(width * depth)
        self._array = np.frombuffer(self._counters, dtype=np.uint8).reshape(depth, width)
        self._flat_counters = self._array.reshape(-1)
        self._num_increments = 0
        self.num_resets = 0

    def _slots(self, block_hash: bytes) -> list[int]:
        lo = int.from_bytes(block_hash[:8], "little")
        hi = int.from_bytes(block_hash[8:16], "little")
        shift, width = self._shift, self.width
        return [
            ((((lo * a) ^ (hi * b)) & _M64) >> shift) + row * width
            for row, (a, b) in enumerate(self._mults)
        ]

    def _flat(self, hashes: Sequence[bytes]) -> np.ndarray:
        """Each id's counter in every row, as indices into the flat buffer: `[n, depth]`."""
        raw = b"".join(hashes)
        if len(raw) != 16 * len(hashes):  # ids longer than 16 bytes: only the first 16 count
            raw = b"".join(h[:16] for h in hashes)
        ids = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
        lo, hi = ids[:, :1], ids[:, 1:]  # [n, 1] each; uint64 products wrap mod 2^64
        flat: np.ndarray = (lo * self._np_mults[0]) ^ (hi * self._np_mults[1])  # [n, depth]
        flat >>= self._np_shift
        if self.width == 1:  # shifted by 63, not 64: mask to 0 (wider, the shift alone keeps
            flat &= self._np_mask  # log2(width) bits; one numpy call less a chain)
        flat += self._np_row_offsets
        return flat

    def estimate(self, block_hash: bytes) -> int:
        if self.depth != 4:
            counters = self._counters
            return min(counters[i] for i in self._slots(block_hash))
        # Unrolled for the default depth: this runs once per eviction candidate.
        lo = int.from_bytes(block_hash[:8], "little")
        hi = int.from_bytes(block_hash[8:16], "little")
        c, s, w = self._counters, self._shift, self.width
        (a0, b0), (a1, b1), (a2, b2), (a3, b3) = self._mults
        return min(
            c[(((lo * a0) ^ (hi * b0)) & _M64) >> s],
            c[w + ((((lo * a1) ^ (hi * b1)) & _M64) >> s)],
            c[2 * w + ((((lo * a2) ^ (hi * b2)) & _M64) >> s)],
            c[3 * w + ((((lo * a3) ^ (hi * b3)) & _M64) >> s)],
        )

    def estimate_many(self, hashes: Sequence[bytes]) -> list[int]:
        if len(hashes) <= _SCALAR_MAX_HASHES:
            return [self.estimate(h) for h in hashes]
        values: list[int] = self._flat_counters[self._flat(hashes)].min(axis=1).tolist()
        return values

    def increment(self, block_hash: bytes) -> int:
        """Record one sighting and return the new estimate (conservative update: only the rows at
        the minimum are raised, which keeps over-estimation from collisions small)."""
        return self.increment_many([block_hash])[0]

    def increment_many(self, hashes: Sequence[bytes]) -> list[int]:
        """Record one sighting of each hash; returns their new estimates, in order."""
        if not hashes:
            return []
        if len(hashes) <= _SCALAR_MAX_HASHES:
            scalar = self._increment_scalar(hashes)
            if scalar is not None:
                return scalar
        flat = self._flat(hashes)
        counters = self._flat_counters
        current = counters[flat]  # [n, depth]
        new = _SATURATED_NEXT[current.min(axis=1)]  # one lookup, not a minimum and an add
        # Conservative update: raise each row's counter to the new estimate, never beyond it.
        values = np.maximum(current, new[:, None])
        counters[flat] = values
        # Where ids of one batch share a counter the largest write must be the one kept, so no
        # id's increment is lost; a plain fancy assignment keeps an arbitrary one of them. Read
        # back: every counter at least what was written to it means each kept its largest
        # write, else the rare collision is settled by an unbuffered maximum.
        if not (counters[flat] >= values).all():
            np.maximum.at(counters, flat, values)
        self._num_increments += len(hashes)
        if self._num_increments >= self.sample_size:
            self.age()
        counts: list[int] = new.tolist()
        return counts

    def _increment_scalar(self, hashes: Sequence[bytes]) -> list[int] | None:
        """`increment_many` for a short batch in pure Python; None when two ids of the batch
        share a counter (the batch rule, largest write wins, then differs from one-by-one)."""
        slots = [self._slots(h) for h in hashes]
        if len(hashes) > 1 and len({i for row in slots for i in row}) < len(hashes) * self.depth:
            return None
        c = self._counters
        counts = []
        for ids in slots:
            new = min(min(c[i] for i in ids) + 1, MAX_COUNT)
            for i in ids:  # conservative update: raise to the new estimate, never beyond
                c[i] = max(c[i], new)
            counts.append(new)
        self._num_increments += len(hashes)
        if self._num_increments >= self.sample_size:
            self.age()
        return counts

    def age(self) -> None:
        """Halve every counter (TinyLFU reset): frequencies decay so stale heat is forgotten."""
        np.right_shift(self._array, 1, out=self._array)
        self._num_increments //= 2
        self.num_resets += 1

    @property
    def num_bytes(self) -> int:
        return len(self._counters)
