"""T2 peer transfer between real PrefixCaches over real aiohttp servers on 127.0.0.1, with fault
injection (corrupted bytes, a peer cut mid-transfer, a stalled peer, a dead peer, stale hints)
and tenant isolation. The fetching side is driven as the engine's prepare drives T2 (`land`:
`PeerTier.num_matched`, one allocation in an engine-shaped pool, `load_into` those blocks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import pytest
import torch
from aiohttp import web

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    CacheKey,
    Hit,
    LoadTarget,
    LowerTier,
    PagedBlocks,
    PrefixCache,
    TierQuery,
)
from kvfleet_runtime.fleet import (
    CacheBlockSource,
    EmbeddedHintIndex,
    ExportedRun,
    HintPublisher,
    PeerFetcher,
    PeerTier,
    WireOrder,
    peer_routes,
    peer_token,
    t2_serve,
)
from kvfleet_runtime.fleet.t2_fetch import FetchFailed
from kvfleet_runtime.wire import T2_PATH, TENANT_HEADER
from tests.runtime.fleet.t2_support import (
    KEY_A,
    KEY_B,
    LAYOUT,
    SECRET,
    TOKENS,
    land,
    make_cache,
    start_app,
    store,
)
from tests.support import free_port


@dataclass
class Replica:
    name: str
    cache: PrefixCache
    url: str
    runner: web.AppRunner


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]]]:
    index = EmbeddedHintIndex()
    runners: list[web.AppRunner] = []

    async def replica(
        name: str, secret: bytes | None = SECRET, chunk_bytes: int = 4 << 20
    ) -> Replica:
        cache = make_cache()
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(peer_routes(CacheBlockSource(cache), secret, chunk_bytes=chunk_bytes))
        url, runner = await start_app(app)
        runners.append(runner)
        await index.register_host(name, url)
        return Replica(name, cache, url, runner)

    yield index, replica
    for runner in runners:
        await runner.cleanup()


async def publish_all(index: EmbeddedHintIndex, replica: Replica, key: CacheKey) -> None:
    await index.publish(replica.name, replica.cache.block_hashes(key, TOKENS))


async def test_prefix_stored_on_a_is_fetched_by_b_and_equals_recompute(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a, _b = await replica("a"), await replica("b")
    publisher = HintPublisher(index, "a")
    a.cache.add_listener(lambda e: publisher.offer_stored(e.block_hashes, tenant=e.key.tenant_id)
                         if e.kind == "stored" else None)
    k, v = store(a.cache, KEY_A, TOKENS)
    await publisher.flush()  # the listener published a's blocks

    fetcher = PeerFetcher(SECRET, index, "b")
    got = await land(fetcher, KEY_A, TOKENS)  # straight into scattered engine blocks
    assert got.num_blocks == 8
    assert fetcher.stats.outcomes == {"ok": 1}
    assert fetcher.stats.blocks_fetched == 8
    assert fetcher.stats.bytes_fetched == 8 * LAYOUT.bytes_per_block
    n = 8 * BLOCK_SIZE
    assert torch.equal(got.k, k[:, :, :n]) and torch.equal(got.v, v[:, :, :n])


def test_t2_is_a_tier_below_the_cache() -> None:
    tier = PeerTier(PeerFetcher(SECRET, EmbeddedHintIndex(), "b"), LAYOUT,
                    asyncio.new_event_loop())
    assert isinstance(tier, LowerTier) and tier.name == "t2"
    tier.loop.close()


async def test_t2_off_or_too_short_matches_nothing_and_asks_nobody(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
) -> None:
    index, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    fetcher = PeerFetcher(SECRET, index, "b", min_blocks=2)
    tier = PeerTier(fetcher, LAYOUT, asyncio.get_running_loop())
    chain = tuple(a.cache.block_hashes(KEY_A, TOKENS))
    tier.enabled = False
    assert tier.num_matched(TierQuery(1, KEY_A, tuple(TOKENS), chain, 0)) == 0
    tier.enabled = True
    assert tier.num_matched(TierQuery(2, KEY_A, tuple(TOKENS), chain, 7)) == 0  # one block left
    assert fetcher.stats.outcomes == {}


async def test_a_lookup_forgotten_while_in_flight_leaves_nothing_behind(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
) -> None:
    index, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    tier = PeerTier(PeerFetcher(SECRET, index, "b"), LAYOUT, asyncio.get_running_loop())
    query = TierQuery(1, KEY_A, tuple(TOKENS), tuple(a.cache.block_hashes(KEY_A, TOKENS)), 0)
    assert tier.num_matched(query) is None  # the lookup runs on the loop, never here
    tier.forget(query)
    await asyncio.sleep(0.01)
    # Asked again (the same request id, a new request): a new lookup, not the forgotten one.
    assert tier.num_matched(query) is None
    while (n := tier.num_matched(query)) is None:
        await asyncio.sleep(0.001)
    assert n == 8
    done: list[int] = []
    tier.forget(query)  # found, then not loading after all: a later load lands nothing
    tier.load_into(query, LoadTarget(PagedBlocks.zeros(LAYOUT, 8, torch.device("cpu")),
                                     tuple(range(8))), done.append)
    assert done == [0]


async def test_partial_local_hit_fetches_only_the_rest(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a, b = await replica("a"), await replica("b")
    k, _v = store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    store(b.cache, KEY_A, TOKENS[: 3 * BLOCK_SIZE])
    fetcher = PeerFetcher(SECRET, index, "b")
    got = await land(fetcher, KEY_A, TOKENS, 3)  # blocks 0-2 supplied by the tiers above
    assert got.num_blocks == 5
    assert fetcher.stats.bytes_fetched == 2 * 5 * LAYOUT.bytes_per_block // 2
    assert torch.equal(got.k, k[:, :, 3 * BLOCK_SIZE : 8 * BLOCK_SIZE])


async def test_stale_hint_and_dead_peer_fall_back_to_recompute(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a, b = await replica("a"), await replica("b")
    await publish_all(index, a, KEY_A)  # a never stored it: a stale hint
    fetcher = PeerFetcher(SECRET, index, "b")
    assert (await land(fetcher, KEY_A, TOKENS)).num_blocks == 0
    await index.register_host("a", f"http://127.0.0.1:{free_port()}")  # nobody listens
    assert (await land(fetcher, KEY_A, TOKENS)).num_blocks == 0
    assert fetcher.stats.outcomes == {"stale": 1, "peer_error": 1}
    assert isinstance(b.cache.lookup(KEY_A, TOKENS), type(b.cache.lookup(KEY_B, TOKENS)))


async def test_unauthenticated_and_wrong_tenant_requests_are_refused(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    _index, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    body = {"key": KEY_A._asdict(), "token_ids": TOKENS, "start_block": 0}

    async def post(headers: dict[str, str], payload: object = body) -> int:
        async with session.post(a.url + T2_PATH, json=payload, headers=headers) as r:
            await r.read()
            return r.status

    good = {TENANT_HEADER: "tenant-a", "Authorization": f"Bearer {peer_token(SECRET, 'tenant-a')}"}
    assert await post(good) == 200
    assert await post({}) == 401
    assert await post({TENANT_HEADER: "tenant-a"}) == 401
    assert (
        await post({**good, "Authorization": "Bearer " + peer_token(b"wrong", "tenant-a")}) == 401
    )
    # A credential for tenant B cannot be used with tenant A's name or key.
    token_b = peer_token(SECRET, "tenant-b")
    assert await post({TENANT_HEADER: "tenant-a", "Authorization": f"Bearer {token_b}"}) == 401
    assert await post({TENANT_HEADER: "tenant-b", "Authorization": f"Bearer {token_b}"}) == 403
    # Tenant B, authenticated, asking for A's exact tokens under its own key: B's chain, nothing.
    as_b = {"key": KEY_B._asdict(), "token_ids": TOKENS, "start_block": 0}
    assert (
        await post({TENANT_HEADER: "tenant-b", "Authorization": f"Bearer {token_b}"}, as_b) == 404
    )
    assert await post(good, {"key": {"tenant_id": "tenant-a"}, "token_ids": TOKENS}) == 400
    assert await post(good, {**body, "token_ids": [-1] * 32}) == 400


async def test_tenant_b_can_never_obtain_tenant_a_blocks_through_the_fetcher(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a, b = await replica("a"), await replica("b")
    store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    # Even told (by a poisoned index) that a holds B's chain, the fetch finds nothing.
    await publish_all(index, a, KEY_B)
    fetcher = PeerFetcher(SECRET, index, "b")
    assert (await land(fetcher, KEY_B, TOKENS)).num_blocks == 0
    assert fetcher.stats.outcomes == {"stale": 1}
    assert not isinstance(b.cache.lookup(KEY_B, TOKENS), Hit)


async def test_disabled_without_secret(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a = await replica("a", secret=None)
    await replica("b")
    store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    fetcher = PeerFetcher(SECRET, index, "b")
    assert (await land(fetcher, KEY_A, TOKENS)).num_blocks == 0
    assert fetcher.stats.outcomes == {"http": 1}  # 503 from a
    no_secret = PeerFetcher(None, index, "b")
    assert (await land(no_secret, KEY_A, TOKENS)).num_blocks == 0
    assert no_secret.stats.outcomes == {"disabled": 1}


# -- a loopback TCP proxy that corrupts, cuts or stalls the peer's reply -------------------------


@contextlib.asynccontextmanager
async def faulty_proxy(target_port: int, mode: str, at_byte: int) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", target_port)

        async def upstream() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    up_w.write(data)
                    await up_w.drain()

        task = asyncio.create_task(upstream())
        seen = 0
        try:
            while data := await up_r.read(65536):
                if seen <= at_byte < seen + len(data):
                    i = at_byte - seen
                    if mode == "flip":
                        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                    elif mode == "cut":
                        writer.write(data[:i])
                        await writer.drain()
                        return
                    elif mode == "stall":
                        writer.write(data[:i])
                        await writer.drain()
                        await asyncio.sleep(30)
                seen += len(data)
                writer.write(data)
                await writer.drain()
        finally:
            task.cancel()
            writer.close()
            up_w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


@pytest.mark.parametrize(
    ("mode", "outcome"),
    [("flip", "checksum"), ("cut", "short_read"), ("stall", "timeout")],
)
async def test_faults_in_transit_give_recompute_never_wrong_kv(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
    mode: str,
    outcome: str,
) -> None:
    index, replica = fleet
    a, b = await replica("a"), await replica("b")
    store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    port = int(a.url.rsplit(":", 1)[1])
    # Past the HTTP and protocol headers, inside the first K frame.
    async with faulty_proxy(port, mode, at_byte=2500) as proxy_url:
        await index.register_host("a", proxy_url)
        # Only the stalled peer should hit the timeout, even on an overloaded CI box.
        fetcher = PeerFetcher(SECRET, index, "b", timeout_s=0.5 if mode == "stall" else 10)
        assert (await land(fetcher, KEY_A, TOKENS)).num_blocks == 0
    assert fetcher.stats.outcomes == {outcome: 1}
    assert not isinstance(b.cache.lookup(KEY_A, TOKENS), Hit)


async def test_concurrency_limit_sends_the_overflow_to_recompute(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a, _b = await replica("a"), await replica("b")
    store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    port = int(a.url.rsplit(":", 1)[1])
    async with faulty_proxy(port, "stall", at_byte=2500) as proxy_url:
        await index.register_host("a", proxy_url)
        fetcher = PeerFetcher(SECRET, index, "b", timeout_s=0.5, max_concurrency=1)
        results = await asyncio.gather(
            land(fetcher, KEY_A, TOKENS, request_id=1),
            land(fetcher, KEY_A, TOKENS, request_id=2),
        )
    assert [r.num_blocks for r in results] == [0, 0]
    assert fetcher.stats.outcomes == {"timeout": 1, "busy": 1}


async def test_hash_and_layout_mismatches_are_rejected(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a, b = await replica("a"), await replica("b")
    store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    fetcher = PeerFetcher(SECRET, index, "b")
    chain = b.cache.block_hashes(KEY_A, TOKENS)
    wrong = [bytes(16), *chain[1:]]
    # The index is asked about the wrong chain, so point it there too.
    await index.publish("a", wrong)
    assert await fetcher.fetch(KEY_A, TOKENS, wrong) is None
    assert await fetcher.fetch(KEY_A, TOKENS, chain, expected_dtype="bfloat16") is None
    assert await fetcher.fetch(KEY_A, TOKENS, chain, expected_layout=(2, 2, 16)) is None
    assert fetcher.stats.outcomes == {"hash_mismatch": 1, "layout_mismatch": 2}


@pytest.mark.parametrize(
    ("mode", "outcome"), [("cut", "partial_short_read"), ("flip", "partial_checksum")]
)
async def test_a_peer_failing_mid_run_still_gives_its_verified_leading_blocks(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
    mode: str,
    outcome: str,
) -> None:
    index, replica = fleet
    a = await replica("a", chunk_bytes=LAYOUT.bytes_per_block)  # one block per chunk
    await replica("b")
    k, _ = store(a.cache, KEY_A, TOKENS)
    await publish_all(index, a, KEY_A)
    port = int(a.url.rsplit(":", 1)[1])
    # Each chunk is ~2 KiB on the wire: fail inside the fourth or fifth.
    async with faulty_proxy(port, mode, at_byte=9000) as proxy_url:
        await index.register_host("a", proxy_url)
        fetcher = PeerFetcher(SECRET, index, "b", timeout_s=10)
        got = await land(fetcher, KEY_A, TOKENS)
    assert 1 <= got.num_blocks < 8
    assert fetcher.stats.outcomes == {outcome: 1}
    assert got.k.shape[2] == got.num_blocks * BLOCK_SIZE
    assert torch.equal(got.k, k[:, :, : got.num_blocks * BLOCK_SIZE])


async def test_receive_buffers_are_reused_without_mixing_runs(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    session: aiohttp.ClientSession,
) -> None:
    index, replica = fleet
    a, b = await replica("a"), await replica("b")
    prompts = [TOKENS, [t + 7 for t in TOKENS]]
    stored = []
    for tokens in prompts:
        stored.append(store(a.cache, KEY_A, tokens))
        await index.publish("a", a.cache.block_hashes(KEY_A, tokens))
    fetcher = PeerFetcher(SECRET, index, "b")
    for tokens, (k, _) in zip(prompts, stored, strict=True):
        run = await fetcher.fetch(KEY_A, tokens, b.cache.block_hashes(KEY_A, tokens))
        assert run is not None and run.num_blocks == 8
        got_k = torch.frombuffer(run.k, dtype=torch.float16).view(
            LAYOUT.num_layers, LAYOUT.num_kv_heads, 8 * BLOCK_SIZE, LAYOUT.head_dim)
        assert torch.equal(got_k, k[:, :, : 8 * BLOCK_SIZE])
        fetcher.recycle(run)
        assert len(fetcher._spare) == 2  # K and V buffers came back: the next run reuses them


# -- fetch_into: received in place, into a pool-like landing ------------------------------------

SLOTS = 12
"""Slots of the landing pool below; the run lands in scattered and consecutive slots."""
RUN_SLOTS = (7, 8, 9, 2, 3, 11, 0, 5)
SENTINEL = 0x5A


class LandingPool:
    """A host pool `[K|V, layer, head, slot, 16, head_dim]` as bytes (the vLLM connector's
    layout), filled with a sentinel so that any byte a fetch wrote shows."""

    def __init__(self) -> None:
        self.slot_bytes = BLOCK_SIZE * LAYOUT.head_dim * 2
        self.rows = 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads
        self.data = bytearray([SENTINEL]) * (self.rows * SLOTS * self.slot_bytes)

    def landing(self, lo: int, hi: int) -> list[memoryview]:
        whole = memoryview(self.data)
        return [whole[(row * SLOTS + s) * self.slot_bytes : (row * SLOTS + s + 1) * self.slot_bytes]
                for row in range(self.rows) for s in RUN_SLOTS[lo:hi]]

    def slot_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one slot, `[layers, heads, 16, head_dim]`."""
        t = torch.frombuffer(self.data, dtype=torch.float16).view(
            2, LAYOUT.num_layers, LAYOUT.num_kv_heads, SLOTS, BLOCK_SIZE, LAYOUT.head_dim)
        return t[0, :, :, slot], t[1, :, :, slot]

    def untouched_slots(self) -> set[int]:
        out = set()
        for slot in range(SLOTS):
            k, v = self.slot_kv(slot)
            raw = torch.cat([k.flatten(), v.flatten()]).view(torch.uint8)
            if bool((raw == SENTINEL).all()):
                out.add(slot)
        return out


