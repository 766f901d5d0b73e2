"""The held probe (`POST /kv/v1/held`) and the peer-probe hint index (no Redis, peers known):
authentication, body checks, tenant isolation, and a lookup that never raises and never waits
past its budget, with real PrefixCaches behind real aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from kvfleet_runtime.cache import CacheTuning, PrefixCache
from kvfleet_runtime.fleet import (
    MAX_PROBE_BLOCKS,
    CacheBlockSource,
    EmbeddedHintIndex,
    PeerFetcher,
    PeerProbeHintIndex,
    RedisHintIndex,
    fleet_tier,
    peer_routes,
    peer_token,
)
from kvfleet_runtime.fleet.fleet_tier import FleetSettings, hint_index_for
from kvfleet_runtime.wire import HELD_PATH, TENANT_HEADER
from tests.runtime.fleet.t2_support import (
    KEY_A,
    KEY_B,
    LAYOUT,
    SECRET,
    TOKENS,
    land,
    make_cache,
    prefill_kv,
    start_app,
    store,
)
from tests.support import free_port


@dataclass
class Peer:
    name: str
    cache: PrefixCache
    url: str


@pytest.fixture
async def peers() -> AsyncIterator[Callable[..., Awaitable[Peer]]]:
    runners: list[web.AppRunner] = []

    async def peer(name: str, secret: bytes | None = SECRET, probe: bool = True) -> Peer:
        cache = make_cache()
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(
            peer_routes(
                CacheBlockSource(cache, held=cache.num_held),
                secret,
                held=cache.num_held if probe else None,
            )
        )
        url, runner = await start_app(app)
        runners.append(runner)
        return Peer(name, cache, url)

    yield peer
    for runner in runners:
        await runner.cleanup()


def creds(tenant: str, secret: bytes = SECRET) -> dict[str, str]:
    return {TENANT_HEADER: tenant, "Authorization": f"Bearer {peer_token(secret, tenant)}"}


async def probe(
    session: aiohttp.ClientSession, url: str, body: object, headers: dict[str, str]
) -> tuple[int, dict[str, object]]:
    async with session.post(url + HELD_PATH, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def hexes(hashes: list[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


# -- the endpoint --------------------------------------------------------------------------


async def test_held_probe_answers_leading_blocks_of_the_callers_chain(
    peers: Callable[..., Awaitable[Peer]], session: aiohttp.ClientSession
) -> None:
    a = await peers("a")
    store(a.cache, KEY_A, TOKENS)
    chain = a.cache.block_hashes(KEY_A, TOKENS)
    assert len(chain) == 8
    assert await probe(session, a.url, {"block_hashes": hexes(chain)}, creds("tenant-a")) == (
        200,
        {"leading_blocks": 8},
    )
    longer = a.cache.block_hashes(KEY_A, TOKENS + list(range(64)))
    status, answer = await probe(session, a.url, {"block_hashes": hexes(longer)}, creds("tenant-a"))
    assert (status, answer) == (200, {"leading_blocks": 8})
    # A gap ends the run: block 0 missing -> 0 even though the rest is held.
    status, answer = await probe(
        session, a.url, {"block_hashes": hexes([b"\x00" * 16, *chain[1:]])}, creds("tenant-a")
    )
    assert (status, answer) == (200, {"leading_blocks": 0})


async def test_held_probe_authentication(
    peers: Callable[..., Awaitable[Peer]], session: aiohttp.ClientSession
) -> None:
    a = await peers("a")
    store(a.cache, KEY_A, TOKENS)
    body = {"block_hashes": hexes(a.cache.block_hashes(KEY_A, TOKENS))}
    for headers in (
        {},
        {TENANT_HEADER: "tenant-a"},
        {TENANT_HEADER: "tenant-a", "Authorization": "Bearer nope"},
        creds("tenant-a", b"another-fleet-secret"),
        # A credential for another tenant, presented as tenant a: refused.
        {TENANT_HEADER: "tenant-a", "Authorization": creds("tenant-b")["Authorization"]},
        {"Authorization": creds("tenant-a")["Authorization"]},
    ):
        status, answer = await probe(session, a.url, body, headers)
        assert status == 401, headers
        assert "credential" in str(answer["error"])
    # No fleet secret: refused, fail closed; no `held`: not answered.
    closed = await peers("closed", secret=None)
    assert (await probe(session, closed.url, body, creds("tenant-a")))[0] == 503
    mute = await peers("mute", probe=False)
    status, answer = await probe(session, mute.url, body, creds("tenant-a"))
    assert status == 503 and "held probes" in str(answer["error"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "JSON object"),
        ({"hashes": ["00"]}, "JSON object"),
        ({"block_hashes": ["00"], "extra": 1}, "JSON object"),
        ({"block_hashes": []}, f"1..{MAX_PROBE_BLOCKS}"),
        ({"block_hashes": "00ff"}, f"1..{MAX_PROBE_BLOCKS}"),
        ({"block_hashes": ["00"] * (MAX_PROBE_BLOCKS + 1)}, f"1..{MAX_PROBE_BLOCKS}"),
        ({"block_hashes": ["zz"]}, "hex"),
        ({"block_hashes": [17]}, "hex"),
        ({"block_hashes": [""]}, "hex"),
        ({"block_hashes": ["00" * 65]}, "hex"),
    ],
)
async def test_held_probe_bad_bodies_are_400_with_a_message(
    peers: Callable[..., Awaitable[Peer]],
    session: aiohttp.ClientSession,
    body: object,
    message: str,
) -> None:
    a = await peers("a")
    status, answer = await probe(session, a.url, body, creds("tenant-a"))
    assert status == 400
    assert message in str(answer["error"])


async def test_held_probe_not_json_is_400(
    peers: Callable[..., Awaitable[Peer]], session: aiohttp.ClientSession
) -> None:
    a = await peers("a")
    async with session.post(a.url + HELD_PATH, data=b"{nope", headers=creds("a")) as resp:
        assert resp.status == 400
        assert "error" in await resp.json()


async def test_held_probe_cap_is_accepted_at_the_limit(
    peers: Callable[..., Awaitable[Peer]], session: aiohttp.ClientSession
) -> None:
    a = await peers("a")
    body = {"block_hashes": ["00" * 16] * MAX_PROBE_BLOCKS}
    assert await probe(session, a.url, body, creds("tenant-a")) == (200, {"leading_blocks": 0})


async def test_tenant_b_learns_nothing_about_tenant_a_blocks(
    peers: Callable[..., Awaitable[Peer]], session: aiohttp.ClientSession
) -> None:
    """Tenant A's prompt is held on peer a. Tenant B's own chain for the same tokens differs
    (the key's tenant is in every hash), and even A's exact hashes, presented with B's valid
    credential, count as nothing: only blocks stored for the credential's tenant answer."""
    a = await peers("a")
    store(a.cache, KEY_A, TOKENS)
    chain_a = a.cache.block_hashes(KEY_A, TOKENS)
    chain_b = a.cache.block_hashes(KEY_B, TOKENS)
    assert not set(chain_a) & set(chain_b)
    ok = await probe(session, a.url, {"block_hashes": hexes(chain_a)}, creds("tenant-a"))
    assert ok == (200, {"leading_blocks": 8})
    for chain in (chain_b, chain_a):
        status, answer = await probe(
            session, a.url, {"block_hashes": hexes(chain)}, creds("tenant-b")
        )
        assert (status, answer) == (200, {"leading_blocks": 0})
    # Through the index and the fetcher: B's requests never find, never fetch A's blocks.
    index = PeerProbeHintIndex(SECRET, lambda: {"a": a.url}, "b", lookup_budget_s=5.0)
    try:
        assert await index.lookup_runs(chain_a, tenant="tenant-b") == {}
        assert await index.lookup_runs(chain_b, tenant="tenant-b") == {}
        assert await index.lookup_runs(chain_a, tenant="tenant-a") == {"a": 8}
        fetcher = PeerFetcher(SECRET, index, "b", resolve_url={"a": a.url}.get)
        assert (await land(fetcher, KEY_B, TOKENS)).num_blocks == 0
        assert fetcher.stats.outcomes == {"no_peer": 1}
    finally:
        await index.close()


async def test_platform_blocks_count_for_every_tenant() -> None:
    """Allow-listed platform blocks are shared by design: they count for any tenant; the
    tenant's own blocks after them do not."""
    cache = PrefixCache(
        CacheTuning(
            num_t0_blocks=64,
            admit_min_sightings=1,
            hot_min_sightings=2,
            platform_prefixes=(tuple(TOKENS[: 4 * 16]),),
        ),
        LAYOUT,
        clock=time.monotonic,
    )
    store(cache, KEY_A, TOKENS)
    chain_a = cache.block_hashes(KEY_A, TOKENS)
    chain_b = cache.block_hashes(KEY_B, TOKENS)
    assert chain_a[:4] == chain_b[:4] and not set(chain_a[4:]) & set(chain_b[4:])
    assert cache.num_held(chain_a, "tenant-a") == cache.num_held(chain_a) == 8
    assert cache.num_held(chain_a, "tenant-b") == cache.num_held(chain_b, "tenant-b") == 4


# -- the index -----------------------------------------------------------------------------


async def test_peer_probe_finds_each_peers_run_and_the_fetch_equals_recompute(
    peers: Callable[..., Awaitable[Peer]], session: aiohttp.ClientSession
) -> None:
    a, c = await peers("a"), await peers("c")
    store(a.cache, KEY_A, TOKENS)
    store(c.cache, KEY_A, TOKENS[: 3 * 16])
    b_cache = make_cache()
    urls = {"a": a.url, "c": c.url, "b": "http://127.0.0.1:1"}
    index = PeerProbeHintIndex(SECRET, lambda: urls, "b", lookup_budget_s=5.0)
    try:
        chain = b_cache.block_hashes(KEY_A, TOKENS)
        assert await index.lookup_runs(chain, tenant="tenant-a") == {"a": 8, "c": 3}
        hosts = await index.lookup(chain[:4], tenant="tenant-a")
        assert hosts == [frozenset({"a", "c"})] * 3 + [frozenset({"a"})]
        assert await index.host_url("a") == a.url and await index.host_url("x") is None
        # Nothing to publish: each peer answers for its own blocks.
        await index.publish("b", chain)
        await index.register_host("b", "http://elsewhere")
        assert await index.lookup_runs(chain, tenant="tenant-a") == {"a": 8, "c": 3}
        fetcher = PeerFetcher(SECRET, index, "b", resolve_url=urls.get)
        got = await land(fetcher, KEY_A, TOKENS)
        assert got.num_blocks == 8
        assert fetcher.stats.outcomes == {"ok": 1}
        k, v = prefill_kv(TOKENS)
        assert got.k.shape[2] == 8 * 16
        assert torch.equal(got.k, k[:, :, : 8 * 16]) and torch.equal(got.v, v[:, :, : 8 * 16])
    finally:
        await index.close()


def slow_app(delay_s: float, status: int = 200, answer: object = None) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay_s)
        return web.json_response(answer if answer is not None else {"leading_blocks": 1},
                                 status=status)

    app = web.Application()
    app.router.add_post(HELD_PATH, handle)
    return app


