"""The tensors of each tier, and the run copies between them.

T0 is the engine's own KV (`PagedBlocks`, the layout attention reads): K and V each
`[num_layers, num_blocks, num_kv_heads, BLOCK_SIZE, head_dim]`, one pool per device whose blocks
hold an in-flight sequence's KV, a cached prefix, or both (`BlockRefs` counts who holds each).
A T0 hit is block ids placed in a sequence's table; storing a prompt is indexing its blocks.

T1 (host, `TensorPool`) stores its blocks in the engine's layout too, `[num_layers, num_blocks,
num_kv_heads, BLOCK_SIZE, head_dim]`: the hot copy is a T1 hit into the engine's blocks, and with
both sides alike a run of blocks is one contiguous stretch per layer on each side (a plain
memcpy). Stored as the canonical `[layers, heads, blocks, 16, D]` instead, the same copy
transposes heads and blocks, 16 x head_dim elements at a time: 0.36x a raw copy of the bytes on
CPU, against 1.16x alike (measured side by side, interleaved). A TP-t replica's rank r still takes
heads `h % t == r` as a strided view of the same storage, so TP1/2/4/8 all read the same blocks.

Both pools expose a run of blocks as the same canonical-order view `[layers, heads, n, 16, D]`
(`blocks`), so every transfer between tiers, into the engine's blocks or out to a peer (which
reads and sends the canonical layout, `[layers, heads, tokens, D]`) is one `copy_` per
contiguous run of blocks, never one per block.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Self

import torch

from kvfleet_runtime.cache._allocator import BlockRefs, paired_runs
from kvfleet_runtime.cache._config import KVLayout
from kvfleet_runtime.cache._keys import BLOCK_SIZE
from kvfleet_runtime.cache._moves import Move

__all__ = [
    "PagedBlocks",
    "Pool",
    "TensorPool",
    "copy_runs",
    "execute_moves",
    "read_blocks_into",
    "split_blocks",
    "torch_dtype",
    "write_blocks",
]


def split_blocks(t: torch.Tensor) -> torch.Tensor:
    """View `[layers, heads, n * 16, head_dim]` as `[layers, heads, n, 16, head_dim]` (splitting
    one dimension is always a view, even of a strided slice); already split: as it is."""
    if t.dim() == 5:
        return t
    layers, heads, tokens, head_dim = t.shape
    return t.view(layers, heads, tokens // BLOCK_SIZE, BLOCK_SIZE, head_dim)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _zeros_kv(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, pin_memory: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a pool, zeroed: the two halves of one `[2, *shape]` tensor, so that a copy of
    blocks between two such pools moves K and V in one call (`kv_pair`)."""
    both = torch.zeros((2, *shape), dtype=dtype, device=device, pin_memory=pin_memory)
    return both[0], both[1]


def kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """`[2, layers, blocks, heads, 16, D]`: the pool's K and V as one tensor, when V lies right
    after K in one contiguous allocation (`_zeros_kv`); else None.

    Why: a pool's K and V copied as two calls ran at 0.85x a raw copy of the same bytes on one
    thread and ~0.6x on two (each call is a dispatch and, threaded, a fork-join); one call over
    both runs at ~1.0x."""
    if (
        not k.is_contiguous()
        or v.stride() != k.stride()
        or v.dtype != k.dtype
        or v.device != k.device
        or v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        or v.storage_offset() != k.storage_offset() + k.numel()
    ):
        return None
    return k.as_strided((2, *k.shape), (k.numel(), *k.stride()))