async def fetch_into(fetcher: PeerFetcher, url: str, pool: LandingPool,
                     chain: list[bytes], **changes: object) -> tuple[int, object]:
    args: dict[str, object] = {"start_block": 0, "dtype": "float16",
                               "layout": (LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim)}
    args.update(changes)
    try:
        return await fetcher.fetch_into(url, KEY_A, TOKENS, chain, landing=pool.landing,
                                        **args)  # type: ignore[arg-type]
    except FetchFailed as exc:
        return 0, exc.outcome


async def test_fetch_into_lands_the_run_bitwise_in_its_slots(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
) -> None:
    index, replica = fleet
    a = await replica("a", chunk_bytes=3 * LAYOUT.bytes_per_block)  # chunks of 3, 3 and 2 blocks
    k, v = store(a.cache, KEY_A, TOKENS)
    pool = LandingPool()
    chain = a.cache.block_hashes(KEY_A, TOKENS)
    assert await fetch_into(PeerFetcher(SECRET, index, "b"), a.url, pool, chain) == (8, None)
    for i, slot in enumerate(RUN_SLOTS):
        got_k, got_v = pool.slot_kv(slot)
        span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
        assert torch.equal(got_k, k[:, :, span]) and torch.equal(got_v, v[:, :, span])
    assert pool.untouched_slots() == set(range(SLOTS)) - set(RUN_SLOTS)


