"""T2 over NIXL between real PrefixCaches, real NIXL agents (UCX) and real aiohttp servers on
127.0.0.1: the leased run READ one-sided straight into the engine's blocks is bitwise the run
the HTTP path lands; tenant isolation holds on the control request; a lease that expired,
descriptors that went stale, a peer gone mid-read, a peer without NIXL all recompute (or go
over HTTP), never land wrong KV. The fetching side is driven as the engine's prepare drives T2
(`PeerTier.num_matched`, one allocation in an engine-shaped pool, `load_into`)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    CacheKey,
    LoadTarget,
    PagedBlocks,
    PrefixCache,
    TierQuery,
)
from kvfleet_runtime.fleet import (
    CacheBlockSource,
    EmbeddedHintIndex,
    PeerFetcher,
    PeerTier,
    peer_routes,
    peer_token,
)
from kvfleet_runtime.fleet.t2_lease import LeaseTable, PoolGeometry
from kvfleet_runtime.fleet.t2_nixl import NixlAgent, load_nixl
from kvfleet_runtime.fleet.t2_serve import NixlServing, lease_routes
from kvfleet_runtime.wire import LEASE_PATH, RELEASE_PATH, TENANT_HEADER
from tests.runtime.fleet.t2_support import (
    KEY_A,
    KEY_B,
    LAYOUT,
    POOL_BLOCKS,
    SCATTERED,
    SECRET,
    TOKENS,
    land,
    make_cache,
    start_app,
    store,
)
from tests.support import free_port

pytestmark = pytest.mark.skipif(load_nixl() is None, reason="NIXL is not installed")

FULL = 8 * BLOCK_SIZE


@dataclass
class NixlReplica:
    name: str
    cache: PrefixCache
    url: str
    agent: NixlAgent
    leases: LeaseTable


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]]]:
    index = EmbeddedHintIndex()
    runners: list[web.AppRunner] = []
    agents: list[NixlAgent] = []

    async def replica(name: str, *, ttl_s: float = 2.0,
                      serving: Callable[[NixlAgent], NixlServing | None] | None = None
                      ) -> NixlReplica:
        cache = make_cache()
        agent = NixlAgent.start(name, cache.pools())
        assert agent is not None
        agents.append(agent)
        leases = LeaseTable(ttl_s=ttl_s, max_blocks=32, clock=time.monotonic)
        answered = agent.serving() if serving is None else serving(agent)
        source = CacheBlockSource(cache)
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(peer_routes(source, SECRET))
        app.add_routes(lease_routes(source, SECRET, answered, leases))
        url, runner = await start_app(app)
        runners.append(runner)
        await index.register_host(name, url)
        return NixlReplica(name, cache, url, agent, leases)

    yield index, replica
    for runner in runners:
        await runner.cleanup()
    for agent in agents:
        agent.close()


@dataclass
class Fetching:
    """The fetching replica's side: its engine pool registered with its own agent."""

    fetcher: PeerFetcher
    kv: PagedBlocks
    agent: NixlAgent


@pytest.fixture
def fetching(fleet: tuple[EmbeddedHintIndex, object]) -> Iterator[Fetching]:
    kv = PagedBlocks.zeros(LAYOUT, POOL_BLOCKS, torch.device("cpu"))
    agent = NixlAgent.start("b", [kv])
    assert agent is not None
    yield Fetching(PeerFetcher(SECRET, fleet[0], "b"), kv, agent)
    agent.close()