async def test_peers_down_slow_or_wrong_hold_nothing_and_the_lookup_never_raises(
    peers: Callable[..., Awaitable[Peer]],
) -> None:
    a = await peers("a")
    store(a.cache, KEY_A, TOKENS)
    chain = a.cache.block_hashes(KEY_A, TOKENS)
    runners = []
    urls = {"a": a.url, "dead": f"http://127.0.0.1:{free_port()}"}
    for name, app in (
        ("slow", slow_app(30.0)),
        ("refusing", slow_app(0.0, status=401, answer={"error": "no"})),
        ("liar", slow_app(0.0, answer={"leading_blocks": 10_000})),
        ("garbage", slow_app(0.0, answer=["?"])),
    ):
        url, runner = await start_app(app)
        runners.append(runner)
        urls[name] = url
    index = PeerProbeHintIndex(SECRET, lambda: urls, "b", lookup_budget_s=1.0)
    try:
        t = time.monotonic()
        assert await index.lookup_runs(chain, tenant="tenant-a") == {"a": 8}
        assert time.monotonic() - t < 10.0  # the slow peer (30 s) is not waited for
        assert index.stats.num_errors == 5
        # Failed peers back off: the next lookup does not ask them (the slow one is asked).
        assert await index.lookup_runs(chain, tenant="tenant-a") == {"a": 8}
        assert index.stats.num_skipped == 4
        # No tenant, no secret, no hashes, no peers, a broken peer list: nobody, no exception.
        assert await index.lookup_runs(chain) == {}
        assert await index.lookup_runs([], tenant="tenant-a") == {}
        no_secret = PeerProbeHintIndex(None, lambda: urls, "b")
        assert await no_secret.lookup_runs(chain, tenant="tenant-a") == {}
        await no_secret.close()

        def broken() -> dict[str, str]:
            raise RuntimeError("config gone")

        index.peers = broken
        assert await index.lookup_runs(chain, tenant="tenant-a") == {}
        assert await index.host_url("a") is None
        index.peers = lambda: {}
        assert await index.lookup_runs(chain, tenant="tenant-a") == {}
    finally:
        await index.close()
        for runner in runners:
            await runner.cleanup()


