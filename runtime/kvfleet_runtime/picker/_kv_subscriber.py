"""The router's subscriptions to vLLM replicas' KV event streams (ZMQ SUB): a thin shell over
`_kv_events` (decoding, sequence checks and the views are there).

One SUB socket per replica, connected to the endpoint its `vllm serve --kv-events-config`
publishes on (`"publisher": "zmq", "endpoint": "tcp://*:PORT"`): `--kv-events NAME=tcp://host:
port` names one, `--kv-events-port PORT` every vLLM replica of the fleet config at its URL's
host. The endpoints are re-read every `resync_s`, so replicas that join or leave the fleet
config are subscribed and forgotten. A socket monitor drops a replica's view when its
connection goes away (a restarted replica may come back with a sequence that happens to go
on): until events rebuild it, that replica matches nothing and affinity decides.

Each connection is checked when it is made (`_kv_peer.peer_refusal`: on this host its other end
must be a process of `peer_uid`, the router's own user unless told otherwise): a local process
of another user that bound a replica's port first is not listened to.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvfleet_runtime.background import Supervisor
from kvfleet_runtime.picker._kv_events import (
    KvEventError,
    KvEventViews,
    decode_batch,
    decode_seq,
)
from kvfleet_runtime.picker._kv_peer import peer_refusal

__all__ = ["TOPIC", "KvEventSubscriber"]

log = logging.getLogger(__name__)

TOPIC = ""
"""The topic subscribed to (a prefix: "" takes every message), vLLM's `KVEventsConfig.topic`
default; the chart's `--kv-events-config` publishes on it."""
RCVHWM = 100_000
"""vLLM's own publisher default (`KVEventsConfig.hwm`): messages past it are dropped, and the
sequence gap drops the view."""


class KvEventSubscriber:
    """Keeps `views` up to date from the endpoints `endpoints()` names (name -> ZMQ URL)."""

    def __init__(self, views: KvEventViews, endpoints: Callable[[], dict[str, str]], *,
                 resync_s: float = 1.0, supervisor: Supervisor | None = None,
                 peer_uid: int | None = None) -> None:
        self.views = views
        self.peer_uid = os.getuid() if peer_uid is None else peer_uid
        """The user a replica's publisher must run as when it is on this host."""
        self.num_refused = 0
        """Connections whose other end was not `peer_uid`'s (their events were not applied)."""
        self.endpoints = endpoints
        self.resync_s = resync_s
        self.supervisor = Supervisor() if supervisor is None else supervisor
        """Runs one subscription loop per replica (the router's: one that dies is restarted)."""
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}

    async def run(self) -> None:
        if self._ctx.closed:  # a restart (the supervisor's) after the previous run ended
            self._ctx = zmq.asyncio.Context()
        try:
            while True:
                self._resync()
                await asyncio.sleep(self.resync_s)
        finally:
            for _, task in self._tasks.values():
                task.cancel()
            for _, task in self._tasks.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks.clear()
            self._ctx.destroy(linger=0)

    def _resync(self) -> None:
        want = self.endpoints()
        for name in [n for n, (url, _) in self._tasks.items() if want.get(n) != url]:
            _, task = self._tasks.pop(name)
            task.cancel()
            self.views.forget([name])
        for name, url in want.items():
            if name not in self._tasks:
                self._tasks[name] = (url, self.supervisor.start(
                    f"kv-events-{name}", functools.partial(self._follow, name, url)))

    async def _follow(self, name: str, url: str) -> None:
        view = self.views.view(name)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        trusted = False
        refused: set[str] = set()
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sub.connect(url)
            log.info("KV events of %s: subscribed to %s", name, url)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_CONNECTED:
                        reason = peer_refusal(int(event["value"]), self.peer_uid)
                        trusted = reason is None
                        if reason is not None:
                            self.num_refused += 1
                            if reason not in refused:  # one line per endpoint and reason
                                refused.add(reason)
                                log.warning("KV events of %s: %s refused: %s, not uid %d; its "
                                            "events are ignored", name, url, reason,
                                            self.peer_uid)
                    else:
                        trusted = False
                        log.info("KV events of %s: disconnected; its view is dropped", name)
                        view.disconnected()
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if trusted:
                        self._apply(name, frames)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _apply(self, name: str, frames: list[bytes]) -> None:
        view = self.views.view(name)
        seq: int | None = None
        try:
            if len(frames) != 3:
                raise KvEventError(f"{len(frames)} frames, expected 3 (topic, seq, payload)")
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except KvEventError as exc:
            if not view.drops["malformed"]:
                log.warning("KV events of %s: %s; its view is dropped", name, exc)
            view.malformed(seq)
            return
        last, gaps = view.last_seq, view.drops["gap"] + view.drops["restart"]
        view.apply(seq, batch)
        if view.drops["gap"] + view.drops["restart"] > gaps:
            log.info("KV events of %s: sequence %d after %s; its view is dropped", name, seq,
                     last)