async def land_nixl(
    side: Fetching, key: CacheKey, tokens: list[int], block_ids: tuple[int, ...] = SCATTERED,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The engine's prepare with T2 over NIXL: (blocks landed, their K and V canonical)."""
    tier = PeerTier(side.fetcher, LAYOUT, asyncio.get_running_loop(), nixl=side.agent)
    chain = tuple(make_cache().block_hashes(key, tokens[: len(tokens) // BLOCK_SIZE * BLOCK_SIZE]))
    query = TierQuery(1, key, tuple(tokens), chain, 0)
    while (n := tier.num_matched(query)) is None:
        await asyncio.sleep(0.001)
    if not n:
        return 0, torch.empty(0), torch.empty(0)
    side.kv.k.fill_(float("nan"))
    side.kv.v.fill_(float("nan"))
    ids = block_ids[:n]
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    tier.load_into(query, LoadTarget(side.kv, ids), done.set_result)
    got = await done
    return (got, torch.cat([side.kv.k[:, i] for i in ids[:got]], dim=2) if got else torch.empty(0),
            torch.cat([side.kv.v[:, i] for i in ids[:got]], dim=2) if got else torch.empty(0))


async def released(replica: NixlReplica) -> None:
    """Until the fetcher's release (sent after the transfer, off its path) has arrived."""
    deadline = time.monotonic() + 1.5  # well inside the lease's 2 s
    while len(replica.leases) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert len(replica.leases) == 0


async def publish(index: EmbeddedHintIndex, replica: NixlReplica, key: CacheKey) -> None:
    await index.publish(replica.name, replica.cache.block_hashes(key, TOKENS))


async def test_a_leased_run_read_over_nixl_is_bitwise_the_http_paths(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]], fetching: Fetching,
) -> None:
    index, replica = fleet
    a = await replica("a")
    k, v = store(a.cache, KEY_A, TOKENS)
    await publish(index, a, KEY_A)
    got, nk, nv = await land_nixl(fetching, KEY_A, TOKENS)
    assert got == 8
    assert fetching.fetcher.stats.outcomes == {"ok": 1}
    assert fetching.fetcher.stats.bytes_fetched == 8 * LAYOUT.bytes_per_block
    over_http = await land(PeerFetcher(SECRET, index, "c"), KEY_A, TOKENS)
    assert over_http.num_blocks == 8
    assert torch.equal(nk, over_http.k) and torch.equal(nv, over_http.v)
    assert torch.equal(nk, k[:, :, :FULL]) and torch.equal(nv, v[:, :, :FULL])
    await released(a)
    assert a.leases.num_expired == 0  # released, not expired
    # A second fetch reuses the peer's agent (its metadata is not sent again).
    got, _, _ = await land_nixl(fetching, KEY_A, TOKENS, block_ids=tuple(range(8)))
    assert got == 8 and fetching.fetcher.stats.outcomes == {"ok": 2}


async def test_the_leased_blocks_are_pinned_until_the_release(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]],
) -> None:
    _, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    run = await CacheBlockSource(a.cache).lease(KEY_A, TOKENS, 0, 8)
    assert run is not None and len(run.slots) == 8
    lease = a.leases.grant("tenant-a", 8, run.unpin)
    assert lease is not None
    # The whole T0 pool churned by other prompts: the leased blocks stay where they were.
    before = [a.cache.pools()[0].k[:, s].clone() for _, s in run.slots]  # type: ignore[union-attr]
    for i in range(12):
        store(a.cache, KEY_A, list(range(50_000 + i * 1000, 50_000 + i * 1000 + FULL)))
    assert a.cache.num_held(a.cache.block_hashes(KEY_A, TOKENS)) == 8
    after = [a.cache.pools()[0].k[:, s] for _, s in run.slots]  # type: ignore[union-attr]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert a.leases.release(lease.lease_id, "tenant-a") is lease


async def test_a_lease_that_expired_before_the_release_recomputes(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]], fetching: Fetching,
) -> None:
    index, replica = fleet
    a = await replica("a", ttl_s=1e-6)  # over before its answer arrives
    let_go = a.agent.hold_progress()  # (one process: the serving agent progressed all along)
    store(a.cache, KEY_A, TOKENS)
    await publish(index, a, KEY_A)
    got, _, _ = await land_nixl(fetching, KEY_A, TOKENS)
    assert got == 0
    assert fetching.fetcher.stats.outcomes == {"lease_expired": 1}
    let_go()


