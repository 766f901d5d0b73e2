"""The connector's tenant comes only from a `cache_salt` the router signed: with the salt secret
configured (`kvfleet.salt_secret_file`, the router secret the chart mounts), a verified salt maps
to its tenant, anything else bypasses the connector (no load, no store) and is counted by reason,
and two tenants never hit each other's host-pool blocks. Driven by vLLM's real `Scheduler`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not importable here: tests/vllm run in vLLM's own "
                    "environment (make test-vllm)")

import torch
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfleet_runtime.auth import MAX_SALTED_TENANT_CHARS, cache_salt
from kvfleet_runtime.cache import block_hashes
from tests.vllm import _support as sup

PROMPT = [(i * 5 + 1) % 500 for i in range(100)]  # 6 full blocks and a 4-token tail
SECRET = b"router-secret-for-the-connector"


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "router-secret" / "secret"
    path.parent.mkdir()
    path.write_bytes(SECRET + b"\n")  # a Secret's file may end with a newline
    return path


@pytest.fixture
def engine(tiny_checkpoint: Path, tmp_path: Path, secret_file: Path):
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", salt_secret_file=str(secret_file))
    s = sup.scheduler(vc, num_blocks=64)
    w = sup.worker(vc)
    views = sup.layer_views(64, 4, 16, 16, KVCacheLayout.LBNHC)
    torch.manual_seed(2)
    for v in views:
        v.copy_(torch.randn(v.shape, dtype=torch.float16))
    w.register_kv_caches(dict(zip(sup.LAYERS, views, strict=True)))
    return s, w, views


def run(s, w, views, req):
    s.add_request(req)
    outs = []
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        outs.append(sup.step(s, [w], [views])[0])
    assert not s.has_unfinished_requests()
    loads = [load for o in outs for load in o.kv_connector_metadata.loads]
    saves = [save for o in outs for save in o.kv_connector_metadata.saves]
    return loads, saves


def test_a_verified_salt_maps_to_its_tenant(engine):
    s, w, views = engine
    conn = sup.connector_of(s)
    loads, saves = run(s, w, views, sup.request("a", PROMPT, salt=cache_salt(SECRET, "acme")))
    assert loads == [] and len(saves) == 1
    key = conn.scheduler.model_key.key("acme")  # the tenant, not the salt, is the key's tenant
    blocks = conn.scheduler.index.manager._index.match(block_hashes(key, PROMPT))
    indexed = [n.block_hash for n in blocks]
    assert indexed == block_hashes(key, PROMPT)
    s.kv_cache_manager.reset_prefix_cache()
    loads, _ = run(s, w, views, sup.request("b", PROMPT, salt=cache_salt(SECRET, "acme")))
    assert [load.chain_blocks for load, _table in loads] == [(0, 1, 2, 3, 4, 5)]
    assert conn.scheduler.stats("acme").totals.num_matched_tokens == 96
    assert dict(conn.scheduler.salts.num_refused) == {}


@pytest.mark.parametrize(("salt", "reason"), [
    ("acme", "malformed"),  # a bare tenant name, as a client would send it
    ("acme." + "0" * 32, "forged"),
    (None, "missing"),  # not through the router: never the default tenant
])
def test_an_unverified_salt_bypasses_the_connector(engine, salt, reason):
    s, w, views = engine
    conn = sup.connector_of(s)
    run(s, w, views, sup.request("a", PROMPT, salt=cache_salt(SECRET, "acme")))
    s.kv_cache_manager.reset_prefix_cache()
    # chunked prefill: the request is looked at over several steps, counted once
    loads, saves = run(s, w, views, sup.request("x", PROMPT, salt=salt))
    assert (loads, saves) == ([], [])
    assert dict(conn.scheduler.salts.num_refused) == {reason: 1}
    assert conn.scheduler.stats("acme").totals.num_lookups == 1  # only acme's own request
    assert conn.scheduler.index.num_referenced_blocks == 0


def test_refusals_reach_vllms_metrics_by_reason(engine):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvfleet_vllm.connector import KvfleetConnector

    s, w, views = engine
    sup.REPORTED.clear()
    run(s, w, views, sup.request("x", PROMPT, salt="acme"))
    run(s, w, views, sup.request("y", PROMPT, salt="acme." + "0" * 32))
    run(s, w, views, sup.request("z", PROMPT, salt="acme." + "1" * 32))
    shipped = [p["salt_refused"] for p in sup.REPORTED if "salt_refused" in p]
    assert shipped == [{"malformed": 1}, {"forged": 1}, {"forged": 1}]  # each request once
    registry = CollectorRegistry()

    class LocalCounter(Counter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    prom = KvfleetConnector.build_prom_metrics(
        s.vllm_config, {Counter: LocalCounter, Gauge: Gauge, Histogram: Histogram},
        ["model_name", "engine"], {0: ["tiny", 0]})
    for payload in sup.REPORTED:
        prom.observe(payload, 0)
    name = "kvfleet_vllm_salt_refused_requests_total"
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value(name, {**labels, "reason": "forged"}) == 2
    assert registry.get_sample_value(name, {**labels, "reason": "malformed"}) == 1


def test_two_tenants_never_hit_each_others_host_pool_blocks(engine):
    s, w, views = engine
    conn = sup.connector_of(s)
    run(s, w, views, sup.request("a", PROMPT, salt=cache_salt(SECRET, "acme")))
    s.kv_cache_manager.reset_prefix_cache()
    loads, saves = run(s, w, views, sup.request("g", PROMPT, salt=cache_salt(SECRET, "globex")))
    assert loads == [] and len(saves) == 1  # globex computes and stores its own copy
    assert conn.scheduler.stats("globex").totals.num_matched_tokens == 0
    # globex naming acme with globex's MAC is a forgery, not acme
    forged = "acme." + cache_salt(SECRET, "globex").rpartition(".")[2]
    s.kv_cache_manager.reset_prefix_cache()
    loads, saves = run(s, w, views, sup.request("f", PROMPT, salt=forged))
    assert (loads, saves) == ([], [])
    assert dict(conn.scheduler.salts.num_refused) == {"forged": 1}
    assert conn.scheduler.stats("acme").totals.num_matched_tokens == 0


def test_vllm_accepts_every_salt_the_router_mints():
    for tenant in ("acme", "team.a-b_c", "t" * MAX_SALTED_TENANT_CHARS):
        validate_cache_salt(cache_salt(SECRET, tenant))  # raises on what vLLM refuses


@pytest.mark.parametrize("content", [None, b"\n"])
def test_an_unreadable_or_empty_secret_refuses_to_start(tiny_checkpoint, tmp_path, content):
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", salt_secret_file=str(path))
    with pytest.raises(ValueError, match=r"kvfleet\.salt_secret_file="):
        sup.scheduler(vc)
