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
from kvfleet_vllm._connector_index import SavePlan
from kvfleet_vllm._copy import (
    HostPool,
    LayerViews,
    Piece,
    RankHeads,
    load_blocks,
    plan_pieces,
    save_blocks,
    stack_layers,
    view_positions,
)
from kvfleet_vllm.connector import KvfleetConnectorMetadata, KvfleetWorkerMetadata
from tests.vllm import _support as sup

HEADS, HEAD_DIM, LAYERS = 4, 8, 2


def filled(views: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype))


def per_layer(views: list[torch.Tensor]) -> list[LayerViews]:
    return [LayerViews.of(i, v) for i, v in enumerate(views)]


def stacked(views: list[torch.Tensor]) -> list[LayerViews]:
    one = stack_layers(views)
    assert one is not None  # vLLM's views of one allocation stack in every layout
    return [one]


def save(pool: HostPool, targets: list[LayerViews], heads: RankHeads, table, chain, slots,
         block_size: int) -> int:
    return sum(save_blocks(pool, t, heads, pieces_of(t, table, chain, slots, block_size))
               for t in targets)


def load(pool: HostPool, targets: list[LayerViews], heads: RankHeads, table, chain, slots,
         block_size: int) -> int:
    return sum(load_blocks(pool, t, heads, pieces_of(t, table, chain, slots, block_size))
               for t in targets)


def pieces_of(t: LayerViews, table, chain, slots, block_size: int) -> list[Piece]:
    positions = view_positions(table, chain, vllm_block_size=block_size,
                               view_block_tokens=t.block_tokens)
    return plan_pieces(positions, slots, view_block_tokens=t.block_tokens)


# (vLLM block table, host slots) of a 3-vLLM-block request saved, then (table) it loads into;
# `copies` = copies per layer group at block size 16 / 32 (chain of 3 / 6 kvfleet blocks)
PATTERNS = {
    # consecutive blocks and slots: one piece
    "runs": ((2, 3, 4), "4..", (5, 6, 7), (1, 1)),
    # nothing consecutive: one piece per kvfleet block
    "scattered": ((5, 2, 7), "rev", (1, 6, 3), (3, 6)),
    # two vLLM blocks in a row, then a jump; slots in a run
    "mixed": ((0, 1, 6), "4..", (3, 4, 0), (2, 2)),
}


def _slots(spec: str, n: int) -> tuple[int, ...]:
    return tuple(range(4, 4 + n)) if spec == "4.." else tuple(reversed(range(n)))