async def test_stale_descriptors_recompute(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]], fetching: Fetching,
) -> None:
    index, replica = fleet
    elsewhere = PagedBlocks.zeros(LAYOUT, 64, torch.device("cpu"))  # never registered

    def stale(agent: NixlAgent) -> NixlServing:
        from kvfleet_runtime.fleet.t2_nixl import pool_geometry
        return dataclasses.replace(agent.serving(),
                                   geometries=(pool_geometry(elsewhere.k, elsewhere.v),))

    a = await replica("a", serving=stale)
    store(a.cache, KEY_A, TOKENS)
    await publish(index, a, KEY_A)
    got, _, _ = await land_nixl(fetching, KEY_A, TOKENS)
    assert got == 0
    assert fetching.fetcher.stats.outcomes == {"nixl": 1}
    await released(a)  # by the fetcher that gave up


async def test_a_peer_answering_another_layout_is_refused_before_any_read(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]], fetching: Fetching,
) -> None:
    index, replica = fleet

    def halved(agent: NixlAgent) -> NixlServing:
        g = agent.geometries[0]
        return dataclasses.replace(agent.serving(), geometries=(dataclasses.replace(
            g, piece_bytes=g.piece_bytes // 2, block_stride=g.block_stride // 2),))

    a = await replica("a", serving=halved)
    store(a.cache, KEY_A, TOKENS)
    await publish(index, a, KEY_A)
    got, _, _ = await land_nixl(fetching, KEY_A, TOKENS)
    assert got == 0 and fetching.fetcher.stats.outcomes == {"layout_mismatch": 1}
    assert torch.isnan(fetching.kv.k).all()  # nothing landed


async def test_a_peer_without_nixl_is_fetched_from_over_http(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]], fetching: Fetching,
) -> None:
    index, replica = fleet
    a = await replica("a", serving=lambda agent: None)
    k, _ = store(a.cache, KEY_A, TOKENS)
    await publish(index, a, KEY_A)
    got, nk, _ = await land_nixl(fetching, KEY_A, TOKENS)
    assert got == 8 and torch.equal(nk, k[:, :, :FULL])
    assert fetching.fetcher.stats.outcomes == {"ok": 1}
    assert not fetching.fetcher.serves_nixl(a.url)  # remembered: HTTP for a while


async def lease_request(url: str, credential_tenant: str, key: CacheKey,
                        tokens: list[int], session: aiohttp.ClientSession) -> tuple[int, dict]:
    body = {"key": key._asdict(), "token_ids": tokens, "start_block": 0, "max_blocks": 8}
    headers = {TENANT_HEADER: credential_tenant,
               "Authorization": f"Bearer {peer_token(SECRET, credential_tenant)}"}
    async with session.post(url + LEASE_PATH, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_a_credential_for_tenant_b_gets_no_descriptor_of_tenant_a(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[NixlReplica]]],
    session: aiohttp.ClientSession,
) -> None:
    _, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    # B's credential naming A's key: refused. B's own key with A's exact tokens: nothing held
    # (the chain is recomputed under B's tenant). No credential: 401.
    status, _ = await lease_request(a.url, "tenant-b", KEY_A, TOKENS, session)
    assert status == 403
    status, answer = await lease_request(a.url, "tenant-b", KEY_B, TOKENS, session)
    assert status == 404 and "slots" not in answer and "metadata" not in answer
    async with session.post(a.url + LEASE_PATH, json={}) as resp:
        assert resp.status == 401
    assert len(a.leases) == 0
    # A's own credential: its run, and a lease B cannot end.
    status, answer = await lease_request(a.url, "tenant-a", KEY_A, TOKENS, session)
    assert status == 200 and len(answer["slots"]) == 8
    headers = {TENANT_HEADER: "tenant-b",
               "Authorization": f"Bearer {peer_token(SECRET, 'tenant-b')}"}
    async with session.post(a.url + RELEASE_PATH, json={"lease": answer["lease"]},
                            headers=headers) as resp:
        assert resp.status == 200 and (await resp.json()) == {"held": False}
    assert len(a.leases) == 1
    headers = {TENANT_HEADER: "tenant-a",
               "Authorization": f"Bearer {peer_token(SECRET, 'tenant-a')}"}
    async with session.post(a.url + RELEASE_PATH, json={"lease": answer["lease"]},
                            headers=headers) as resp:
        assert (await resp.json()) == {"held": True}


