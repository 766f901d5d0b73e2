"""The worker side: host pool <-> vLLM paged KV copies, bitwise, in every KV cache layout vLLM
0.33's attention backends use (views made by vLLM's own `create_kv_cache_views`), and blocks
stored by a TP1 worker loaded by TP2 and TP4 workers (and TP8 over 4 heads: replicas)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not importable here: tests/vllm run in vLLM's own "
                    "environment (make test-vllm)")

import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfleet_runtime.cache import KVLayout
from kvfleet_vllm import _copy
from kvfleet_vllm._copy import (
    HostPool,
    RankHeads,
    load_blocks,
    save_blocks,
    view_positions,
)
from tests.vllm import _support as sup

HEADS, HEAD_DIM, LAYERS = 4, 8, 2


def filled(views: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype))


@pytest.mark.parametrize("runs", [False, True], ids=["scattered", "runs"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_round_trip_is_bitwise_in_every_layout(tmp_path: Path, layout, block_size, runs):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=16)
    views = sup.layer_views(8, HEADS, HEAD_DIM, block_size, layout)
    assert views[0].shape == (8, HEADS, block_size, 2 * HEAD_DIM)
    filled(views, 3)
    # a request's vLLM blocks and host slots: consecutive (copied as slices) or not (indexed)
    table = (2, 3, 4) if runs else (5, 2, 7)
    chain = tuple(range(3 * block_size // 16))
    slots = tuple(range(4, 4 + len(chain))) if runs else tuple(reversed(range(len(chain))))
    heads = RankHeads.for_rank(HEADS, 1, 0)
    positions = view_positions(table, chain, vllm_block_size=block_size,
                               view_block_tokens=block_size)
    want = [v[list(table)].clone() for v in views]
    groups = _copy._groups(positions, slots)
    assert all(_copy._use_runs(_copy.paired_runs(ss, bs), len(bs)) == (runs and block_size == 16)
               for bs, ss in groups.values())  # both copy paths are exercised
    for layer, v in enumerate(views):
        save_blocks(pool, layer, v, heads, positions, slots)
    # the pool holds the canonical layout: slot s = chain block j, tokens 16j..16j+16, all heads
    s = slots[1]
    vb, off = positions[1]
    assert torch.equal(pool.k[0, :, s], views[0][vb, :, off:off + 16, :HEAD_DIM])
    assert torch.equal(pool.v[1, :, s], views[1][vb, :, off:off + 16, HEAD_DIM:])
    for v in views:
        v.zero_()
    other = (5, 6, 7) if runs else (1, 6, 3)
    for layer, v in enumerate(views):
        load_blocks(pool, layer, v, heads,
                    view_positions(other, chain, vllm_block_size=block_size,
                                   view_block_tokens=block_size), slots)
    for v, w in zip(views, want, strict=True):
        assert torch.equal(v[list(other)], w)
        untouched = [b for b in range(8) if b not in other]
        assert not v[untouched].any()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_blocks_stored_at_tp1_load_into_every_tp_rank(tmp_path: Path, tp):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=8)
    full = sup.layer_views(4, HEADS, HEAD_DIM, 16, KVCacheLayout.LBNHC)
    filled(full, 5)
    chain, slots = (0, 1, 2), (4, 0, 2)
    positions = view_positions((3, 0, 1), chain, vllm_block_size=16, view_block_tokens=16)
    for layer, v in enumerate(full):
        save_blocks(pool, layer, v, RankHeads.for_rank(HEADS, 1, 0), positions, slots)
    for rank in range(tp):
        heads = RankHeads.for_rank(HEADS, tp, rank)
        # vLLM shards KV heads contiguously; beyond 4 ranks each head has tp/4 replicas
        expected = (range(rank * HEADS // tp, (rank + 1) * HEADS // tp) if tp <= HEADS
                    else range(rank // (tp // HEADS), rank // (tp // HEADS) + 1))
        assert range(heads.start, heads.stop) == expected
        local = sup.layer_views(4, heads.num_heads, HEAD_DIM, 16, KVCacheLayout.LBHNC)
        dst = view_positions((2, 3, 0), chain, vllm_block_size=16, view_block_tokens=16)
        for layer, v in enumerate(local):
            load_blocks(pool, layer, v, heads, dst, slots)
            assert torch.equal(v[[2, 3, 0]], full[layer][[3, 0, 1]][:, heads.start:heads.stop])


def test_a_replica_rank_never_writes(tmp_path: Path):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=2)
    writer, replica = RankHeads.for_rank(HEADS, 8, 2), RankHeads.for_rank(HEADS, 8, 3)
    assert (writer.start, writer.writer, replica.start, replica.writer) == (1, True, 1, False)
    views = sup.layer_views(2, 1, HEAD_DIM, 16, KVCacheLayout.LBNHC)
    filled(views, 9)
    save_blocks(pool, 0, views[0], replica, [(0, 0)], [0])
    assert not pool.k.any()


def test_two_mappings_of_one_pool_share_memory(tmp_path: Path):
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM)
    a, b = HostPool(tmp_path / "pool", layout, 4), HostPool(tmp_path / "pool", layout, 4)
    a.k[1, 2, 3, 4, 5] = 7.0
    assert b.k[1, 2, 3, 4, 5].item() == 7.0


@pytest.mark.parametrize(("heads", "tp", "rank"), [(4, 3, 0), (4, 2, 2), (6, 4, 0)])
def test_impossible_tp_shapes_are_refused(heads, tp, rank):
    with pytest.raises(ValueError, match="tp_"):
        RankHeads.for_rank(heads, tp, rank)


def test_the_worker_connector_checks_vllms_views(tiny_checkpoint: Path, tmp_path: Path):
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool")
    w = sup.worker(vc)
    good = sup.layer_views(8, 4, 16, 16, KVCacheLayout.LBNHC)
    w.register_kv_caches(dict(zip(sup.LAYERS, good, strict=True)))
    bad = sup.layer_views(8, 2, 16, 16, KVCacheLayout.LBNHC)
    with pytest.raises(ValueError, match="KV view is"):
        w.register_kv_caches(dict(zip(sup.LAYERS, bad, strict=True)))
    with pytest.raises(ValueError, match="1 KV layers registered, the model has 2"):
        w.register_kv_caches({sup.LAYERS[0]: good[0]})