@dataclass(slots=True, eq=False)
class PagedBlocks:
    """One device's block pool: the engine's KV, and T0 of the cache bound to it.

    k, v: `[n_layers, num_blocks, n_kv_heads, BLOCK_SIZE, head_dim]`. A sequence owns a block
    table (a list of block ids); token p lives in block `table[p // 16]`, slot `p % 16`. `lock`
    serializes the allocator between the engine thread and the cache (a bound cache uses it as
    its own lock); `reclaimer(n)` is the bound cache's way to free cached blocks when `take`
    finds fewer than n free."""

    k: torch.Tensor
    v: torch.Tensor
    refs: BlockRefs
    lock: threading.RLock = field(default_factory=threading.RLock)
    reclaimer: Callable[[int], None] | None = None
    kv: torch.Tensor | None = field(init=False, default=None)
    """K and V as one tensor when they share one allocation (`kv_pair`), else None."""

    def __post_init__(self) -> None:
        self.kv = kv_pair(self.k, self.v)

    @classmethod
    def zeros(cls, layout: KVLayout, num_blocks: int, device: torch.device) -> PagedBlocks:
        shape = (layout.num_layers, num_blocks, layout.num_kv_heads, BLOCK_SIZE, layout.head_dim)
        return cls.of_shape(shape, torch_dtype(layout.dtype), device)

    @classmethod
    def of_shape(
        cls, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device
    ) -> Self:
        """A zeroed pool of K and V `shape` (`[layers, blocks, heads, 16, D]`), both in one
        allocation (`kv_pair`)."""
        k, v = _zeros_kv(shape, dtype, device)
        return cls(k=k, v=v, refs=BlockRefs(shape[1]))

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_free_blocks(self) -> int:
        """Blocks new work can have: free ones, plus cached ones no sequence uses (the cache gives
        them back on demand, in its eviction order)."""
        return self.refs.num_free + self.refs.num_cache_only

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the cache holds (some may also be in sequences' tables)."""
        return self.refs.num_cached

    def take(self, n: int) -> list[int] | None:
        """n blocks for a sequence (one ref each), or None when there is not enough room even
        after the bound cache reclaimed what it could."""
        with self.lock:
            ids = self.refs.allocate(n)
            if ids is not None or self.reclaimer is None:
                return ids
            if self.refs.num_free + self.refs.num_cache_only < n:
                return None  # not even every cached block would do: evict nothing in vain
            short = n
        # Outside the lock: the cache takes it itself and calls its listeners after releasing it.
        self.reclaimer(short)
        with self.lock:
            return self.refs.allocate(n)

    def share(self, blocks: Sequence[int]) -> None:
        """One more holder of each block (a cached block placed in another sequence's table)."""
        with self.lock:
            self.refs.share(blocks)

    def give_back(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each block; a block nobody holds (cache included) is free again."""
        with self.lock:
            self.refs.release(blocks)

    def blocks(self, t: torch.Tensor, lo: int, n: int) -> torch.Tensor:
        """Blocks [lo, lo + n) of `t` (this pool's k or v) as `[layers, heads, n, 16, D]`."""
        return t[:, lo : lo + n].transpose(1, 2)


class TensorPool:
    """T1: host blocks in the engine's layout (pinned when CUDA is present)."""

    __slots__ = ("device", "k", "kv", "layout", "num_blocks", "v")

    def __init__(
        self, layout: KVLayout, num_blocks: int, device: torch.device, *, pin_memory: bool
    ) -> None:
        shape = (layout.num_layers, num_blocks, layout.num_kv_heads, BLOCK_SIZE, layout.head_dim)
        dtype = torch_dtype(layout.dtype)
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.k, self.v = _zeros_kv(shape, dtype, device, pin_memory=pin_memory)
        self.kv = kv_pair(self.k, self.v)
        """K and V as one tensor (`kv_pair`)."""

    def blocks(self, t: torch.Tensor, lo: int, n: int) -> torch.Tensor:
        """Blocks [lo, lo + n) of `t` (this pool's k or v) as `[layers, heads, n, 16, D]`."""
        return t[:, lo : lo + n].transpose(1, 2)

    def write(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy `k`/`v` `[layers, heads, len(block_ids) * 16, head_dim]` into `block_ids`."""
        write_blocks(self, block_ids, k, v)

    def read_into(
        self,
        out_k: torch.Tensor,
        out_v: torch.Tensor,
        block_ids: Sequence[int],
        out_blocks: Sequence[int],
        heads: slice,
    ) -> int:
        """Copy blocks into `out_*` viewed as `[layers, heads', blocks, 16, head_dim]`; returns the
        number of copies (runs) made per tensor."""
        return read_blocks_into(self, out_k, out_v, block_ids, out_blocks, heads)


Pool = PagedBlocks | TensorPool


def write_blocks(pool: Pool, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Copy canonical `k`/`v` `[layers, heads, len(block_ids) * 16, D]` into the pool's blocks."""
    src_blocks = list(range(len(block_ids)))
    for src, dst, n in paired_runs(src_blocks, block_ids):
        lo, hi = src * BLOCK_SIZE, (src + n) * BLOCK_SIZE
        pool.blocks(pool.k, dst, n).copy_(split_blocks(k[:, :, lo:hi]))
        pool.blocks(pool.v, dst, n).copy_(split_blocks(v[:, :, lo:hi]))


def read_blocks_into(
    pool: Pool,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    block_ids: Sequence[int],
    out_blocks: Sequence[int],
    heads: slice,
) -> int:
    """Copy the pool's blocks into canonical `out_*` at `out_blocks`; returns copies per tensor."""
    ok = split_blocks(out_k)
    ov = split_blocks(out_v)
    runs = paired_runs(block_ids, out_blocks)
    for src, dst, n in runs:
        ok[:, :, dst : dst + n].copy_(pool.blocks(pool.k, src, n)[:, heads])
        ov[:, :, dst : dst + n].copy_(pool.blocks(pool.v, src, n)[:, heads])
    return len(runs)


@contextmanager
def _side_stream(src: Pool, dst: Pool) -> Iterator[bool]:
    """Host <-> device copies on CUDA run non-blocking on a side stream (pinned host memory), so
    they overlap the compute queued on the current stream. The host thread then waits for the
    side stream: a host slot may be freed and rewritten by the CPU right after (a promotion frees
    its T1 slot) and a demoted block may be read by a peer at once, so neither may race the DMA."""
    devices = {src.k.device.type, dst.k.device.type}
    if "cuda" not in devices or devices == {"cuda"} or not torch.cuda.is_available():
        yield False
        return
    device = src.k.device if src.k.device.type == "cuda" else dst.k.device
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield True
    stream.synchronize()
    current.wait_stream(stream)


def copy_runs(src: Pool, src_ids: Sequence[int], dst: Pool, dst_ids: Sequence[int]) -> int:
    """Copy blocks `src_ids` of `src` into `dst_ids` of `dst`, one copy per run along which both
    are consecutive; returns the number of copies per tensor."""
    runs = paired_runs(src_ids, dst_ids)
    src_kv, dst_kv = src.kv, dst.kv
    same_layout = (src_kv is not None and dst_kv is not None  # all but the blocks' count
                   and src_kv.shape[:2] + src_kv.shape[3:] == dst_kv.shape[:2] + dst_kv.shape[3:])
    # Host to host (a T1 hit on CPU) needs no side stream: skip its setup.
    host = not (src.k.is_cuda or dst.k.is_cuda)
    with nullcontext(False) if host else _side_stream(src, dst) as non_blocking:
        for s, d, n in runs:
            if src_kv is not None and dst_kv is not None and same_layout:
                # K and V in one call (`kv_pair`); both pools' blocks are [L, N, ...].
                dst_kv[:, :, d : d + n].copy_(src_kv[:, :, s : s + n], non_blocking=non_blocking)
                continue
            dst.blocks(dst.k, d, n).copy_(src.blocks(src.k, s, n), non_blocking=non_blocking)
            dst.blocks(dst.v, d, n).copy_(src.blocks(src.v, s, n), non_blocking=non_blocking)
    return len(runs)


def execute_moves(pools: Sequence[Pool | None], moves: Sequence[Move]) -> int:
    """Carry out planned moves in order, batching consecutive moves between the same two tiers
    into runs. Returns the number of copies per tensor."""
    num_copies = 0
    i = 0
    while i < len(moves):
        j = i
        while j < len(moves) and (moves[j].src_tier, moves[j].dst_tier) == (
            moves[i].src_tier,
            moves[i].dst_tier,
        ):
            j += 1
        src_pool, dst_pool = pools[moves[i].src_tier], pools[moves[i].dst_tier]
        assert src_pool is not None and dst_pool is not None, "move into a disabled tier"
        batch = moves[i:j]
        num_copies += copy_runs(
            src_pool, [m.src_id for m in batch], dst_pool, [m.dst_id for m in batch]
        )
        i = j
    return num_copies
