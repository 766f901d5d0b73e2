"""Hint index contract, embedded and real Redis, including Redis dying mid-run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis

from kvfleet_runtime.fleet import (
    EmbeddedHintIndex,
    HintIndex,
    RedisHintIndex,
    best_peer,
    leading_runs,
)
from tests.runtime.fleet.conftest import RedisProcess
from tests.support import FakeClock, free_port

H = [bytes([i]) * 16 for i in range(8)]


@pytest.mark.parametrize(
    ("hosts", "runs"),
    [
        ([{"a", "b"}, {"a"}, {"a", "b"}], {"a": 3, "b": 1}),
        ([{"a"}, set(), {"a"}], {"a": 1}),
        ([set(), {"a"}], {}),
        ([], {}),
    ],
)
def test_leading_runs_count_only_gapless_runs_from_the_first_block(
    hosts: list[set[str]], runs: dict[str, int]
) -> None:
    assert leading_runs([frozenset(h) for h in hosts]) == runs


def test_best_peer_is_longest_then_smallest_name_never_self() -> None:
    assert best_peer({"b": 3, "a": 3, "me": 9}, exclude="me") == ("a", 3)
    assert best_peer({"me": 9}, exclude="me") is None
    assert best_peer({}) is None


@pytest.fixture(params=["embedded", "redis"])
async def index_and_clock(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[HintIndex, FakeClock]]:
    clock = FakeClock(1000.0)
    index: HintIndex
    if request.param == "embedded":
        index = EmbeddedHintIndex(ttl_s=60, clock=clock)
    else:
        server: RedisProcess = request.getfixturevalue("redis_server")
        # The contract, not the latency budget, is under test here: generous timeouts so a
        # loaded machine cannot turn a slow answer into a silent non-answer.
        index = RedisHintIndex.from_url(server.url, ttl_s=60, clock=clock, lookup_budget_s=10.0,
                                        write_timeout_s=10.0)
    try:
        yield index, clock
    finally:
        await index.close()


async def test_publish_lookup_withdraw_expire(index_and_clock: tuple[HintIndex, FakeClock]) -> None:
    index, clock = index_and_clock
    await index.publish("r1", H[:3])
    await index.publish("r2", H[:1])
    assert await index.lookup(H[:4]) == [
        frozenset({"r1", "r2"}),
        frozenset({"r1"}),
        frozenset({"r1"}),
        frozenset(),
    ]
    await index.withdraw("r1", H[1:2])
    assert await index.lookup(H[:3]) == [frozenset({"r1", "r2"}), frozenset(), frozenset({"r1"})]
    clock.advance(30)
    await index.publish("r2", H[2:3])  # refreshed later: outlives r1's entry
    clock.advance(31)
    assert await index.lookup(H[:3]) == [frozenset(), frozenset(), frozenset({"r2"})]
    assert await index.lookup([]) == []


async def test_lookup_runs_matches_leading_runs(
    index_and_clock: tuple[HintIndex, FakeClock],
) -> None:
    index, _ = index_and_clock
    await index.publish("r1", H[:5])
    await index.publish("r2", H[:2])
    await index.publish("r2", H[3:5])  # a gap: only the first two count
    await index.publish("r3", H[1:5])  # no block 0: worth nothing
    assert await index.lookup_runs(H[:6]) == {"r1": 5, "r2": 2}
    assert await index.lookup_runs(H[:6]) == leading_runs(await index.lookup(H[:6]))
    assert await index.lookup_runs([]) == {}


async def test_host_urls(index_and_clock: tuple[HintIndex, FakeClock]) -> None:
    index, _ = index_and_clock
    assert await index.host_url("r1") is None
    await index.register_host("r1", "http://127.0.0.1:1234")
    assert await index.host_url("r1") == "http://127.0.0.1:1234"


async def test_embedded_index_is_bounded() -> None:
    clock = FakeClock(1000.0)
    index = EmbeddedHintIndex(ttl_s=10, clock=clock, max_entries=4)
    await index.publish("r1", H[:4])
    await index.publish("r1", H[4:6])  # full: new hashes dropped
    assert len(index) == 4
    clock.advance(11)
    await index.publish("r1", H[4:6])  # the sweep frees the expired ones
    assert len(index) == 2
    assert await index.lookup(H[4:6]) == [frozenset({"r1"})] * 2


async def test_redis_down_from_the_start_answers_nobody_fast() -> None:
    index = RedisHintIndex.from_url(
        f"redis://127.0.0.1:{free_port()}/0", lookup_budget_s=0.2, backoff_s=30
    )
    try:
        assert await index.lookup(H[:2]) == [frozenset(), frozenset()]
        assert await index.lookup_runs(H[:2]) == {}
        await index.publish("r1", H[:2])
        for _ in range(100):
            assert await index.lookup(H[:2]) == [frozenset(), frozenset()]
        # Backing off: one failed connection attempt, then every call is answered without one.
        assert index.stats.num_errors == 1 and index.stats.num_skipped >= 100
        assert await index.host_url("r1") is None
    finally:
        await index.close()


async def test_redis_stopped_mid_run_then_restarted(redis_server: RedisProcess) -> None:
    index = RedisHintIndex.from_url(
        redis_server.url, lookup_budget_s=5.0, write_timeout_s=5.0, backoff_s=0.2,
        max_backoff_s=0.2,
    )
    try:
        await index.publish("r1", H[:2])
        assert await index.lookup(H[:2]) == [frozenset({"r1"})] * 2
        redis_server.stop()
        for _ in range(20):  # every call answers, none raises
            assert await index.lookup(H[:2]) == [frozenset(), frozenset()]
            assert await index.lookup_runs(H[:2]) == {}
            await index.publish("r1", H[:2])
            await index.withdraw("r1", H[:1])
        assert index.stats.num_errors >= 1
        redis_server.start()  # same port, empty (no persistence)
        await asyncio.sleep(0.25)  # past the backoff
        deadline = time.monotonic() + 5
        while await index.lookup(H[:1]) != [frozenset({"r1"})] and time.monotonic() < deadline:
            await index.publish("r1", H[:1])
            await asyncio.sleep(0.05)
        assert await index.lookup(H[:1]) == [frozenset({"r1"})]
    finally:
        await index.close()


async def test_redis_lookup_of_a_2000_token_prompt_is_one_round_trip(
    redis_server: RedisProcess,
) -> None:
    hashes = [i.to_bytes(16, "big") for i in range(125)]  # 2,000 tokens
    index = RedisHintIndex.from_url(redis_server.url, lookup_budget_s=10.0, write_timeout_s=10.0)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        await index.publish("r1", hashes)
        assert await index.lookup_runs(hashes) == {"r1": 125}  # loads the script once

        def calls() -> dict[str, int]:
            stats = admin.info("commandstats")
            return {name: int(stats[f"cmdstat_{name}"]["calls"])
                    for name in ("evalsha", "zrangebyscore") if f"cmdstat_{name}" in stats}

        before = calls()
        for _ in range(30):
            assert await index.lookup_runs(hashes) == {"r1": 125}
        after = calls()
        # One EVALSHA per lookup; the script reads the 125 keys inside Redis. Its latency is a
        # benchmark figure (`kvfleet bench fleet`), not a test.
        assert after["evalsha"] - before["evalsha"] == 30
        assert after["zrangebyscore"] - before.get("zrangebyscore", 0) == 30 * 125
    finally:
        admin.close()
        await index.close()
