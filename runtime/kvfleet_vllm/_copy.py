"""Block copies between the host pool (kvfleet's canonical layout) and vLLM's paged KV.

Host pool, one file shared by the engine's processes: K and V `[num_layers, num_kv_heads,
num_slots, 16, head_dim]`, all heads, whatever the TP degree (the layout of
`kvfleet_runtime.cache`'s pools). vLLM 0.33 hands every attention layer to the connector as a
logical `[blocks, heads, tokens_per_block, 2 * head_dim]` view (K in the first `head_dim` of the
last axis, V in the rest); which axis is outermost in memory is the KV cache layout the attention
backend chose (`vllm.v1.kv_cache_layout.KVCacheLayout`: LBHNC for FlashInfer and the CPU backend,
LBNHC for FlashAttention's default and FlexAttention, ...). The copies index the logical view, so
every layout is one code path; strides are vLLM's business.

TP: vLLM shards KV heads contiguously (`QKVParallelLinear`: rank r holds heads [r * H/tp,
(r+1) * H/tp)), and when tp > H each head is replicated on tp/H consecutive ranks. kvfleet's own
engine takes heads h % tp == r instead; both read and write the same canonical pool, so a block
stored at TP1 loads into TP2 and TP4 workers of either engine. Mapping a vLLM rank by h % tp would
put other heads' KV in its cache: the map is the engine's, the pool layout is shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet_runtime.cache import BLOCK_SIZE, KVLayout, paired_runs

__all__ = ["HostPool", "RankHeads", "load_blocks", "save_blocks", "view_positions"]


@dataclass(slots=True, frozen=True)
class RankHeads:
    """The global KV heads one TP rank of a vLLM engine holds, and whether it writes them."""

    start: int
    stop: int
    writer: bool
    """False on the replicas of a head beyond the first (tp > num_kv_heads): one write each."""

    @classmethod
    def for_rank(cls, num_kv_heads: int, tp_size: int, tp_rank: int) -> RankHeads:
        if tp_size <= 0 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got rank {tp_rank} of {tp_size}")
        if tp_size <= num_kv_heads:
            if num_kv_heads % tp_size:
                raise ValueError(f"tp_size {tp_size} must divide num_kv_heads={num_kv_heads}")
            per = num_kv_heads // tp_size
            return cls(tp_rank * per, (tp_rank + 1) * per, True)
        if tp_size % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide tp_size {tp_size}")
        replicas = tp_size // num_kv_heads
        head = tp_rank // replicas
        return cls(head, head + 1, tp_rank % replicas == 0)

    @property
    def num_heads(self) -> int:
        return self.stop - self.start


class HostPool:
    """K and V of `num_slots` canonical blocks in one shared file (`/dev/shm/...` in a pod), so
    the scheduler process plans slots and every worker process copies into the same memory."""

    __slots__ = ("k", "layout", "num_slots", "path", "v")

    def __init__(self, path: Path, layout: KVLayout, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"host pool needs > 0 slots, got {num_slots}")
        dtype = getattr(torch, layout.dtype)
        shape = (2, layout.num_layers, layout.num_kv_heads, num_slots, BLOCK_SIZE,
                 layout.head_dim)
        numel = 1
        for n in shape:
            numel *= n
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # shared=True maps the file MAP_SHARED (created at this size when absent): every
        # process of the engine that opens it sees the same bytes.
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        kv = flat.view(shape)
        self.path = path
        self.layout = layout
        self.num_slots = num_slots
        self.k = kv[0]
        self.v = kv[1]


def view_positions(
    block_table: Sequence[int], chain_blocks: Sequence[int], *, vllm_block_size: int,
    view_block_tokens: int,
) -> list[tuple[int, int]]:
    """(view block, token offset) of each kvfleet 16-token block `chain_blocks[i]` (its index in
    the request's chain) in a layer view of `view_block_tokens` tokens per block, for a request
    whose vLLM block table (manager blocks of `vllm_block_size` tokens) is `block_table`. A view
    block is smaller than a manager block when the backend splits blocks into kernel blocks."""
    ratio = vllm_block_size // view_block_tokens
    per = vllm_block_size // BLOCK_SIZE
    out = []
    for j in chain_blocks:
        offset = (j % per) * BLOCK_SIZE
        out.append((block_table[j // per] * ratio + offset // view_block_tokens,
                    offset % view_block_tokens))
    return out


def _groups(
    positions: Sequence[tuple[int, int]], slots: Sequence[int]
) -> dict[int, tuple[list[int], list[int]]]:
    by_offset: dict[int, tuple[list[int], list[int]]] = {}
    for (block, offset), slot in zip(positions, slots, strict=True):
        blocks, group_slots = by_offset.setdefault(offset, ([], []))
        blocks.append(block)
        group_slots.append(slot)
    return by_offset


def _use_runs(runs: list[tuple[int, int, int]], num_blocks: int) -> bool:
    # Slot and block runs (allocators hand out consecutive ids) copy as plain slices, 5-8x
    # faster than a gather and a scatter on CPU; scattered ids go through one index copy.
    return len(runs) * 2 <= num_blocks


def load_blocks(
    pool: HostPool, layer: int, view: torch.Tensor, heads: RankHeads,
    positions: Sequence[tuple[int, int]], slots: Sequence[int],
) -> None:
    """Copy host slots `slots[i]` of `layer` into `view` at `positions[i]` (this rank's heads):
    one copy per run of consecutive slots and blocks, or one gather and one scatter per tensor
    and token offset when the ids are scattered; never one copy per block."""
    d = pool.layout.head_dim
    k_src, v_src = pool.k[layer, heads.start:heads.stop], pool.v[layer, heads.start:heads.stop]
    for offset, (blocks, group_slots) in _groups(positions, slots).items():
        dst = view[:, :, offset:offset + BLOCK_SIZE]
        runs = paired_runs(group_slots, blocks)
        if _use_runs(runs, len(blocks)):
            for src_slot, dst_block, n in runs:
                for src, part in ((k_src, slice(0, d)), (v_src, slice(d, 2 * d))):
                    dst[dst_block:dst_block + n, :, :, part].copy_(
                        src[:, src_slot:src_slot + n].permute(1, 0, 2, 3), non_blocking=True)
            continue
        slot_idx = torch.tensor(group_slots, dtype=torch.long)
        block_idx = torch.tensor(blocks, dtype=torch.long, device=view.device)
        for src, part in ((k_src, slice(0, d)), (v_src, slice(d, 2 * d))):
            # [heads, n, 16, D] -> [n, heads, 16, D], the view's block-major order
            data = src.index_select(1, slot_idx).permute(1, 0, 2, 3)
            dst[:, :, :, part].index_copy_(0, block_idx, data.to(view.device, non_blocking=True))


def save_blocks(
    pool: HostPool, layer: int, view: torch.Tensor, heads: RankHeads,
    positions: Sequence[tuple[int, int]], slots: Sequence[int],
) -> None:
    """Copy `view` at `positions[i]` (this rank's heads) into host slots `slots[i]` of `layer`."""
    if not heads.writer:
        return
    d = pool.layout.head_dim
    k_dst, v_dst = pool.k[layer, heads.start:heads.stop], pool.v[layer, heads.start:heads.stop]
    for offset, (blocks, group_slots) in _groups(positions, slots).items():
        src = view[:, :, offset:offset + BLOCK_SIZE]
        runs = paired_runs(blocks, group_slots)
        if _use_runs(runs, len(blocks)):
            for src_block, dst_slot, n in runs:
                for dst, part in ((k_dst, slice(0, d)), (v_dst, slice(d, 2 * d))):
                    dst[:, dst_slot:dst_slot + n].copy_(
                        src[src_block:src_block + n, :, :, part].permute(1, 0, 2, 3))
            continue
        slot_idx = torch.tensor(group_slots, dtype=torch.long)
        block_idx = torch.tensor(blocks, dtype=torch.long, device=view.device)
        for dst, part in ((k_dst, slice(0, d)), (v_dst, slice(d, 2 * d))):
            data = src[:, :, :, part].index_select(0, block_idx).permute(1, 0, 2, 3)
            dst.index_copy_(1, slot_idx, data.to("cpu"))
