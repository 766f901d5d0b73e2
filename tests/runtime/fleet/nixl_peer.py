"""A serving peer in a process of its own for the T2-over-NIXL tests: a real PrefixCache holding
`t2_support.TOKENS` for tenant A, the T2 routes and the lease routes with a real NIXL agent, on
the port given. `--die-after-lease`: the process exits right after answering its first lease
(a peer gone mid-read). Prints "ready" once it serves."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from aiohttp import web

from kvfleet_runtime.fleet import CacheBlockSource, peer_routes
from kvfleet_runtime.fleet.t2_lease import LeaseTable
from kvfleet_runtime.fleet.t2_nixl import NixlAgent
from kvfleet_runtime.fleet.t2_serve import lease_routes
from tests.runtime.fleet.t2_support import KEY_A, SECRET, TOKENS, make_cache, store


class DyingSource(CacheBlockSource):
    async def lease(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        run = await super().lease(*args, **kwargs)
        asyncio.get_running_loop().call_later(0.0, os._exit, 0)  # after the answer is written
        return run


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--die-after-lease", action="store_true")
    args = parser.parse_args()
    cache = make_cache()
    store(cache, KEY_A, TOKENS)
    agent = NixlAgent.start("peer", cache.pools())
    assert agent is not None
    source = (DyingSource if args.die_after_lease else CacheBlockSource)(cache)
    app = web.Application(client_max_size=64 << 20)
    app.add_routes(peer_routes(source, SECRET))
    app.add_routes(lease_routes(source, SECRET,
                                agent.serving(),
                                LeaseTable(max_blocks=64, clock=time.monotonic)))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