@pytest.fixture
def peer_process() -> Iterator[Callable[..., str]]:
    """A serving peer in its own process (tests/runtime/fleet/nixl_peer.py): its URL."""
    procs: list[subprocess.Popen[str]] = []

    def start(*extra: str) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.fleet.nixl_peer", "--port", str(port), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:  # NIXL logs on stdout too
            if line.strip() == "ready":  # then keep its pipe drained
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                return f"http://127.0.0.1:{port}"
        raise AssertionError("the peer process ended before it served")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.slow
async def test_two_processes_read_over_nixl_and_a_peer_gone_mid_read_recomputes(
    fetching: Fetching, peer_process: Callable[..., str],
    fleet: tuple[EmbeddedHintIndex, object],
) -> None:
    index = fleet[0]
    chain = make_cache().block_hashes(KEY_A, TOKENS)
    alive = peer_process()
    await index.register_host("alive", alive)
    await index.publish("alive", chain)
    got, nk, nv = await land_nixl(fetching, KEY_A, TOKENS)
    k, v = store(make_cache(), KEY_A, TOKENS)  # what the peer stored (the same prefill)
    assert got == 8 and fetching.fetcher.stats.outcomes == {"ok": 1}
    assert torch.equal(nk, k[:, :, :FULL]) and torch.equal(nv, v[:, :, :FULL])

    dying = peer_process("--die-after-lease")
    await index.withdraw("alive", chain)
    await index.register_host("dying", dying)
    await index.publish("dying", chain)
    got, _, _ = await land_nixl(fetching, KEY_A, TOKENS)
    assert got == 0
    failed = {o: n for o, n in fetching.fetcher.stats.outcomes.items() if o != "ok"}
    assert sum(failed.values()) == 1 and set(failed) <= {"nixl", "peer_error", "lease_expired"}
    # The fetcher is unharmed: the live peer still serves it.
    await index.publish("alive", chain)
    await index.withdraw("dying", chain)
    got, _, _ = await land_nixl(fetching, KEY_A, TOKENS)
    assert got == 8


def test_geometry_of_an_engine_pool_matches_its_blocks() -> None:
    kv = PagedBlocks.zeros(LAYOUT, 4, torch.device("cpu"))
    from kvfleet_runtime.fleet.t2_nixl import pool_geometry
    g = pool_geometry(kv.k, kv.v)
    assert isinstance(g, PoolGeometry) and g.contiguous() and g.num_blocks == 4
    assert g.address(1, 1, 2) == kv.v[1, 2].data_ptr()
    assert g.piece_bytes == kv.k[0, 0].nbytes


class _UncancellableRead:
    """A transfer NIXL cannot cancel (a fault real NIXL shows only under a stuck peer): release
    raises while the transfer is in flight, and it ends after `polls` state checks."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.released = False

    def release(self) -> None:
        if self.polls > 0:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released = True


class _Agent:
    def __init__(self) -> None:
        self.checks = 0

    def check_xfer_state(self, handle: _UncancellableRead) -> str:
        self.checks += 1
        handle.polls -= 1
        return "PROC" if handle.polls > 0 else "DONE"


def _bare_agent() -> Any:
    from kvfleet_runtime.fleet.t2_nixl import NixlAgent

    agent = object.__new__(NixlAgent)
    agent._agent = _Agent()
    return agent


def test_a_read_nixl_cannot_cancel_is_waited_for_until_it_ends() -> None:
    agent = _bare_agent()
    handle = _UncancellableRead(polls=5)
    agent._settle([handle], "peer")
    # the blocks go back to the engine only once the transfer is over
    assert handle.released and agent._agent.checks == 5


def test_a_read_that_never_ends_stops_the_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvfleet_runtime.fleet.t2_nixl as t2_nixl

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(t2_nixl, "SETTLE_S", 0.05)
    monkeypatch.setattr(t2_nixl.os, "_exit", exit_)
    agent = _bare_agent()
    with pytest.raises(SystemExit) as stopped:
        agent._settle([_UncancellableRead(polls=10**9)], "peer")
    assert stopped.value.code == t2_nixl.STUCK_EXIT_CODE
