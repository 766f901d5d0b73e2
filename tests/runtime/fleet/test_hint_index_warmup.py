"""A hint index whose connections take longer to open than a lookup's budget still warms up:
after the first failures it connects and loads its scripts in the background. The slow connect
is a loopback proxy in front of a real redis-server that holds each new connection back (a fault
a real server on loopback cannot produce)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from kvfleet_runtime.fleet import RedisHintIndex
from tests.runtime.fleet.conftest import RedisProcess

H = [bytes([i]) * 16 for i in range(4)]
CONNECT_DELAY_S = 0.2
"""Longer than the lookup budget below: no lookup can open its own connection in time."""


@contextlib.asynccontextmanager
async def slow_connect_proxy(port: int) -> AsyncIterator[int]:
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(CONNECT_DELAY_S)
        server_r, server_w = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


async def test_an_index_that_cannot_connect_within_its_budget_warms_up_in_the_background(
    redis_server: RedisProcess,
) -> None:
    tenant = "acme"
    direct = RedisHintIndex.from_url(redis_server.url, write_timeout_s=10.0)
    await direct.publish("r1", H, tenant=tenant)
    async with slow_connect_proxy(redis_server.port) as proxy_port:
        index = RedisHintIndex.from_url(
            f"redis://127.0.0.1:{proxy_port}/0", lookup_budget_s=0.05, write_timeout_s=10.0,
            backoff_s=0.05, max_backoff_s=0.05)
        try:
            answers = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                answers.append(await index.lookup_runs(H, tenant=tenant))
                if answers[-1]:
                    break
                await asyncio.sleep(0.02)
            assert answers[0] == {}  # the first lookup could not connect in time
            assert answers[-1] == {"r1": 4}, f"never warmed up: {len(answers)} lookups"
            assert index.stats.num_errors >= 1
        finally:
            await index.close()
            await direct.close()
