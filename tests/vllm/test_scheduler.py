"""The connector's scheduler side driven by vLLM's real `Scheduler` (with the worker side on
CPU views, and the model runner's output built by the test)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not importable here: tests/vllm run in vLLM's own "
                    "environment (make test-vllm)")

import torch
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

from kvfleet_runtime.cache import block_hashes
from kvfleet_runtime.model.architectures import parse_hf_config
from kvfleet_runtime.model.checkpoint import read_config, weights_digest
from tests.vllm import _support as sup

PROMPT = [(i * 7 + 3) % 500 for i in range(100)]  # 6 full blocks and a 4-token tail


@pytest.fixture
def engine(tiny_checkpoint: Path, tmp_path: Path):
    """A scheduler with the connector, one TP1 worker and its CPU KV views (random contents)."""
    def make(**extra):
        vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", **extra)
        s = sup.scheduler(vc, num_blocks=64)
        w = sup.worker(vc)
        views = sup.layer_views(64, 4, 16, 16, KVCacheLayout.LBNHC)
        torch.manual_seed(1)
        for v in views:
            v.copy_(torch.randn(v.shape, dtype=torch.float16))
        w.register_kv_caches(dict(zip(sup.LAYERS, views, strict=True)))
        return s, w, views
    return make


def run_to_end(s, w, views, max_steps=20):
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        outs.append(sup.step(s, [w], [views])[0])
    assert not s.has_unfinished_requests()
    return outs


def kv_of(views, table, num_blocks):
    return [v[list(table[:num_blocks])].clone() for v in views]


def test_store_then_load_the_right_blocks_and_count_hits_once(engine):
    s, w, views = engine()
    conn = sup.connector_of(s)
    a = sup.request("a", PROMPT)
    s.add_request(a)
    outs = run_to_end(s, w, views)
    # chunked prefill (64-token budget): the save goes out with the step that completes it
    saves = [(plan, table) for o in outs for plan, table in o.kv_connector_metadata.saves]
    assert len(saves) == 1
    plan, table_a = saves[0]
    assert plan.chain_blocks == (0, 1, 2, 3, 4, 5)
    assert [o.kv_connector_metadata.saves != [] for o in outs[:2]] == [False, True]
    saved = kv_of(views, table_a, 6)
    key = conn.scheduler.model_key.key("tenant-a")
    blocks = conn.scheduler.index.manager._index.match(block_hashes(key, PROMPT))
    indexed = [n.block_hash for n in blocks]
    assert indexed == block_hashes(key, PROMPT)  # the chain a kvfleet replica files them under
    assert conn.scheduler.index.num_referenced_blocks == 0

    # vLLM forgets its own prefix cache; the host pool still has the prompt
    assert s.kv_cache_manager.reset_prefix_cache()
    b = sup.request("b", PROMPT[:96] + [11] * 20)
    s.add_request(b)
    out, _ = sup.step(s, [w], [views])
    (load, table_b), = out.kv_connector_metadata.loads
    assert load.chain_blocks == (0, 1, 2, 3, 4, 5) and not load.failed
    assert b.num_computed_tokens >= 96
    for got, want in zip(kv_of(views, table_b, 6), saved, strict=True):
        assert torch.equal(got, want)  # bitwise
    run_to_end(s, w, views)
    st = conn.scheduler.stats("tenant-a").totals
    assert (st.num_lookups, st.num_hits, st.num_matched_tokens) == (2, 1, 96)

    # vLLM's own prefix cache now holds b's 7 blocks: the connector adds nothing, counts nothing
    c = sup.request("c", PROMPT[:96] + [11] * 20)
    s.add_request(c)
    out, _ = sup.step(s, [w], [views])
    assert out.kv_connector_metadata.loads == []
    run_to_end(s, w, views)
    st = conn.scheduler.stats("tenant-a").totals
    assert (st.num_lookups, st.num_hits, st.num_matched_tokens) == (3, 1, 96)
    assert conn.scheduler.index.num_referenced_blocks == 0


def test_tenants_never_share_blocks(engine):
    s, w, views = engine()
    s.add_request(sup.request("a", PROMPT, salt="tenant-a"))
    run_to_end(s, w, views)
    s.kv_cache_manager.reset_prefix_cache()
    s.add_request(sup.request("b", PROMPT, salt="tenant-b"))
    out, _ = sup.step(s, [w], [views])
    assert out.kv_connector_metadata.loads == []
    run_to_end(s, w, views)
    assert sup.connector_of(s).scheduler.stats("tenant-b").totals.num_matched_tokens == 0


def test_admission_decides_what_is_stored(engine):
    s, w, views = engine(admit_min_sightings=2)
    conn = sup.connector_of(s)
    s.add_request(sup.request("a", PROMPT))
    outs = run_to_end(s, w, views)
    assert all(o.kv_connector_metadata.saves == [] for o in outs)  # first sighting: refused
    assert conn.scheduler.stats().totals.num_blocks == 0
    s.kv_cache_manager.reset_prefix_cache()
    s.add_request(sup.request("b", PROMPT))
    outs = run_to_end(s, w, views)
    assert [len(p.chain_blocks) for o in outs for p, _ in o.kv_connector_metadata.saves] == [6]
    assert conn.scheduler.stats().totals.num_blocks == 6


def test_abort_and_preemption_release_everything(engine):
    s, w, views = engine()
    conn = sup.connector_of(s)
    s.add_request(sup.request("a", PROMPT))
    run_to_end(s, w, views)
    s.kv_cache_manager.reset_prefix_cache()

    # preempted right after its load: re-admitted, it loads again and is not counted again
    b = sup.request("b", PROMPT[:96] + [11] * 20, max_tokens=4)
    s.add_request(b)
    out, _ = sup.step(s, [w], [views])
    assert len(out.kv_connector_metadata.loads) == 1
    s.running.remove(b)
    s._preempt_request(b, 0.0)
    s.kv_cache_manager.reset_prefix_cache()
    assert conn.scheduler.index.num_referenced_blocks == 0
    out, _ = sup.step(s, [w], [views])
    # b's own first step completed its prefill and stored its 7th block (tokens 96-112)
    assert [p.chain_blocks for p, _ in out.kv_connector_metadata.loads] == [tuple(range(7))]
    totals = conn.scheduler.stats().totals
    assert totals.num_lookups == 2 and totals.num_hits == 1

    # aborted with its load's step still in flight: the step's end releases the blocks
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    s.kv_cache_manager.reset_prefix_cache()
    c = sup.request("c", PROMPT[:96] + [12] * 20)
    s.add_request(c)
    out = s.schedule()
    assert len(out.kv_connector_metadata.loads) == 1
    assert conn.scheduler.index.num_referenced_blocks > 0
    s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    s.update_from_output(out, sup.runner_output([], w.build_connector_worker_meta()))
    assert conn.scheduler.index.num_referenced_blocks == 0
    assert not s.has_unfinished_requests()
    assert conn.scheduler._requests == {} and conn.scheduler._stored == set()


def test_a_failed_load_is_reported_and_recomputed(engine, monkeypatch):
    s, w, views = engine()
    s.add_request(sup.request("a", PROMPT))
    run_to_end(s, w, views)
    s.kv_cache_manager.reset_prefix_cache()

    def broken(*args, **kwargs):  # the one fault real parts cannot produce on demand
        raise RuntimeError("injected: host pool unreadable")

    monkeypatch.setattr("kvfleet_vllm._worker.load_blocks", broken)
    b = sup.request("b", PROMPT[:96] + [11] * 20)
    s.add_request(b)
    out = s.schedule()
    (_load, table), = out.kv_connector_metadata.loads
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    errors = w.get_block_ids_with_load_errors()
    assert errors == set(table[:6])
    s.update_from_output(out, sup.runner_output([b], w.build_connector_worker_meta(), errors))
    assert b.num_computed_tokens < 96  # vLLM recomputes the blocks that did not load


def test_the_key_is_kvfleets_key_of_the_checkpoint(engine, tiny_checkpoint):
    s, _, _ = engine()
    mk = sup.connector_of(s).scheduler.model_key
    args = parse_hf_config(read_config(tiny_checkpoint), dtype="float16")
    assert mk.model_id == "tiny" and mk.kv_dtype == "float16"
    assert mk.weights_digest == weights_digest(tiny_checkpoint)
    assert mk.rope_config_hash == args.rope_config_hash()
    suffix = args.attn_impl_id()[len(args.attn_impl):]
    assert mk.attn_impl_id == "vllm-auto" + suffix


def test_32_token_blocks_and_a_tp2_engine_store_what_tp1_loads(tiny_checkpoint, tmp_path):
    """vLLM blocks of 2 kvfleet blocks; two TP ranks write one canonical pool together (heads
    0-1 and 2-3), and a TP1 engine sharing that pool (a restart at another TP degree) loads it."""
    vc2 = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", block_size=32, tp=2)
    s2 = sup.scheduler(vc2, num_blocks=32)
    ranks = [sup.worker(vc2, r) for r in (0, 1)]
    rank_views = [sup.layer_views(32, 2, 16, 32, KVCacheLayout.LBHNC) for _ in ranks]
    torch.manual_seed(2)
    for w, views in zip(ranks, rank_views, strict=True):
        for v in views:
            v.copy_(torch.randn(v.shape, dtype=torch.float16))
        w.register_kv_caches(dict(zip(sup.LAYERS, views, strict=True)))
    s2.add_request(sup.request("a", PROMPT, block_size=32))
    saves = []
    for _ in range(10):
        if not s2.has_unfinished_requests():
            break
        out, _ = sup.step(s2, ranks, rank_views)
        saves += out.kv_connector_metadata.saves
    (plan, table_a), = saves
    assert plan.chain_blocks == tuple(range(6))  # 3 vLLM blocks of 32 tokens
    full = [torch.cat([rv[layer][list(table_a[:3])] for rv in rank_views], dim=1)
            for layer in range(2)]  # [3 blocks, 4 heads, 32, 32]: rank 0 heads 0-1, rank 1 2-3

    # A TP1 engine on the same pool, with the TP2 engine's index (one pool, one index).
    vc1 = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", block_size=32)
    s1 = sup.scheduler(vc1, num_blocks=32)
    sup.connector_of(s1).scheduler.index = sup.connector_of(s2).scheduler.index
    w1 = sup.worker(vc1)
    views1 = sup.layer_views(32, 4, 16, 32, KVCacheLayout.LBNHC)
    w1.register_kv_caches(dict(zip(sup.LAYERS, views1, strict=True)))
    s1.add_request(sup.request("b", PROMPT[:96] + [5] * 30, block_size=32))
    out, _ = sup.step(s1, [w1], [views1])
    (load, table_b), = out.kv_connector_metadata.loads
    assert load.chain_blocks == tuple(range(6))
    for layer in range(2):
        assert torch.equal(views1[layer][list(table_b[:3])], full[layer])


def test_connector_stats_reach_vllms_frontend_as_kvfleet_counters(engine):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvfleet_vllm.connector import KvfleetConnector, KvfleetConnectorStats

    s, w, views = engine()
    sup.REPORTED.clear()
    s.add_request(sup.request("a", PROMPT))
    run_to_end(s, w, views)
    s.kv_cache_manager.reset_prefix_cache()
    s.add_request(sup.request("b", PROMPT[:96] + [11] * 20))
    run_to_end(s, w, views)
    total = KvfleetConnectorStats(data={"tenants": {}})
    for payload in sup.REPORTED:  # what the scheduler shipped, step by step
        total.aggregate(KvfleetConnector.build_kv_connector_stats(payload))
    assert total.data == {"tenants": {"tenant-a": {
        "lookup_tokens": 100 + 116, "matched_tokens": 96, "stored_blocks": 6 + 1}}}

    registry = CollectorRegistry()

    class LocalCounter(Counter):  # vLLM passes its metric classes; these register privately
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    prom = KvfleetConnector.build_prom_metrics(
        s.vllm_config, {Counter: LocalCounter, Gauge: Gauge, Histogram: Histogram},
        ["model_name", "engine"], {0: ["tiny", 0]})
    for payload in sup.REPORTED:
        prom.observe(payload, 0)
    labels = {"model_name": "tiny", "engine": "0", "tenant": "tenant-a"}
    assert registry.get_sample_value("kvfleet_cache_matched_tokens_total", labels) == 96
    assert registry.get_sample_value("kvfleet_cache_lookup_tokens_total", labels) == 216


def test_each_role_has_only_its_side(tiny_checkpoint, tmp_path):
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool")
    conn = sup.connector_of(sup.scheduler(vc))
    with pytest.raises(RuntimeError, match=r"worker-side method .* in the scheduler role"):
        conn.get_block_ids_with_load_errors()
    w = sup.worker(vc)
    with pytest.raises(RuntimeError, match=r"scheduler-side method .* in the worker role"):
        w.request_finished(sup.request("x", PROMPT), [])
    assert w.get_kv_connector_stats() is None  # vLLM asks every role; the worker has none
