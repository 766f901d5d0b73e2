"""The connector's copies on CUDA: a page-locked host pool and vLLM-shaped layer views on the GPU
round-trip bitwise (loads are non-blocking DMAs ordered on the current stream, saves stage on
the device). Needs no vllm (the copies are torch only), so scripts/gpu-check.sh runs it in the
main environment; without CUDA it is skipped with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet_runtime.cache import KVLayout
from kvfleet_vllm._copy import (
    HostPool,
    RankHeads,
    load_blocks,
    plan_pieces,
    save_blocks,
    stack_layers,
    view_positions,
)

LAYERS, HEADS, HEAD_DIM, BLOCKS = 2, 4, 8, 8


def cuda_views(order: tuple[int, ...], block_size: int) -> list[torch.Tensor]:
    """Per-layer `[blocks, heads, tokens, 2 * head_dim]` views of one CUDA allocation whose
    memory order is `order` over logical `[L, B, H, N, C]` (vLLM's KVCacheLayout values)."""
    logical = (LAYERS, BLOCKS, HEADS, block_size, 2 * HEAD_DIM)
    raw = torch.zeros([logical[i] for i in order], dtype=torch.float16, device="cuda")
    view = raw.permute([order.index(i) for i in range(5)])
    return [view[layer] for layer in range(LAYERS)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4), (1, 0, 3, 2, 4)],
                         ids=["LBHNC", "LBNHC", "BLNHC"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_pinned_pool_round_trips_through_gpu_views(tmp_path: Path, order, block_size):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=16)
    assert pool.pin() and pool.pinned
    views = cuda_views(order, block_size)
    g = torch.Generator(device="cuda").manual_seed(1)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g, device="cuda").half())
    target = stack_layers(views)
    assert target is not None and target.kv.is_cuda
    heads = RankHeads.for_rank(HEADS, 1, 0)
    chain = tuple(range(3 * block_size // 16))
    for table, slots in (((1, 2, 3), tuple(range(4, 4 + len(chain)))),  # one run
                         ((6, 0, 4), tuple(reversed(range(len(chain)))))):  # scattered
        positions = view_positions(table, chain, vllm_block_size=block_size,
                                   view_block_tokens=block_size)
        pieces = plan_pieces(positions, slots, view_block_tokens=block_size)
        want = [v[list(table)].cpu() for v in views]
        save_blocks(pool, target, heads, pieces)
        assert torch.equal(pool.k[0, :, slots[0]], want[0][0, :, :16, :HEAD_DIM])
        for v in views:
            v.zero_()
        load_blocks(pool, target, heads, pieces)
        torch.cuda.current_stream().synchronize()
        for v, w in zip(views, want, strict=True):
            assert torch.equal(v[list(table)].cpu(), w)
