"""The router's ZMQ subscriber (`picker._kv_subscriber`) against a real ZMQ PUB socket on
loopback speaking vLLM's framing `(topic, seq, payload)`: events reach the view, a sequence
gap, a restart (a new publisher counting from 0), a bad payload and a lost connection drop it,
and replicas leaving the endpoint map are forgotten. (tests/vllm/test_kv_events.py drives the
same subscriber with vLLM's own publisher.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from kvfleet_runtime.picker._kv_events import KvEventViews, prompt_hashes
from kvfleet_runtime.picker._kv_subscriber import KvEventSubscriber
from tests.support import free_port

SALT = "acme.0123"
P = list(range(64))


def stored(h: int, parent: int | None, tokens: list[int]) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": tokens, "block_size": len(tokens), "medium": "GPU",
            "extra_keys": [[SALT] if parent is None else None], "group_idx": 0}


class Publisher:
    """A PUB socket bound on loopback, as vLLM binds `tcp://*:PORT`."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], where: int | str) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.bind(f"tcp://127.0.0.1:{where}" if isinstance(where, int) else where)
        self.seq = 0

    def send(self, *events: dict[str, object], seq: int | None = None,
             payload: bytes | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        body = payload if payload is not None else msgspec.msgpack.encode([0.0, list(events)])
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), body])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def held(views: KvEventViews, name: str) -> int:
    v = views.views.get(name)
    return 0 if v is None else v.matched_blocks(prompt_hashes(SALT, P)) * 16


@pytest.mark.asyncio
async def test_events_gaps_restarts_and_disconnects() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    port = free_port()
    pub = Publisher(ctx, port)
    views = KvEventViews()
    endpoints = {"a": f"tcp://127.0.0.1:{port}"}
    sub = KvEventSubscriber(views, lambda: dict(endpoints), resync_s=0.05)
    task = asyncio.create_task(sub.run())
    try:
        # subscribed once the first (empty) batch arrives: PUB drops what comes before
        async def joined() -> None:
            for _ in range(200):
                pub.send(seq=0)
                await asyncio.sleep(0.05)
                v = views.views.get("a")
                if v is not None and v.last_seq == 0:
                    return
            raise AssertionError("never subscribed")

        await joined()
        pub.send(stored(10, None, P[:32]), seq=1)
        pub.send(stored(11, 10, P[32:]))
        await until(lambda: held(views, "a") == 64)
        view = views.views["a"]

        pub.send(seq=5)  # 3 and 4 were lost
        await until(lambda: view.drops["gap"] == 1)
        assert held(views, "a") == 0

        pub.send(stored(10, None, P[:32]), seq=6)
        await until(lambda: held(views, "a") == 32)
        pub.send(payload=b"\x93not msgpack")
        await until(lambda: view.drops["malformed"] == 1)
        assert held(views, "a") == 0

        # a restart: the replica's publisher is gone, a new one counts from 0 again
        pub.send(stored(10, None, P[:32]))
        await until(lambda: held(views, "a") == 32)
        pub.close()
        await until(lambda: view.drops["disconnected"] == 1)
        assert held(views, "a") == 0
        pub = Publisher(ctx, port)
        await joined()
        pub.send(stored(20, None, P[:32]), seq=1)
        await until(lambda: held(views, "a") == 32)

        endpoints.clear()  # the replica left the fleet
        await until(lambda: "a" not in views.views)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pub.close()
        ctx.destroy(linger=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_a_publisher_of_another_user_is_not_listened_to(
    transport: str, tmp_path: Path
) -> None:
    """The laptop-mode impersonation of issue 44: a local process that bound a replica's
    endpoint first. Its owner is checked at each connection (the kernel's peer credentials on
    ipc, /proc/net/tcp on loopback); here the publisher is ours and the subscriber expects
    another uid, so nothing it sends reaches the view. With the right uid the same events do."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    url = (f"tcp://127.0.0.1:{free_port()}" if transport == "tcp"
           else f"ipc://{tmp_path}/kv-events.sock")
    pub = Publisher(ctx, url)
    tasks = []
    try:
        for expected, name in ((os.getuid() + 1, "impostor"), (os.getuid(), "ours")):
            views = KvEventViews()
            sub = KvEventSubscriber(views, lambda name=name: {name: url}, resync_s=0.05,
                                    peer_uid=expected)
            tasks.append(asyncio.create_task(sub.run()))
            for _ in range(40):
                pub.send(stored(10, None, P[:32]), seq=0)
                await asyncio.sleep(0.05)
                if held(views, name) or sub.num_refused:
                    break
            if name == "impostor":
                await until(lambda sub=sub: sub.num_refused >= 1)
                for _ in range(5):
                    pub.send(stored(10, None, P[:32]), seq=0)
                    await asyncio.sleep(0.05)
                assert held(views, name) == 0
            else:
                await until(lambda views=views, name=name: held(views, name) == 32)
                assert sub.num_refused == 0
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pub.close()
        ctx.destroy(linger=0)
