"""T2 over NIXL, the pure parts: the serving replica's lease table and the descriptors of a
leased run.

A fetcher reads a peer's blocks one-sided (NIXL READ from the peer's registered host pools,
`fleet.t2_nixl`), so the peer cannot stream around an eviction as the HTTP path does: the blocks
must stay where they lie until the read is over. The control request pins exactly the blocks of
the run for a short lease (`LeaseTable.grant`); the fetcher reads, then releases the lease
(`LeaseTable.release`), and only a release that finds its lease still live vouches for the bytes
read: a lease that ran out may have let its blocks be reused mid-read, and the fetcher then
recomputes. A pinned block is never evicted, moved or overwritten (`PrefixCache.pin`), so a live
lease means the bytes were the run's the whole time.

Descriptors: a pool is one tensor per K|V `[layers, blocks, kv_heads, 16, head_dim]` (the engine's
layout, T0 and T1 alike), so one layer of one block is `PoolGeometry.piece_bytes` contiguous
bytes, and a run of consecutive slots on both sides is one stretch per (K|V, layer).
`pair_descriptors` gives the (local, remote) NIXL descriptor lists, equal in count and in the
length of every pair, merging such stretches.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "LEASE_BUDGET_FRACTION",
    "Descriptors",
    "Lease",
    "LeaseTable",
    "PoolGeometry",
    "pair_descriptors",
]

LEASE_BUDGET_FRACTION = 0.25
"""Most of a replica's cached blocks (T0 and T1) that peers' leases may pin at once: the rest
stays free to evict for the replica's own requests."""


DEFAULT_LEASE_TTL_S = 2.0
"""How long a leased run stays pinned without a release: the fetcher's whole transfer deadline
(`PeerFetcher.timeout_s`), so a fetcher that gave up never leaves blocks pinned for longer."""


@dataclass(slots=True)
class Lease:
    lease_id: str
    tenant: str
    num_blocks: int
    expires_s: float
    unpin: Callable[[], None]
    num_bytes: int = 0
    """What the run weighs (for the serving side's metrics)."""


class LeaseTable:
    """Leases on pinned runs: granted within a budget of pinned blocks, released by their id and
    tenant, expired by the clock. `unpin` is called exactly once per lease (release or expiry).
    Thread-safe; `expire` is called by the shell on a timer and before every grant."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_LEASE_TTL_S,
        max_blocks: int,
        clock: Callable[[], float],
        new_id: Callable[[], str] = lambda: secrets.token_hex(16),
    ) -> None:
        """`max_blocks`: most blocks pinned at once for all leases together (peers must not be
        able to pin the whole cache: a grant over it is refused, and the fetcher recomputes)."""
        if ttl_s <= 0 or max_blocks < 1:
            raise ValueError("a lease table needs ttl_s > 0 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.clock = clock
        self.new_id = new_id
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.num_expired = 0
        """Leases that ran out before their release (a fetcher that died or overran)."""

    @property
    def num_leased_blocks(self) -> int:
        with self._lock:
            return sum(lease.num_blocks for lease in self._leases.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def grant(self, tenant: str, num_blocks: int, unpin: Callable[[], None], *,
              num_bytes: int = 0) -> Lease | None:
        """A lease on `num_blocks` pinned blocks, or None (and `unpin` called) when it would
        pin more than `max_blocks` in all."""
        self.expire()
        with self._lock:
            held = sum(lease.num_blocks for lease in self._leases.values())
            if num_blocks < 1 or held + num_blocks > self.max_blocks:
                lease = None
            else:
                lease = Lease(self.new_id(), tenant, num_blocks, self.clock() + self.ttl_s, unpin,
                              num_bytes)
                self._leases[lease.lease_id] = lease
        if lease is None:
            unpin()
        return lease

    def release(self, lease_id: str, tenant: str) -> Lease | None:
        """End a lease: the lease when it was live (its blocks pinned until now: what was read
        through it is the run's), None when it is unknown, expired or another tenant's (then
        nothing changes: one tenant never ends another's lease)."""
        self.expire()
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.tenant != tenant:
                return None
            del self._leases[lease_id]
        lease.unpin()
        return lease

    def expire(self) -> int:
        """Unpin every lease past its expiry; how many."""
        now = self.clock()
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.expires_s <= now]
            for lease in gone:
                del self._leases[lease.lease_id]
            self.num_expired += len(gone)
        for lease in gone:
            lease.unpin()
        return len(gone)

    def release_all(self) -> None:
        """Shutdown: unpin everything."""
        with self._lock:
            gone = list(self._leases.values())
            self._leases.clear()
        for lease in gone:
            lease.unpin()


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Where a pool's blocks lie: the address of block 0 of layer 0 of K and of V, the strides,
    and the bytes of one block of one layer (`[kv_heads, 16, head_dim]`, contiguous)."""

    k_addr: int
    v_addr: int
    layer_stride: int
    block_stride: int
    piece_bytes: int
    num_layers: int
    num_blocks: int
    mem: str = "DRAM"
    """NIXL's memory type: DRAM (host) or VRAM (a GPU's)."""
    dev_id: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"k": self.k_addr, "v": self.v_addr, "layer_stride": self.layer_stride,
                "block_stride": self.block_stride, "piece_bytes": self.piece_bytes,
                "layers": self.num_layers, "blocks": self.num_blocks, "mem": self.mem,
                "dev_id": self.dev_id}

    @classmethod
    def from_json(cls, raw: Any) -> PoolGeometry:
        """ValueError unless `raw` is a well-formed geometry."""
        fields = ("k", "v", "layer_stride", "block_stride", "piece_bytes", "layers", "blocks",
                  "dev_id")
        if not isinstance(raw, dict) or not all(
                type(raw.get(f)) is int and raw[f] >= 0 for f in fields):
            raise ValueError(f"bad pool geometry {raw!r}")
        if raw.get("mem") not in ("DRAM", "VRAM"):
            raise ValueError(f"bad pool memory type {raw.get('mem')!r}")
        geometry = cls(raw["k"], raw["v"], raw["layer_stride"], raw["block_stride"],
                       raw["piece_bytes"], raw["layers"], raw["blocks"], raw["mem"],
                       raw["dev_id"])
        if geometry.piece_bytes < 1 or geometry.block_stride < geometry.piece_bytes:
            raise ValueError(f"bad pool geometry {raw!r}")
        return geometry

    def address(self, half: int, layer: int, block: int) -> int:
        base = self.k_addr if half == 0 else self.v_addr
        return base + layer * self.layer_stride + block * self.block_stride

    def contiguous(self) -> bool:
        """Consecutive blocks of a layer are adjacent (a run of slots is one stretch)."""
        return self.block_stride == self.piece_bytes


@dataclass(frozen=True, slots=True)
class Descriptors:
    """One NIXL transfer's descriptor lists: Nx3 `(address, length, device id)` each, pair j of
    the same length; one memory type per side (NIXL's descriptor lists hold one)."""

    local_mem: str
    remote_mem: str
    local: np.ndarray[Any, np.dtype[np.uint64]]
    remote: np.ndarray[Any, np.dtype[np.uint64]]

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum())


