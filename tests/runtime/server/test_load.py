"""Bounded loopback load: many concurrent clients, mixed hits and misses, no errors, memory flat."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp

from .conftest import RunningReplica, as_router

NUM_CLIENTS = 32
REQUESTS_PER_CLIENT = 3


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def _client(session: aiohttp.ClientSession, base: str, i: int,
                  statuses: list[int], cached: list[int]) -> None:
    rng = random.Random(i)
    system = [(13 * j + (i % 3)) % 256 for j in range(64)]  # three shared system prompts
    for _ in range(REQUESTS_PER_CLIENT):
        if rng.random() < 0.7:
            prompt = system + [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
        else:
            prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 100))]  # a miss
        body = {"prompt": prompt, "max_tokens": rng.randrange(1, 8), "temperature": 0}
        stream = rng.random() < 0.2
        if stream:
            body["stream"] = True
        url = base + "/v1/completions"
        headers = as_router({"X-Kvfleet-Tenant": f"load-{i % 4}"}, "POST", url)
        async with session.post(url, json=body, headers=headers) as resp:
            statuses.append(resp.status)
            if stream:
                text = await resp.text()
                assert text.rstrip().endswith("data: [DONE]")
            else:
                data = await resp.json()
                cached.append(data["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _round(base: str) -> tuple[list[int], list[int]]:
    statuses: list[int] = []
    cached: list[int] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(_client(session, base, i, statuses, cached)
                               for i in range(NUM_CLIENTS)))
    return statuses, cached


def test_loopback_load_mixed_hits_and_misses(running: RunningReplica) -> None:
    engine = running.replica.engine
    asyncio.run(_round(running.base_url))  # warm-up: allocations, admission sightings
    before = rss_bytes()
    statuses, cached = asyncio.run(_round(running.base_url))
    after = rss_bytes()
    assert statuses == [200] * (NUM_CLIENTS * REQUESTS_PER_CLIENT)
    assert any(c >= 64 for c in cached) and any(c == 0 for c in cached)
    # Memory bounded: the second round allocates nothing that stays (pools are preallocated).
    assert after - before < 64 << 20, f"RSS grew by {(after - before) >> 20} MiB"
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    cache = running.replica.cache
    assert cache is not None
    for tier in cache.stats().tiers:
        assert tier.num_blocks_used <= tier.num_blocks_capacity
