"""T2 from the vLLM connector, driven by vLLM's real `Scheduler`: fetching from a kvfleet peer
(a real `PrefixCache` behind kvfleet's own peer routes on a loopback aiohttp server), serving a
kvfleet fetcher (`PeerFetcher`, as a kvfleet replica fetches), and every failure -> recompute.
The hint index is the embedded one of the connector's T2 thread; the peer's blocks are published
into it as the peer's `HintPublisher` would."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not importable here: tests/vllm run in vLLM's own "
                    "environment (make test-vllm)")

import torch
from aiohttp import web
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfleet_runtime.cache import CacheKey, CacheTuning, KVLayout, PrefixCache, block_hashes
from kvfleet_runtime.fleet import (
    CacheBlockSource,
    EmbeddedHintIndex,
    PeerFetcher,
    peer_routes,
)
from tests.vllm import _support as sup

SECRET = "t2-test-secret"
PROMPT = [(i * 11 + 5) % 500 for i in range(100)]  # 6 full blocks and a 4-token tail
LAYOUT = KVLayout(2, 4, 16, "float16")  # the tiny checkpoint: 2 layers, 4 KV heads of 16


class KvfleetPeer:
    """A kvfleet replica's T2 side: a `PrefixCache` (T1 only) behind `peer_routes` on loopback,
    in a thread with its own event loop."""

    def __init__(self, secret: str = SECRET, *, layout: KVLayout = LAYOUT,
                 chunk_bytes: int = 16 << 20, cut_at: int | None = None) -> None:
        self.cache = PrefixCache(CacheTuning(num_t0_blocks=0, num_t1_blocks=64), layout,
                                 clock=time.monotonic)
        self.layout = layout
        self._chunk_bytes = chunk_bytes
        self._cut_at = cut_at
        """The proxy cuts the answer after this many bytes instead of flipping one."""
        self.served = 0
        self.held: Any = None
        """`held(hashes, tenant)` for the held probe (peers whose hint index is the probe)."""
        self._secret = secret.encode()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        def on_served(num_bytes: int) -> None:
            self.served += 1

        def held(hashes: Any, tenant: str) -> int:
            return self.held(hashes, tenant) if self.held is not None else 0

        app = web.Application()
        app.add_routes(peer_routes(CacheBlockSource(self.cache), self._secret,
                                   on_served=on_served, held=held, chunk_bytes=self._chunk_bytes))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._proxy = await asyncio.start_server(self._flip_one_byte, "127.0.0.1", 0)
        self.proxy_port = self._proxy.sockets[0].getsockname()[1]

    async def _flip_one_byte(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        """A proxy in front of the peer that flips one byte of its answer (past the HTTP and
        protocol headers, inside the first K chunk): corruption in transit; or, with `cut_at`,
        closes the connection after that many bytes (a peer gone mid-run)."""
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)

        async def upstream() -> None:
            while data := await reader.read(1 << 16):
                up_w.write(data)
                await up_w.drain()

        task = asyncio.ensure_future(upstream())
        seen = 0
        try:
            while data := await up_r.read(1 << 16):
                if self._cut_at is not None and seen + len(data) > self._cut_at:
                    writer.write(data[:self._cut_at - seen])
                    await writer.drain()
                    return
                if self._cut_at is None and seen <= 2500 < seen + len(data):
                    data = bytearray(data)
                    data[2500 - seen] ^= 0xFF
                seen += len(data)
                writer.write(bytes(data))
                await writer.drain()
        finally:
            task.cancel()
            writer.close()
            up_w.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hold(self, key: CacheKey, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Random KV for the full blocks of `tokens`, held in the peer's cache."""
        n = len(tokens) // 16 * 16
        torch.manual_seed(7)
        shape = (self.layout.num_layers, self.layout.num_kv_heads, n, self.layout.head_dim)
        k = torch.randn(shape, dtype=torch.float16)
        v = torch.randn(shape, dtype=torch.float16)
        assert self.cache._import_blocks(key, tokens[:n], k, v) == n // 16
        return k, v

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._proxy.close)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet settings a kvfleet replica pod gets, for the connector's process."""
    monkeypatch.setenv("KVFLEET_FLEET_NAME", "vllm-a")
    monkeypatch.setenv("KVFLEET_PEER_SECRET", SECRET)
    monkeypatch.setenv("POD_IP", "127.0.0.1")
    # A lookup (Redis or the peer probe) is what these tests exercise, not its 2-50 ms budget: a
    # busy test box made a fresh index's first lookup miss it and the fetch end "no_peer".
    monkeypatch.setenv("KVFLEET_HINT_LOOKUP_BUDGET_S", "2.0")
    for name in ("KVFLEET_REDIS_URL", "KVFLEET_FLEET_CONFIG", "KVFLEET_PEER_URL",
                 "KVFLEET_PEER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def peer() -> Iterator[KvfleetPeer]:
    p = KvfleetPeer()
    yield p
    p.close()


@pytest.fixture
def engine(tiny_checkpoint: Path, tmp_path: Path, fleet_env: None) -> Iterator[Any]:
    """A scheduler whose connector runs T2 (on a free loopback port), one TP1 worker and its
    CPU KV views."""
    made: list[Any] = []

    def make(**extra: Any) -> tuple[Any, Any, list[torch.Tensor]]:
        vc = sup.vllm_config(tiny_checkpoint, tmp_path / f"pool{len(made)}", peer_port=0,
                             peer_host="127.0.0.1", **extra)
        s = sup.scheduler(vc, num_blocks=64)
        made.append(s)
        w = sup.worker(vc)
        views = sup.layer_views(64, 4, 16, 16, KVCacheLayout.LBNHC)
        for v in views:
            v.zero_()
        w.register_kv_caches(dict(zip(sup.LAYERS, views, strict=True)))
        return s, w, views

    yield make
    for s in made:
        sup.connector_of(s).shutdown()


def publish(conn: Any, host: str, url: str, hashes: list[bytes]) -> None:
    """What the peer's `HintPublisher` and registration write into the hint index."""
    svc = conn.scheduler.peers
    svc.call(svc.hints.publish(host, hashes))
    svc.call(svc.hints.register_host(host, url))


def schedule_through_fetch(s: Any, w: Any, views: Any) -> list[Any]:
    """Steps until the request is scheduled; the steps before it schedule nothing."""
    conn = sup.connector_of(s)
    outs = []
    for _ in range(50):
        out, _ = sup.step(s, [w], [views])
        outs.append(out)
        if out.num_scheduled_tokens:
            return outs
        assert conn.scheduler.peers.wait_idle(10)
    raise AssertionError("the request was never scheduled")


def loaded_kv(views: list[torch.Tensor], table: tuple[int, ...], num_blocks: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical [layers, heads, tokens, head_dim] K and V of the request's first blocks."""
    ks, vs = [], []
    for view in views:
        blocks = view[list(table[:num_blocks])]  # [blocks, heads, 16, 2 * head_dim]
        kv = blocks.permute(1, 0, 2, 3).reshape(4, num_blocks * 16, 32)
        ks.append(kv[..., :16])
        vs.append(kv[..., 16:])
    return torch.stack(ks), torch.stack(vs)


def test_fetches_from_a_kvfleet_peer_then_loads_and_counts_once(engine, peer):
    s, w, views = engine()
    conn = sup.connector_of(s)
    key = conn.scheduler.model_key.key("tenant-a")
    k, v = peer.hold(key, PROMPT)  # the peer holds all 6 full blocks
    chain = block_hashes(key, PROMPT)
    publish(conn, "kvfleet-b", peer.url, chain)

    a = sup.request("a", PROMPT)
    s.add_request(a)
    outs = schedule_through_fetch(s, w, views)
    # One step waiting for the fetch, then scheduled; a fetch that finishes within the first
    # call's wait for the hint lookup (6 tiny blocks, received in place) needs no waiting step.
    assert len(outs) <= 2 and all(o.num_scheduled_tokens == {} for o in outs[:-1])
    svc = conn.scheduler.peers
    assert svc.stats.outcomes == {"ok": 1} and svc.stats.blocks_fetched == 6
    assert peer.served == 1
    (load, table), = outs[-1].kv_connector_metadata.loads
    assert load.chain_blocks == (0, 1, 2, 3, 4, 5) and not load.failed
    assert a.num_computed_tokens == 100  # 96 loaded, the 4-token tail computed
    got_k, got_v = loaded_kv(views, table, 6)
    assert torch.equal(got_k, k[:, :, :96]) and torch.equal(got_v, v[:, :, :96])  # bitwise

    while s.has_unfinished_requests():
        sup.step(s, [w], [views])
    st = conn.scheduler.stats("tenant-a").totals
    assert (st.num_lookups, st.num_hits, st.num_matched_tokens) == (1, 1, 96)
    reported = {}
    for payload in sup.REPORTED:
        for name, n in payload.get("tenants", {}).get("tenant-a", {}).items():
            reported[name] = reported.get(name, 0) + n
    assert reported.get("fetched_blocks") == 6
    index = conn.scheduler.index
    assert index.num_referenced_blocks == 0 and index.num_pending_blocks == 0

    # Fetched once: a second request for the prompt hits the host pool without asking peers.
    s.kv_cache_manager.reset_prefix_cache()
    b = sup.request("b", PROMPT)
    s.add_request(b)
    _out, _ = sup.step(s, [w], [views])
    assert b.num_computed_tokens == 100 and peer.served == 1
    assert svc.stats.outcomes == {"ok": 1}


def test_a_peer_cut_mid_run_gives_only_its_verified_leading_blocks(engine):
    """Received in place: a run cut after a few one-block chunks makes only the verified
    leading blocks visible, and those load bitwise; the rest is computed."""
    # One block (8 KiB) per chunk; the answer cut after ~3.5 of them (past ~1 KiB of headers).
    peer = KvfleetPeer(chunk_bytes=LAYOUT.bytes_per_block, cut_at=30_000)
    try:
        s, w, views = engine()
        conn = sup.connector_of(s)
        key = conn.scheduler.model_key.key("tenant-a")
        k, v = peer.hold(key, PROMPT)
        publish(conn, "kvfleet-b", f"http://127.0.0.1:{peer.proxy_port}", block_hashes(key, PROMPT))
        s.add_request(sup.request("a", PROMPT))
        outs = schedule_through_fetch(s, w, views)
        svc = conn.scheduler.peers
        n = svc.stats.blocks_fetched
        assert 1 <= n < 6 and svc.stats.outcomes == {"partial_short_read": 1}
        (load, table), = outs[-1].kv_connector_metadata.loads
        assert load.chain_blocks == tuple(range(n)) and not load.failed
        got_k, got_v = loaded_kv(views, table, n)
        assert torch.equal(got_k, k[:, :, :n * 16]) and torch.equal(got_v, v[:, :, :n * 16])
        assert conn.scheduler.index.num_pending_blocks == 0
    finally:
        peer.close()


def test_a_peer_of_another_layout_is_refused_before_any_byte_lands(engine):
    """The header names the peer's layout (here head_dim 32 against the model's 16): refused
    before the first byte lands in the reserved host-pool slots, so the pool is untouched."""
    peer = KvfleetPeer(layout=KVLayout(2, 4, 32, "float16"))
    try:
        s, w, views = engine()
        conn = sup.connector_of(s)
        key = conn.scheduler.model_key.key("tenant-a")
        peer.hold(key, PROMPT)
        publish(conn, "kvfleet-b", peer.url, block_hashes(key, PROMPT))
        pool = sup.connector_of(s).scheduler.peers.pool
        before = pool.kv.clone()
        s.add_request(sup.request("a", PROMPT))
        outs = schedule_through_fetch(s, w, views)
        assert conn.scheduler.peers.stats.outcomes == {"layout_mismatch": 1}
        assert outs[-1].kv_connector_metadata.loads == []
        assert torch.equal(pool.kv, before)
        assert conn.scheduler.index.num_pending_blocks == 0
    finally:
        peer.close()


def test_the_fetch_starts_after_the_host_pools_own_match(engine, peer):
    s, w, views = engine()
    conn = sup.connector_of(s)
    key = conn.scheduler.model_key.key("tenant-a")
    # This replica stored the first 3 blocks itself; the peer holds all 6.
    s.add_request(sup.request("a0", [*PROMPT[:48], 1]))
    while s.has_unfinished_requests():
        sup.step(s, [w], [views])
    s.kv_cache_manager.reset_prefix_cache()
    assert conn.scheduler.stats().totals.num_blocks == 3
    k, v = peer.hold(key, PROMPT)
    publish(conn, "kvfleet-b", peer.url, block_hashes(key, PROMPT))

    a = sup.request("a", PROMPT)
    s.add_request(a)
    outs = schedule_through_fetch(s, w, views)
    assert conn.scheduler.peers.stats.blocks_fetched == 3  # blocks 3, 4, 5 only
    (load, table), = outs[-1].kv_connector_metadata.loads
    assert load.chain_blocks == (0, 1, 2, 3, 4, 5)
    got_k, got_v = loaded_kv(views, table, 6)
    assert torch.equal(got_k[:, :, 48:], k[:, :, 48:96])
    assert torch.equal(got_v[:, :, 48:], v[:, :, 48:96])


@pytest.mark.parametrize("failure", ["peer_down", "wrong_secret", "corrupt_chunk", "stale_hint"])
def test_every_fetch_failure_recomputes(engine, failure, monkeypatch):
    peer = KvfleetPeer(secret="another-fleet") if failure == "wrong_secret" else KvfleetPeer()
    try:
        s, w, views = engine()
        conn = sup.connector_of(s)
        key = conn.scheduler.model_key.key("tenant-a")
        if failure != "stale_hint":
            peer.hold(key, PROMPT)
        url = f"http://127.0.0.1:{peer.proxy_port}" if failure == "corrupt_chunk" else peer.url
        if failure == "peer_down":
            peer.close()
        publish(conn, "kvfleet-b", url, block_hashes(key, PROMPT))

        a = sup.request("a", PROMPT)
        s.add_request(a)
        outs = schedule_through_fetch(s, w, views)
        expected = {"peer_down": "peer_error", "wrong_secret": "refused",
                    "corrupt_chunk": "checksum", "stale_hint": "stale"}[failure]
        assert conn.scheduler.peers.stats.outcomes == {expected: 1}
        assert conn.scheduler.peers.stats.blocks_fetched == 0
        assert outs[-1].kv_connector_metadata.loads == []  # nothing loaded: vLLM computes all
        assert outs[-1].num_scheduled_tokens == {"a": 64}  # from token 0 (a 64-token budget)
        index = conn.scheduler.index
        assert index.num_pending_blocks == 0 and index.num_referenced_blocks == 0
        while s.has_unfinished_requests():
            sup.step(s, [w], [views])
        st = conn.scheduler.stats("tenant-a").totals
        assert (st.num_lookups, st.num_hits, st.num_matched_tokens) == (1, 0, 0)
        # The request's own prefill stored the prompt, the slots a failed fetch had reserved
        # included: the next request hits the host pool.
        assert conn.scheduler.index.held(block_hashes(key, PROMPT), "tenant-a") == 6
        s.kv_cache_manager.reset_prefix_cache()
        b = sup.request("b", PROMPT)
        s.add_request(b)
        out, _ = sup.step(s, [w], [views])
        (load, _), = out.kv_connector_metadata.loads
        assert load.chain_blocks == (0, 1, 2, 3, 4, 5) and not load.failed
    finally:
        if failure != "peer_down":
            peer.close()


def test_a_rotated_peer_secret_file_signs_without_a_restart(engine, tmp_path, monkeypatch):
    """The connector re-reads its peer secret file at every poll, as a kvfleet replica does: a
    fetch signed with the old secret is refused by a peer that moved on; once the file says
    "new, old" the next fetch is signed with the new one and succeeds, with no restart."""
    secret_file = tmp_path / "peer-secret"
    secret_file.write_text("old-secret\n")
    monkeypatch.delenv("KVFLEET_PEER_SECRET")
    monkeypatch.setenv("KVFLEET_PEER_SECRET_FILE", str(secret_file))
    peer = KvfleetPeer(secret="new-secret")
    try:
        s, w, views = engine()
        conn = sup.connector_of(s)
        svc = conn.scheduler.peers
        key = conn.scheduler.model_key.key("tenant-a")
        first, second = PROMPT, [(i * 13 + 7) % 500 for i in range(100)]
        for prompt in (first, second):
            peer.hold(key, prompt)
            publish(conn, "kvfleet-b", peer.url, block_hashes(key, prompt))
        s.add_request(sup.request("a", first))
        schedule_through_fetch(s, w, views)
        assert svc.stats.outcomes == {"refused": 1}  # signed with the old secret
        while s.has_unfinished_requests():
            sup.step(s, [w], [views])

        secret_file.write_text("new-secret\nold-secret\n")
        deadline = time.monotonic() + 30
        while svc.settings.secret != b"new-secret" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert svc.settings.secret == b"new-secret"
        assert svc.settings.secrets is not None
        assert svc.settings.secrets.accepted == (b"new-secret", b"old-secret")
        s.add_request(sup.request("b", second))
        outs = schedule_through_fetch(s, w, views)
        assert svc.stats.outcomes == {"refused": 1, "ok": 1}
        (load, _), = outs[-1].kv_connector_metadata.loads
        assert load.chain_blocks == (0, 1, 2, 3, 4, 5)
    finally:
        peer.close()


def test_no_peer_holds_more_costs_no_step(engine):
    s, w, views = engine()
    a = sup.request("a", PROMPT)
    s.add_request(a)
    out, _ = sup.step(s, [w], [views])
    assert out.num_scheduled_tokens  # scheduled at once: the hint index knows nobody
    assert sup.connector_of(s).scheduler.peers.stats.outcomes == {"no_peer": 1}


def test_a_kvfleet_fetcher_reads_the_connectors_host_pool(engine):
    s, w, views = engine()
    conn = sup.connector_of(s)
    torch.manual_seed(3)
    for view in views:
        view.copy_(torch.randn(view.shape, dtype=torch.float16))
    a = sup.request("a", PROMPT)
    s.add_request(a)
    outs = []
    while s.has_unfinished_requests():
        outs.append(sup.step(s, [w], [views])[0])
    (_plan, table), = [x for o in outs for x in o.kv_connector_metadata.saves]
    want_k, want_v = loaded_kv(views, table, 6)
    key = conn.scheduler.model_key.key("tenant-a")
    chain = block_hashes(key, PROMPT)
    svc = conn.scheduler.peers
    # Published once visible (the save's step is done): the hint index lists this replica.
    svc.call(svc.publisher.flush())
    assert svc.call(svc.hints.lookup_runs(chain, tenant="tenant-a")) == {"vllm-a": 6}
    assert svc.call(svc.hints.host_url("vllm-a")) == f"http://127.0.0.1:{svc.port}"

    async def fetch(secret: str, tenant_key: CacheKey) -> Any:
        hints = EmbeddedHintIndex()
        await hints.publish("vllm-a", chain)
        await hints.register_host("vllm-a", f"http://127.0.0.1:{svc.port}")
        fetcher = PeerFetcher(secret.encode(), hints, "kvfleet-b")
        run = await fetcher.fetch(tenant_key, PROMPT[:96], chain, expected_dtype="float16",
                                  expected_layout=(2, 4, 16))
        return run, dict(fetcher.stats.outcomes)

    run, outcomes = asyncio.run(fetch(SECRET, key))
    assert outcomes == {"ok": 1} and run.num_blocks == 6
    got_k = torch.frombuffer(run.k, dtype=torch.float16).view(2, 4, 96, 16)
    got_v = torch.frombuffer(run.v, dtype=torch.float16).view(2, 4, 96, 16)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # bitwise
    assert conn.scheduler.index.num_referenced_blocks == 0  # the export's references are released
    st = conn.scheduler.stats("tenant-a").totals
    assert st.num_lookups == 1  # serving a peer is not a lookup of this replica's

    # Another tenant's credential and key reach nothing; a wrong secret is refused.
    _, outcomes = asyncio.run(fetch(SECRET, conn.scheduler.model_key.key("tenant-b")))
    assert outcomes == {"hash_mismatch": 1} or outcomes == {"stale": 1}
    _, outcomes = asyncio.run(fetch("not-the-secret", key))
    assert outcomes == {"refused": 1}


def test_an_evicted_block_is_withdrawn_from_the_hint_index(engine):
    s, w, views = engine(num_host_blocks=6)
    conn = sup.connector_of(s)
    svc = conn.scheduler.peers
    s.add_request(sup.request("a", PROMPT))
    while s.has_unfinished_requests():
        sup.step(s, [w], [views])
    key = conn.scheduler.model_key.key("tenant-a")
    chain_a = block_hashes(key, PROMPT)
    svc.call(svc.publisher.flush())
    assert svc.call(svc.hints.lookup_runs(chain_a, tenant="tenant-a")) == {"vllm-a": 6}
    other = [(i * 13 + 1) % 500 for i in range(100)]
    s.add_request(sup.request("b", other))
    while s.has_unfinished_requests():
        sup.step(s, [w], [views])
    svc.call(svc.publisher.flush())
    assert svc.call(svc.hints.lookup_runs(chain_a, tenant="tenant-a")) == {}
    assert svc.call(svc.hints.lookup_runs(block_hashes(key, other), tenant="tenant-a")) == {
        "vllm-a": 6}


def test_the_fleet_config_names_the_peers_and_switches_t2(engine, tmp_path, monkeypatch):
    """No Redis, a fleet config: the hint index is the peer probe over the config's replicas
    (the kvfleet peer answers the held probe from its cache events), and `tiers.t2_peer: false`
    turns fetching and serving off live."""
    import json

    from kvfleet_runtime.fleet import PeerProbeHintIndex

    peer = KvfleetPeer()
    try:
        peer.held = peer.cache.num_held  # answers POST /kv/v1/held, from the cache's own index
        config = tmp_path / "fleet.yaml"

        def write(t2: bool) -> None:
            config.write_text(json.dumps({"tiers": {"t2_peer": t2}, "replicas": [
                {"name": "kvfleet-b", "url": peer.url}, {"name": "vllm-a", "url": "http://x:1"}]}))

        write(True)
        monkeypatch.setenv("KVFLEET_FLEET_CONFIG", str(config))
        s, w, views = engine()
        conn = sup.connector_of(s)
        svc = conn.scheduler.peers
        assert isinstance(svc.hints, PeerProbeHintIndex) and svc.enabled
        key = conn.scheduler.model_key.key("tenant-a")
        k, _ = peer.hold(key, PROMPT)
        a = sup.request("a", PROMPT)
        s.add_request(a)
        outs = schedule_through_fetch(s, w, views)
        assert svc.stats.outcomes == {"ok": 1} and svc.stats.blocks_fetched == 6
        (_load, table), = outs[-1].kv_connector_metadata.loads
        assert torch.equal(loaded_kv(views, table, 6)[0], k[:, :, :96])
        while s.has_unfinished_requests():
            sup.step(s, [w], [views])

        write(False)
        deadline = time.monotonic() + 30
        while svc.enabled and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not svc.enabled
        other = [(i * 17 + 2) % 500 for i in range(100)]
        peer.hold(key, other)
        s.add_request(sup.request("b", other))
        out, _ = sup.step(s, [w], [views])
        assert out.num_scheduled_tokens == {"b": 64}  # scheduled at once, nothing fetched
        assert svc.stats.outcomes == {"ok": 1}
        assert svc._held(block_hashes(key, PROMPT), "tenant-a") == 0  # serving is off too
    finally:
        peer.close()


def test_one_vllm_replica_fetches_from_another(engine, tmp_path, monkeypatch):
    """Two connectors (two schedulers, two host pools, two T2 threads): B's peer probe asks A's
    held probe at A's `peer_url` (not its API `url`), fetches A's blocks over A's peer server and
    loads them bitwise."""
    import json

    s_a, w_a, views_a = engine()
    a_conn = sup.connector_of(s_a)
    torch.manual_seed(5)
    for view in views_a:
        view.copy_(torch.randn(view.shape, dtype=torch.float16))
    s_a.add_request(sup.request("a", PROMPT))
    outs = []
    while s_a.has_unfinished_requests():
        outs.append(sup.step(s_a, [w_a], [views_a])[0])
    (_plan, table_a), = [x for o in outs for x in o.kv_connector_metadata.saves]
    saved_k, saved_v = loaded_kv(views_a, table_a, 6)

    config = tmp_path / "fleet-b.yaml"
    # as the operator writes a vLLM replica: `url` is its API port (here one nothing listens on),
    # T2 is on its connector's port, `peer_url`
    config.write_text(json.dumps({"replicas": [
        {"name": "vllm-a", "url": "http://127.0.0.1:1", "engine": "vllm",
         "peer_url": f"http://127.0.0.1:{a_conn.scheduler.peers.port}"}]}))
    monkeypatch.setenv("KVFLEET_FLEET_NAME", "vllm-b")
    monkeypatch.setenv("KVFLEET_FLEET_CONFIG", str(config))
    s_b, w_b, views_b = engine()
    b_conn = sup.connector_of(s_b)
    b = sup.request("b", PROMPT, max_tokens=1)
    s_b.add_request(b)
    outs = schedule_through_fetch(s_b, w_b, views_b)
    fetches = b_conn.scheduler.peers.stats
    assert fetches.outcomes == {"ok": 1} and fetches.blocks_fetched == 6
    (load, table_b), = outs[-1].kv_connector_metadata.loads
    assert load.chain_blocks == (0, 1, 2, 3, 4, 5)
    got_k, got_v = loaded_kv(views_b, table_b, 6)
    assert torch.equal(got_k, saved_k) and torch.equal(got_v, saved_v)  # bitwise, A's KV
    assert a_conn.scheduler.index.num_referenced_blocks == 0  # A released the run it streamed
    # serving B counted nothing in A
    assert a_conn.scheduler.stats("tenant-a").totals.num_lookups == 1


def test_a_stopped_t2_thread_means_no_t2_not_a_failed_request(engine, peer):
    s, w, views = engine()
    conn = sup.connector_of(s)
    key = conn.scheduler.model_key.key("tenant-a")
    peer.hold(key, PROMPT)
    publish(conn, "kvfleet-b", peer.url, block_hashes(key, PROMPT))
    conn.scheduler.peers.close()  # the thread's loop is closed, as if it had died
    s.add_request(sup.request("a", PROMPT))
    out, _ = sup.step(s, [w], [views])
    assert out.num_scheduled_tokens == {"a": 64} and out.kv_connector_metadata.loads == []
    assert peer.served == 0


def test_with_redis_the_replicas_share_one_hint_index(engine, tmp_path, monkeypatch):
    """KVFLEET_REDIS_URL set (a real redis-server, with a password as the chart's): A publishes
    its stored blocks to Redis, B finds A there and fetches."""
    from pathlib import Path as _Path

    from kvfleet_runtime.fleet import RedisHintIndex
    from tests.runtime.fleet.conftest import REDIS_SERVER, RedisProcess
    from tests.support import free_port

    if not _Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = RedisProcess(free_port(), tmp_path, password="t2-redis-pass")
    redis.start()
    try:
        monkeypatch.setenv("KVFLEET_REDIS_URL", redis.url)
        s_a, w_a, views_a = engine()
        a_conn = sup.connector_of(s_a)
        assert isinstance(a_conn.scheduler.peers.hints, RedisHintIndex)
        torch.manual_seed(9)
        for view in views_a:
            view.copy_(torch.randn(view.shape, dtype=torch.float16))
        s_a.add_request(sup.request("a", PROMPT))
        outs = []
        while s_a.has_unfinished_requests():
            outs.append(sup.step(s_a, [w_a], [views_a])[0])
        (_plan, table_a), = [x for o in outs for x in o.kv_connector_metadata.saves]
        a_conn.scheduler.peers.call(a_conn.scheduler.peers.publisher.flush())

        monkeypatch.setenv("KVFLEET_FLEET_NAME", "vllm-b")
        s_b, w_b, views_b = engine()
        b_conn = sup.connector_of(s_b)
        s_b.add_request(sup.request("b", PROMPT, max_tokens=1))
        outs = schedule_through_fetch(s_b, w_b, views_b)
        fetches = b_conn.scheduler.peers.stats
        assert fetches.outcomes == {"ok": 1} and fetches.blocks_fetched == 6
        (_load, table_b), = outs[-1].kv_connector_metadata.loads
        for got, want in zip(loaded_kv(views_b, table_b, 6), loaded_kv(views_a, table_a, 6),
                             strict=True):
            assert torch.equal(got, want)
    finally:
        redis.stop()


def test_t2_settings_are_checked_at_startup(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    for name in ("KVFLEET_FLEET_NAME", "KVFLEET_REDIS_URL", "KVFLEET_PEER_SECRET",
                 "KVFLEET_PEER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    # A port but no fleet settings (no name, no secret): T2 stays off, with a warning.
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", peer_port=0, peer_host="127.0.0.1")
    s = sup.scheduler(vc)
    assert sup.connector_of(s).scheduler.peers is None
    assert "peer_port is set but no fleet settings: T2 is off" in caplog.text
    monkeypatch.setenv("KVFLEET_PEER_SECRET", SECRET)
    for bad, message in ((70000, "peer_port must be a TCP port (0-65535), got 70000"),
                         ("http", "peer_port must be a TCP port (0-65535), got 'http'")):
        vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", peer_port=bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            sup.scheduler(vc)
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool", peer_port=0, peer_wait_s=0)
    with pytest.raises(ValueError, match=re.escape("peer_wait_s must be seconds in (0, 60]")):
        sup.scheduler(vc)