def pair_descriptors(
    local: Sequence[PoolGeometry], local_slots: Sequence[tuple[int, int]],
    remote: Sequence[PoolGeometry], remote_slots: Sequence[tuple[int, int]],
) -> list[Descriptors]:
    """The NIXL descriptor lists that move block i of a run from `remote_slots[i]` (pool,
    slot) to `local_slots[i]`, every layer of K and of V: one `Descriptors` per pair of memory
    types (a run may lie partly in T0 and partly in T1). Consecutive blocks that are
    consecutive slots of one pool on both sides merge into one stretch per (K|V, layer).
    ValueError when the two sides' blocks differ in size or layer count, or a slot lies outside
    its pool."""
    if len(local_slots) != len(remote_slots):
        raise ValueError(f"{len(local_slots)} local blocks for {len(remote_slots)} remote")
    for slots, pools in ((local_slots, local), (remote_slots, remote)):
        for pool, slot in slots:
            if not (0 <= pool < len(pools) and 0 <= slot < pools[pool].num_blocks):
                raise ValueError(f"slot {slot} of pool {pool} is outside the pools")
    shapes = {(local[p].piece_bytes, local[p].num_layers) for p, _ in local_slots}
    shapes |= {(remote[p].piece_bytes, remote[p].num_layers) for p, _ in remote_slots}
    if len(shapes) > 1:
        raise ValueError(f"blocks differ in (bytes per layer, layers): {sorted(shapes)}")
    runs: list[tuple[int, int, int, int, int]] = []  # (local pool, slot, remote pool, slot, n)
    for (lp, ls), (rp, rs) in zip(local_slots, remote_slots, strict=True):
        if runs:
            a, b, c, d, n = runs[-1]
            if (a == lp and c == rp and b + n == ls and d + n == rs
                    and local[lp].contiguous() and remote[rp].contiguous()):
                runs[-1] = (a, b, c, d, n + 1)
                continue
        runs.append((lp, ls, rp, rs, 1))
    if not runs:
        return []
    piece, layers = shapes.pop()
    groups: dict[tuple[str, str], list[tuple[int, int, int, int, int]]] = {}
    for run in runs:
        groups.setdefault((local[run[0]].mem, remote[run[2]].mem), []).append(run)
    out: list[Descriptors] = []
    for (local_mem, remote_mem), group in groups.items():
        rows = 2 * layers * len(group)
        mine = np.empty((rows, 3), dtype=np.uint64)
        theirs = np.empty((rows, 3), dtype=np.uint64)
        row = 0
        for half in (0, 1):
            for layer in range(layers):
                for lp, ls, rp, rs, n in group:
                    mine[row] = (local[lp].address(half, layer, ls), n * piece, local[lp].dev_id)
                    theirs[row] = (remote[rp].address(half, layer, rs), n * piece,
                                   remote[rp].dev_id)
                    row += 1
        out.append(Descriptors(local_mem, remote_mem, mine, theirs))
    return out