@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_round_trip_is_bitwise_in_every_layout(tmp_path: Path, layout, block_size, pattern,
                                               stack):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=16)
    views = sup.layer_views(8, HEADS, HEAD_DIM, block_size, layout)
    assert views[0].shape == (8, HEADS, block_size, 2 * HEAD_DIM)
    filled(views, 3)
    table, slot_spec, other, (copies16, copies32) = PATTERNS[pattern]
    chain = tuple(range(3 * block_size // 16))
    slots = _slots(slot_spec, len(chain))
    heads = RankHeads.for_rank(HEADS, 1, 0)
    targets = stacked(views) if stack else per_layer(views)
    want = [v[list(table)].clone() for v in views]
    copies = copies16 if block_size == 16 else copies32
    # the fast path is the one taken: one copy per piece, for all layers when stacked
    assert save(pool, targets, heads, table, chain, slots, block_size) == \
        copies * (1 if stack else LAYERS)
    # the pool holds the canonical layout: slot s = chain block j, tokens 16j..16j+16, all heads
    for j in (0, len(chain) - 1):
        s, (vb, off) = slots[j], view_positions(table, chain, vllm_block_size=block_size,
                                                view_block_tokens=block_size)[j]
        assert torch.equal(pool.k[0, :, s], views[0][vb, :, off:off + 16, :HEAD_DIM])
        assert torch.equal(pool.v[1, :, s], views[1][vb, :, off:off + 16, HEAD_DIM:])
    for v in views:
        v.zero_()
    assert load(pool, targets, heads, other, chain, slots, block_size) == \
        copies * (1 if stack else LAYERS)
    for v, w in zip(views, want, strict=True):
        assert torch.equal(v[list(other)], w)
        untouched = [b for b in range(8) if b not in other]
        assert not v[untouched].any()


@pytest.mark.parametrize(("positions", "slots", "tokens", "want"), [
    # a 3-block run of 16-token blocks: one piece
    ([(2, 0), (3, 0), (4, 0)], [7, 8, 9], 16, [Piece(7, 2, 0, 3, 1)]),
    # 32-token view blocks, whole blocks 1-2 from slot 4: one piece of 2 blocks x 2 units
    ([(1, 0), (1, 16), (2, 0), (2, 16)], [4, 5, 6, 7], 32, [Piece(4, 1, 0, 2, 2)]),
    # a run that starts and ends inside view blocks: partial head, whole middle, partial tail
    ([(1, 16), (2, 0), (2, 16), (3, 0)], [0, 1, 2, 3], 32,
     [Piece(0, 1, 1, 1, 1), Piece(1, 2, 0, 1, 2), Piece(3, 3, 0, 1, 1)]),
    # 64-token view blocks, a run inside one block
    ([(5, 16), (5, 32)], [9, 10], 64, [Piece(9, 5, 1, 1, 2)]),
    # slots break the run where blocks do not: two pieces
    ([(0, 0), (1, 0), (2, 0)], [3, 4, 9], 16, [Piece(3, 0, 0, 2, 1), Piece(9, 2, 0, 1, 1)]),
    # scattered: one piece per kvfleet block
    ([(6, 0), (2, 0)], [1, 0], 16, [Piece(1, 6, 0, 1, 1), Piece(0, 2, 0, 1, 1)]),
    ([], [], 16, []),
])
def test_pieces_are_the_fewest_strided_copies(positions, slots, tokens, want):
    assert plan_pieces(positions, slots, view_block_tokens=tokens) == want


def test_kernel_blocks_smaller_than_vllms_block_copy_as_one_run():
    """A backend that splits 32-token manager blocks into 16-token kernel blocks: a request's
    consecutive manager blocks are consecutive kernel blocks, one piece."""
    positions = view_positions((2, 3), range(4), vllm_block_size=32, view_block_tokens=16)
    assert positions == [(4, 0), (5, 0), (6, 0), (7, 0)]
    assert plan_pieces(positions, [8, 9, 10, 11], view_block_tokens=16) == [Piece(8, 4, 0, 4, 1)]


def test_views_of_separate_tensors_do_not_stack():
    views = [torch.zeros(4, HEADS, 16, 2 * HEAD_DIM, dtype=torch.float16) for _ in range(2)]
    assert stack_layers(views) is None
    one = sup.layer_views(4, HEADS, HEAD_DIM, 16, KVCacheLayout.BLNHC)
    got = stack_layers(one)
    assert got is not None and got.num_layers == 2
    assert all(torch.equal(got.kv[i], one[i]) and got.kv[i].stride() == one[i].stride()
               for i in range(2))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_blocks_stored_at_tp1_load_into_every_tp_rank(tmp_path: Path, tp):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=8)
    full = sup.layer_views(4, HEADS, HEAD_DIM, 16, KVCacheLayout.LBNHC)
    filled(full, 5)
    chain, slots = (0, 1, 2), (4, 0, 2)
    save(pool, stacked(full), RankHeads.for_rank(HEADS, 1, 0), (3, 0, 1), chain, slots, 16)
    for rank in range(tp):
        heads = RankHeads.for_rank(HEADS, tp, rank)
        # vLLM shards KV heads contiguously; beyond 4 ranks each head has tp/4 replicas
        expected = (range(rank * HEADS // tp, (rank + 1) * HEADS // tp) if tp <= HEADS
                    else range(rank // (tp // HEADS), rank // (tp // HEADS) + 1))
        assert range(heads.start, heads.stop) == expected
        for layout in (KVCacheLayout.LBHNC, KVCacheLayout.BHLNC):
            local = sup.layer_views(4, heads.num_heads, HEAD_DIM, 16, layout)
            load(pool, stacked(local), heads, (2, 3, 0), chain, slots, 16)
            for layer, v in enumerate(local):
                assert torch.equal(v[[2, 3, 0]], full[layer][[3, 0, 1]][:, heads.start:heads.stop])


def test_tp2_ranks_store_what_a_tp1_rank_loads(tmp_path: Path):
    """Two ranks write their halves of the heads of one canonical pool; TP1 reads them whole."""
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=8)
    full = sup.layer_views(4, HEADS, HEAD_DIM, 32, KVCacheLayout.LBHNC)
    filled(full, 6)
    chain, slots = (0, 1, 2, 3), (2, 3, 4, 5)
    for rank in (0, 1):
        heads = RankHeads.for_rank(HEADS, 2, rank)
        local = sup.layer_views(4, heads.num_heads, HEAD_DIM, 32, KVCacheLayout.BLHNC)
        for v, f in zip(local, full, strict=True):
            v.copy_(f[:, heads.start:heads.stop])
        save(pool, stacked(local), heads, (1, 3), chain, slots, 32)
    back = sup.layer_views(4, HEADS, HEAD_DIM, 32, KVCacheLayout.LBNHC)
    assert load(pool, stacked(back), RankHeads.for_rank(HEADS, 1, 0), (0, 2), chain, slots,
                32) == 2  # slots 2-3 into block 0, 4-5 into block 2
    for v, f in zip(back, full, strict=True):
        assert torch.equal(v[[0, 2]], f[[1, 3]])


def test_a_replica_rank_never_writes(tmp_path: Path):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=2)
    writer, replica = RankHeads.for_rank(HEADS, 8, 2), RankHeads.for_rank(HEADS, 8, 3)
    assert (writer.start, writer.writer, replica.start, replica.writer) == (1, True, 1, False)
    views = sup.layer_views(2, 1, HEAD_DIM, 16, KVCacheLayout.LBNHC)
    filled(views, 9)
    assert save_blocks(pool, LayerViews.of(0, views[0]), replica, [Piece(0, 0, 0, 1, 1)]) == 0
    assert not pool.kv.any()


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


def test_the_worker_saves_every_layer_at_wait_for_save(tiny_checkpoint: Path, tmp_path: Path):
    """save_kv_layer only notes the layer; wait_for_save copies: all layers in one copy per
    piece when vLLM's views are the registered ones, and only the reported layers otherwise."""
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool")
    w = sup.worker(vc)
    views = sup.layer_views(8, 4, 16, 16, KVCacheLayout.LBHNC)
    filled(views, 4)
    w.register_kv_caches(dict(zip(sup.LAYERS, views, strict=True)))
    assert len(w.worker._targets) == 1 and w.worker._targets[0].num_layers == 2  # stacked
    assert w.worker.pool is not None
    plan = SavePlan(store_id=1, req_id="r", chain_blocks=(0, 1), slots=(3, 4))
    w.bind_connector_metadata(KvfleetConnectorMetadata(step_id=0, saves=[(plan, (5, 6))]))
    w.start_load_kv(None)  # type: ignore[arg-type]  # nothing to load; vLLM calls it every step
    for name, view in zip(sup.LAYERS, views, strict=True):
        w.save_kv_layer(name, view, None)
    assert not w.worker.pool.kv.any()  # nothing copied before the forward's end
    w.wait_for_save()
    for layer, v in enumerate(views):
        assert torch.equal(w.worker.pool.k[layer, :, 3:5], v[[5, 6], :, :, :16].transpose(0, 1))
        assert torch.equal(w.worker.pool.v[layer, :, 3:5], v[[5, 6], :, :, 16:].transpose(0, 1))
    w.clear_connector_metadata()
    w.worker.pool.kv.zero_()
    w.bind_connector_metadata(KvfleetConnectorMetadata(step_id=1, saves=[(plan, (5, 6))]))
    w.start_load_kv(None)  # type: ignore[arg-type]
    w.save_kv_layer(sup.LAYERS[1], views[1], None)  # only layer 1 reported this step
    w.wait_for_save()
    assert not w.worker.pool.kv[0].any() and w.worker.pool.kv[1].any()  # [layer, slot, ...]
    assert w.build_connector_worker_meta() == KvfleetWorkerMetadata(1, set())


def test_scattered_copies_restore_the_thread_count(tmp_path: Path):
    pool = HostPool(tmp_path / "pool", KVLayout(LAYERS, HEADS, HEAD_DIM), num_slots=8)
    (views,) = stacked(sup.layer_views(8, HEADS, HEAD_DIM, 16, KVCacheLayout.LBNHC))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pieces = [Piece(s, b, 0, 1, 1) for s, b in ((0, 5), (2, 1), (7, 3))]
        assert load_blocks(pool, views, RankHeads.for_rank(HEADS, 1, 0), pieces) == 3
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):  # a failed copy restores it too
            load_blocks(pool, views, RankHeads.for_rank(HEADS, 1, 0),
                        [Piece(0, 5, 0, 1, 1), Piece(7, 3, 0, 1, 2)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