async def test_all_peers_down_costs_the_budget_at_most() -> None:
    urls = {f"p{i}": f"http://127.0.0.1:{free_port()}" for i in range(3)}
    index = PeerProbeHintIndex(SECRET, lambda: urls, "me", lookup_budget_s=0.5)
    try:
        for _ in range(3):
            t = time.monotonic()
            assert await index.lookup_runs([b"\x01" * 16], tenant="t") == {}
            assert time.monotonic() - t < 5.0
    finally:
        await index.close()


# -- fleet tier settings ---------------------------------------------------------------------------


@pytest.fixture
def no_mounted_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fleet_tier, "DEFAULT_SECRET_FILE", tmp_path / "absent-token")
    monkeypatch.setattr(fleet_tier, "DEFAULT_FLEET_CONFIG", tmp_path / "absent-fleet.yaml")


@pytest.mark.usefixtures("no_mounted_defaults")
async def test_hint_index_choice_redis_then_peers_then_embedded(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    base = {"KVFLEET_PEER_SECRET": "s", "KVFLEET_FLEET_NAME": "r0"}
    peers = {"r1": "http://127.0.0.1:9"}.copy

    def index_for(env: dict[str, str], with_peers: bool = True) -> object:
        settings = FleetSettings.from_env({**base, **env}, port=1)
        assert settings is not None
        return hint_index_for(settings, peers if with_peers else None)

    redis = index_for({"KVFLEET_REDIS_URL": "redis://127.0.0.1:1/0",
                       "KVFLEET_FLEET_CONFIG": str(config)})
    assert isinstance(redis, RedisHintIndex) and redis.lookup_budget_s == 0.002
    await redis.close()
    probe_index = index_for({"KVFLEET_FLEET_CONFIG": str(config)})
    assert isinstance(probe_index, PeerProbeHintIndex)
    assert probe_index.lookup_budget_s == 0.05 and probe_index.self_host == "r0"
    assert await probe_index.host_url("r1") == "http://127.0.0.1:9"
    await probe_index.close()
    tuned = index_for({"KVFLEET_FLEET_CONFIG": str(config), "KVFLEET_HINT_LOOKUP_BUDGET_S": "0.2"})
    assert isinstance(tuned, PeerProbeHintIndex) and tuned.lookup_budget_s == 0.2
    assert isinstance(index_for({}), EmbeddedHintIndex)
    assert isinstance(index_for({"KVFLEET_FLEET_CONFIG": str(config)}, False), EmbeddedHintIndex)

