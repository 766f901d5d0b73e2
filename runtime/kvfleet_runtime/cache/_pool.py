"""Tensor pools of one tier, in the canonical TP-agnostic layout, and the run copies between them.

K and V are each `[num_layers, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim]`
("[layer][kv_head][block][head_dim]" with the 16 tokens of a block inside). A TP-t replica's rank r
takes heads `h % t == r`, a strided view of the same storage, so TP1/2/4/8 all read the same blocks.
Every transfer is one `copy_` per contiguous run of blocks, never one per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet_runtime.cache._allocator import paired_runs
from kvfleet_runtime.cache._config import KVLayout
from kvfleet_runtime.cache._index import Move
from kvfleet_runtime.cache._keys import BLOCK_SIZE

__all__ = ["TensorPool", "execute_moves", "torch_dtype"]


def _split_blocks(t: torch.Tensor) -> torch.Tensor:
    """View `[layers, heads, n * 16, head_dim]` as `[layers, heads, n, 16, head_dim]` (splitting
    one dimension is always a view, even of a strided slice)."""
    layers, heads, tokens, head_dim = t.shape
    return t.view(layers, heads, tokens // BLOCK_SIZE, BLOCK_SIZE, head_dim)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


class TensorPool:
    __slots__ = ("device", "k", "layout", "num_blocks", "v")

    def __init__(
        self, layout: KVLayout, num_blocks: int, device: torch.device, *, pin_memory: bool
    ) -> None:
        shape = (layout.num_layers, layout.num_kv_heads, num_blocks, BLOCK_SIZE, layout.head_dim)
        dtype = torch_dtype(layout.dtype)
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.k = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    def write(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy `k`/`v` `[layers, heads, len(block_ids) * 16, head_dim]` into `block_ids`."""
        src_blocks = list(range(len(block_ids)))
        for src, dst, n in paired_runs(src_blocks, block_ids):
            lo, hi = src * BLOCK_SIZE, (src + n) * BLOCK_SIZE
            self.k[:, :, dst : dst + n].copy_(_split_blocks(k[:, :, lo:hi]))
            self.v[:, :, dst : dst + n].copy_(_split_blocks(v[:, :, lo:hi]))

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
        ok = _split_blocks(out_k)
        ov = _split_blocks(out_v)
        runs = paired_runs(block_ids, out_blocks)
        for src, dst, n in runs:
            ok[:, :, dst : dst + n].copy_(self.k[:, heads, src : src + n])
            ov[:, :, dst : dst + n].copy_(self.v[:, heads, src : src + n])
        return len(runs)


def execute_moves(pools: Sequence[TensorPool | None], moves: Sequence[Move]) -> int:
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
        for src, dst, n in paired_runs([m.src_id for m in batch], [m.dst_id for m in batch]):
            dst_pool.k[:, :, dst : dst + n].copy_(src_pool.k[:, :, src : src + n])
            dst_pool.v[:, :, dst : dst + n].copy_(src_pool.v[:, :, src : src + n])
            num_copies += 1
        i = j
    return num_copies