@pytest.mark.parametrize(("mode", "outcome"), [("cut", "short_read"), ("flip", "checksum")])
async def test_fetch_into_a_cut_or_corrupted_run_keeps_only_its_verified_leading_blocks(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    mode: str,
    outcome: str,
) -> None:
    index, replica = fleet
    a = await replica("a", chunk_bytes=LAYOUT.bytes_per_block)  # one block per chunk
    k, _ = store(a.cache, KEY_A, TOKENS)
    port = int(a.url.rsplit(":", 1)[1])
    chain = a.cache.block_hashes(KEY_A, TOKENS)
    # Each chunk is ~2 KiB on the wire: fail inside the fourth or fifth.
    async with faulty_proxy(port, mode, at_byte=9000) as proxy_url:
        pool = LandingPool()
        got, why = await fetch_into(PeerFetcher(SECRET, index, "b"), proxy_url, pool, chain)
    assert 1 <= got < 8 and why == outcome
    for i, slot in enumerate(RUN_SLOTS[:got]):
        assert torch.equal(pool.slot_kv(slot)[0], k[:, :, i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
    # The failed chunk's bytes landed (in place) but are not counted, nor are later chunks a
    # corrupted stream still delivers; a cut stream lands nothing past the cut.
    if mode == "cut":
        assert set(RUN_SLOTS[got + 1 :]) <= pool.untouched_slots()
    # Cut or corrupted inside the first chunk: nothing verified, the fetch fails.
    async with faulty_proxy(port, mode, at_byte=1500) as proxy_url:
        assert (await fetch_into(PeerFetcher(SECRET, index, "b"), proxy_url, LandingPool(),
                                 chain))[1] == outcome


async def test_fetch_into_checks_the_header_before_any_byte_lands(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
) -> None:
    index, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    chain = a.cache.block_hashes(KEY_A, TOKENS)
    fetcher = PeerFetcher(SECRET, index, "b")
    for changes, outcome in (
        ({"dtype": "bfloat16"}, "layout_mismatch"),
        ({"layout": (LAYOUT.num_layers, LAYOUT.num_kv_heads, 2 * LAYOUT.head_dim)},
         "layout_mismatch"),
        ({"layout": (LAYOUT.num_layers, 2 * LAYOUT.num_kv_heads, LAYOUT.head_dim // 2)},
         "layout_mismatch"),
    ):
        pool = LandingPool()
        assert (await fetch_into(fetcher, a.url, pool, chain, **changes))[1] == outcome
        assert pool.untouched_slots() == set(range(SLOTS)), changes
    # The peer's blocks are not the chain asked for (a wrong hash in the middle).
    pool = LandingPool()
    wrong = [*chain[:3], bytes(16), *chain[4:]]
    assert (await fetch_into(fetcher, a.url, pool, wrong))[1] == "hash_mismatch"
    assert pool.untouched_slots() == set(range(SLOTS))


# -- a run served from where it lies (ExportedRun.views) ----------------------------------------


class InPlaceSource:
    """A `BlockSource` over a `LandingPool`-shaped memory holding the run in slots `RUN_SLOTS`:
    it exposes the run's bytes in place (`views`), and its `read` (the gather) must never be
    called."""

    def __init__(self, pool: LandingPool, chain: list[bytes]) -> None:
        self.pool, self.chain = pool, chain
        self.released = 0

    async def export(self, key: CacheKey, token_ids: object, start_block: int,
                     max_blocks: int) -> ExportedRun:
        def read(*_: object) -> bool:
            raise AssertionError("a run with views is sent in place, never gathered")

        def release() -> None:
            self.released += 1

        run = tuple(self.chain[start_block : start_block + max_blocks])
        return ExportedRun(start_block, run, "float16",
                           (LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                           LAYOUT.bytes_per_block, read, release,
                           lambda lo, hi: self.pool.landing(start_block + lo, start_block + hi))


@pytest.mark.parametrize("chunk_blocks", [1, 3, 8])
async def test_a_run_with_views_is_sent_in_place_bitwise(chunk_blocks: int) -> None:
    sender = LandingPool()
    torch.manual_seed(3)
    data = torch.randn(len(sender.data) // 2).half()
    sender.data[:] = data.view(torch.uint8).numpy().tobytes()
    chain = [bytes([i]) * 16 for i in range(8)]
    source = InPlaceSource(sender, chain)
    app = web.Application()
    app.add_routes(peer_routes(source, SECRET,
                               chunk_bytes=chunk_blocks * LAYOUT.bytes_per_block))
    url, runner = await start_app(app)
    try:
        fetcher = PeerFetcher(SECRET, EmbeddedHintIndex(), "b")
        run = await fetcher.fetch_from(url, KEY_A, TOKENS, 2, 6)
        assert run.num_blocks == 6 and run.partial is None
        for _ in range(500):  # the server releases the run once its stream ended
            if source.released:
                break
            await asyncio.sleep(0.01)
        assert source.released == 1
        got_k = torch.frombuffer(run.k, dtype=torch.float16).view(
            LAYOUT.num_layers, LAYOUT.num_kv_heads, 6 * BLOCK_SIZE, LAYOUT.head_dim)
        for i, slot in enumerate(RUN_SLOTS[2:]):
            want_k, _ = sender.slot_kv(slot)
            assert torch.equal(got_k[:, :, i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], want_k)
        # Bytes corrupted after they left the sender's memory fail the checksum taken there.
        port = int(url.rsplit(":", 1)[1])
        async with faulty_proxy(port, "flip", at_byte=1500) as proxy_url:
            with pytest.raises(FetchFailed, match="checksum"):
                await fetcher.fetch_from(proxy_url, KEY_A, TOKENS, 2, 6)
    finally:
        await runner.cleanup()


async def test_a_large_run_sent_in_place_survives_partial_sends_and_many_views() -> None:
    # 8 MiB in 4 MiB chunks, each chunk as 4,096 views of 1 KiB: more than one sendmsg's
    # worth of views, and more bytes than a loopback socket takes at once, so sends are cut
    # short and resumed mid-view.
    layers, heads, head_dim, n = 4, 8, 128, 32
    bytes_per_block = 2 * layers * heads * BLOCK_SIZE * head_dim * 2
    row_per_block = bytes_per_block // (2 * layers * heads)
    memory = bytearray(torch.randint(0, 256, (n * bytes_per_block,), dtype=torch.uint8)
                       .numpy().tobytes())
    whole = memoryview(memory)
    half = n * bytes_per_block // 2

    def views(lo: int, hi: int) -> list[memoryview]:
        rows = [whole[base + row * n * row_per_block + lo * row_per_block :
                      base + row * n * row_per_block + hi * row_per_block]
                for base in (0, half) for row in range(layers * heads)]
        return [row[i : i + 1024] for row in rows for i in range(0, len(row), 1024)]

    class Source:
        async def export(self, *_: object) -> ExportedRun:
            return ExportedRun(0, tuple(bytes([i]) * 16 for i in range(n)), "float16",
                               (layers, heads, head_dim), bytes_per_block,
                               lambda *_: False, lambda: None, views)

    app = web.Application()
    app.add_routes(peer_routes(Source(), SECRET, chunk_bytes=16 * bytes_per_block))
    url, runner = await start_app(app)
    try:
        tokens = list(range(n * BLOCK_SIZE))
        run = await PeerFetcher(SECRET, EmbeddedHintIndex(), "b").fetch_from(
            url, KEY_A, tokens, 0, n)
        assert run.num_blocks == n and run.partial is None
        assert bytes(run.k) == memory[:half] and bytes(run.v) == memory[half:]
    finally:
        await runner.cleanup()


# -- wire orders: each fetcher lands its own order, or the run is refused -----------------------


class BlockOrderPool(LandingPool):
    """A host pool in LBHNC order `[layer, slot, head, 16, K|V, head_dim]` (the vLLM connector's),
    as bytes, filled with the sentinel."""

    def landing(self, lo: int, hi: int) -> list[memoryview]:
        whole = memoryview(self.data)
        per = LAYOUT.bytes_per_block // LAYOUT.num_layers  # one slot of one layer
        return [whole[(layer * SLOTS + s) * per : (layer * SLOTS + s + 1) * per]
                for layer in range(LAYOUT.num_layers) for s in RUN_SLOTS[lo:hi]]

    def slot_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.frombuffer(self.data, dtype=torch.float16).view(
            LAYOUT.num_layers, SLOTS, LAYOUT.num_kv_heads, BLOCK_SIZE, 2, LAYOUT.head_dim)
        return t[:, slot, :, :, 0], t[:, slot, :, :, 1]


async def test_a_replica_gathers_a_run_into_the_order_the_fetcher_lands(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
) -> None:
    index, replica = fleet
    a = await replica("a", chunk_bytes=3 * LAYOUT.bytes_per_block)  # chunks of 3, 3 and 2 blocks
    k, v = store(a.cache, KEY_A, TOKENS)
    chain = a.cache.block_hashes(KEY_A, TOKENS)
    for pool, order in ((BlockOrderPool(), WireOrder.LBHNC), (LandingPool(), WireOrder.CANONICAL)):
        got = await fetch_into(PeerFetcher(SECRET, index, "b"), a.url, pool, chain, order=order)
        assert got == (8, None), order
        for i, slot in enumerate(RUN_SLOTS):
            got_k, got_v = pool.slot_kv(slot)
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            assert torch.equal(got_k, k[:, :, span]) and torch.equal(got_v, v[:, :, span]), order
        assert pool.untouched_slots() == set(range(SLOTS)) - set(RUN_SLOTS)


class BlockOrderSource:
    """A `BlockSource` whose run lies in a `BlockOrderPool` (LBHNC, in `RUN_SLOTS`): it exposes
    the run in place (`views`, order LBHNC) and gathers it for a fetcher of another order
    (`read`, which counts its calls)."""

    def __init__(self, pool: BlockOrderPool, chain: list[bytes]) -> None:
        self.pool, self.chain = pool, chain
        self.gathered: list[WireOrder] = []

    async def export(self, key: CacheKey, token_ids: object, start_block: int,
                     max_blocks: int) -> ExportedRun:
        run = tuple(self.chain[start_block : start_block + max_blocks])

        def read(hashes: list[bytes], order: WireOrder, out: memoryview) -> bool:
            # The reference gather: canonical K rows then V rows of the requested blocks.
            self.gathered.append(order)
            assert order is WireOrder.CANONICAL
            slots = [RUN_SLOTS[self.chain.index(h)] for h in hashes]
            k = torch.stack([self.pool.slot_kv(s)[0] for s in slots], dim=2)
            v = torch.stack([self.pool.slot_kv(s)[1] for s in slots], dim=2)
            flat = torch.cat([k.flatten(), v.flatten()]).view(torch.uint8)
            out[:] = flat.numpy().tobytes()
            return True

        return ExportedRun(start_block, run, "float16",
                           (LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                           LAYOUT.bytes_per_block, read, lambda: None,
                           lambda lo, hi: self.pool.landing(start_block + lo, start_block + hi),
                           WireOrder.LBHNC)


@pytest.mark.parametrize("chunk_blocks", [1, 3])
async def test_a_run_lying_in_another_order_is_gathered_for_the_fetcher(chunk_blocks: int) -> None:
    """A server whose run lies in LBHNC sends it in place to an LBHNC fetcher and gathers it
    into canonical rows for a canonical one (a kvfleet replica fetching from a connector):
    both land bitwise, never the other order's bytes under a checksum that passes."""
    sender = BlockOrderPool()
    torch.manual_seed(4)
    sender.data[:] = torch.randn(len(sender.data) // 2).half().view(torch.uint8).numpy().tobytes()
    chain = [bytes([i]) * 16 for i in range(8)]
    source = BlockOrderSource(sender, chain)
    app = web.Application()
    app.add_routes(peer_routes(source, SECRET, chunk_bytes=chunk_blocks * LAYOUT.bytes_per_block))
    url, runner = await start_app(app)
    try:
        fetcher = PeerFetcher(SECRET, EmbeddedHintIndex(), "b")
        run = await fetcher.fetch_from(url, KEY_A, TOKENS, 2, 6)  # canonical receive buffers
        assert run.num_blocks == 6 and run.partial is None
        assert source.gathered and set(source.gathered) == {WireOrder.CANONICAL}
        shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, 6 * BLOCK_SIZE, LAYOUT.head_dim)
        got_k = torch.frombuffer(run.k, dtype=torch.float16).view(shape)
        got_v = torch.frombuffer(run.v, dtype=torch.float16).view(shape)
        for i, slot in enumerate(RUN_SLOTS[2:]):
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            want_k, want_v = sender.slot_kv(slot)
            assert torch.equal(got_k[:, :, span], want_k)
            assert torch.equal(got_v[:, :, span], want_v)
        # An LBHNC fetcher is sent the run from where it lies: no gather.
        source.gathered.clear()
        receiver = BlockOrderPool()
        got = await fetch_into(fetcher, url, receiver, chain, order=WireOrder.LBHNC)
        assert got == (8, None) and source.gathered == []
        for slot in RUN_SLOTS:
            assert all(torch.equal(g, w) for g, w in zip(receiver.slot_kv(slot),
                                                         sender.slot_kv(slot), strict=True))
        assert receiver.untouched_slots() == set(range(SLOTS)) - set(RUN_SLOTS)
    finally:
        await runner.cleanup()


async def test_a_peer_answering_another_order_is_refused_before_any_byte_lands(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that ignores the asked order (one from before the field answers canonical):
    the header's order is checked with dtype and layout, the landing pool stays untouched, and
    the fetch fails (the connector recomputes)."""
    index, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    chain = a.cache.block_hashes(KEY_A, TOKENS)
    parse = t2_serve._parse_request

    def canonical_only(body: object, max_tokens: int) -> tuple[object, ...]:
        return (*parse(body, max_tokens)[:4], WireOrder.CANONICAL)

    monkeypatch.setattr(t2_serve, "_parse_request", canonical_only)
    pool = BlockOrderPool()
    got = await fetch_into(PeerFetcher(SECRET, index, "b"), a.url, pool, chain,
                           order=WireOrder.LBHNC)
    assert got == (0, "layout_mismatch")
    assert pool.untouched_slots() == set(range(SLOTS))


async def test_an_unknown_order_is_a_bad_request(
    fleet: tuple[EmbeddedHintIndex, Callable[..., Awaitable[Replica]]],
) -> None:
    _, replica = fleet
    a = await replica("a")
    store(a.cache, KEY_A, TOKENS)
    body = {"key": KEY_A._asdict(), "token_ids": TOKENS, "start_block": 0, "order": "LBNHC"}
    headers = {TENANT_HEADER: KEY_A.tenant_id,
               "Authorization": f"Bearer {peer_token(SECRET, KEY_A.tenant_id)}"}
    async with aiohttp.ClientSession() as s, s.post(a.url + T2_PATH, json=body,
                                                    headers=headers) as r:
        assert r.status == 400 and "order" in (await r.json())["error"]["message"]
