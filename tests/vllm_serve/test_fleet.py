"""Two serving vLLM replicas share KV over T2 behind kvfleet's router (router secret set): a prefix
computed on A is fetched by B on B's first request of it, through a password-protected Redis
(a real redis-server, the hint index) and through the peer probe (B's fleet config names A);
and a byte flipped in transit: vLLM recomputes, no request fails and the text equals A's.

The probe path reaches A's peer server through a loopback proxy (`Proxy`), the one part that is
not real: it injects the corruption."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import openai

from kvfleet_runtime.config.fleet import (
    AffinitySettings,
    FleetConfig,
    ReplicaEndpoint,
    dump_fleet_config,
)
from tests.runtime.fleet.conftest import REDIS_SERVER, RedisProcess
from tests.support import BY_SOURCE, MATCHED, counter

from .conftest import (
    MODEL,
    VllmServe,
    connector_config,
    free_port,
    start_all,
    stop_all,
)
from .test_serve import prompt, settled

SECRET = "router-secret-vllm-fleet-tests"
PEER_SECRET = "peer-secret-vllm-fleet-tests"
REDIS_PASSWORD = "redis-password-vllm-fleet-tests"
FETCHED = "kvfleet_cache_fetched_blocks_total"
STORED = "kvfleet_cache_stored_blocks_total"
HINT_BUDGET_S = "2.0"
"""The hint lookup's budget: the defaults (2 ms for Redis, 50 ms for the peer probe) are for a
pod; a box at load average 15 answers a held probe slower, and the lookup would say "nobody"."""


class Proxy:
    """TCP proxy on loopback in front of A's peer server, in a thread of its own. `mode`:
    "pass" forwards; "flip" flips the byte 2,500 bytes into what a connection answers after the
    mode was set (headers and held-probe answers are shorter: only a block stream is hit);
    "cut" forwards those 2,500 bytes and then closes both sides, as a peer that dies while it
    sends a block stream."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._mode = "pass"
        self._epoch = 0
        self.num_cut = 0
        """Connections "cut" closed mid-answer."""
        self.port = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        """A kept-alive connection from an earlier mode counts its bytes afresh from here."""
        self._mode = mode
        self._epoch += 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        async def upstream() -> None:
            while data := await reader.read(1 << 16):
                up_w.write(data)
                await up_w.drain()

        task = asyncio.ensure_future(upstream())
        seen = 0
        epoch = self._epoch
        try:
            while data := await up_r.read(1 << 16):
                mode = self._mode
                if epoch != self._epoch:
                    seen, epoch = 0, self._epoch
                if mode == "flip" and seen <= 2500 < seen + len(data):
                    data = bytearray(data)
                    data[2500 - seen] ^= 0xFF
                if mode == "cut" and seen + len(data) > 2500:
                    writer.write(bytes(data[:max(0, 2500 - seen)]))
                    await writer.drain()
                    self.num_cut += 1
                    break
                seen += len(data)
                writer.write(bytes(data))
                await writer.drain()
        except OSError:
            pass
        finally:
            task.cancel()
            writer.close()
            up_w.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@dataclass
class Fleet:
    a: VllmServe
    b_redis: VllmServe
    """Finds A's blocks in Redis."""
    b_probe: VllmServe
    """Finds A's blocks by asking A's held probe (its fleet config names A, through `proxy`)."""
    proxy: Proxy
    router_url: str
    router_config: Path
    generation: int = 0

    def home(self, name: str) -> None:
        """Pin acme's home to one replica (the operator's `home_sets`), a new generation."""
        self.generation += 1
        self.router_config.write_text(dump_fleet_config(FleetConfig(
            generation=self.generation, replicas=tuple(
                ReplicaEndpoint(name=s.name, url=s.url, engine="vllm")
                for s in (self.a, self.b_redis, self.b_probe)),
            # One home (k = 1): a tenant's prefixes are spread over all of its homes, and a
            # shorter published set is filled up to k with the tenant's next rendezvous choices.
            affinity=AffinitySettings(k=1), home_sets={"acme": (name,)})))


@pytest.fixture(scope="module")
def fleet(serve_model: Path, serve_dir: Path) -> Iterator[Fleet]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    secret_file = serve_dir / "router-secret"
    secret_file.write_text(SECRET + "\n")
    redis = RedisProcess(free_port(), serve_dir, password=REDIS_PASSWORD)
    redis.start()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}

    def replica(name: str, **env: str) -> VllmServe:
        peer_port = free_port()
        s = VllmServe(name, serve_model, serve_dir / f"{name}.log", args=[
            "--kv-transfer-config", connector_config(
                serve_dir / f"{name}.pool", salt_secret_file=str(secret_file),
                peer_port=peer_port, peer_host="127.0.0.1")],
            env={**base_env, "KVFLEET_FLEET_NAME": name, "KVFLEET_PEER_SECRET": PEER_SECRET,
                 "KVFLEET_PEER_URL": f"http://127.0.0.1:{peer_port}",
                 "KVFLEET_HINT_LOOKUP_BUDGET_S": HINT_BUDGET_S, **env})
        s.peer_port = peer_port
        return s

    a = replica("a", KVFLEET_REDIS_URL=redis.url)
    proxy = Proxy(a.peer_port)
    probe_config = serve_dir / "fleet-b-probe.json"
    probe_config.write_text(dump_fleet_config(FleetConfig(replicas=(
        ReplicaEndpoint(name="a", url=a.url, engine="vllm",
                        peer_url=f"http://127.0.0.1:{proxy.port}"),))))
    b_redis = replica("b-redis", KVFLEET_REDIS_URL=redis.url)
    b_probe = replica("b-probe", KVFLEET_FLEET_CONFIG=str(probe_config))
    servers = [a, b_redis, b_probe]
    keys = serve_dir / "fleet-keys.json"
    keys.write_text(json.dumps({"tenants": {"acme": ["sk-acme"]}}))
    router_port = free_port()
    f = Fleet(a, b_redis, b_probe, proxy, f"http://127.0.0.1:{router_port}",
              serve_dir / "fleet-router.json")
    f.home("a")
    with (serve_dir / "fleet-router.log").open("wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_runtime.cli", "router", "--keys", str(keys),
             "--fleet-config", str(f.router_config), "--port", str(router_port),
             "--poll-interval-s", "0.5", "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT, env={**base_env, "KVFLEET_ROUTER_SECRET": SECRET})
    try:
        start_all(servers)
        yield f
    finally:
        router.terminate()
        router.wait(timeout=30)
        stop_all(servers)
        proxy.close()
        redis.stop()


def send(fleet: Fleet, to: VllmServe, tokens: list[int]) -> str:
    """acme's completion through the router, once the router sends acme to `to`. The router
    reloads its fleet config within a second or so; until it does, a short probe (no full block
    in any cache) is sent instead of `tokens`, so no other replica ever computes them (a
    discarded answer from the old home would sit in its prefix cache, and the next test's
    "first request" there would be a local hit)."""
    client = openai.OpenAI(base_url=fleet.router_url + "/v1", api_key="sk-acme", max_retries=0,
                           timeout=120)

    def served_by(prompt_tokens: list[int], max_tokens: int) -> tuple[str | None, str]:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt_tokens, max_tokens=max_tokens, temperature=0)
        return raw.headers.get("x-kvfleet-replica"), raw.parse().choices[0].text

    for _ in range(60):
        try:
            replica, _ = served_by([1, 2, 3, 4], 1)
        except openai.APIStatusError as exc:
            if exc.status_code != 503:  # the router has not seen the replica healthy yet
                raise
            replica = None
        if replica == to.name:
            replica, text = served_by(tokens, 8)
            assert replica == to.name, f"the router moved acme from {to.name} to {replica}"
            return text
        time.sleep(0.5)
    raise AssertionError(f"the router never sent acme to {to.name}")


@dataclass
class Took:
    matched: float
    """kvfleet's matched tokens for acme on B."""
    external: float
    """vLLM's prompt tokens B loaded through the connector."""
    local: float
    """vLLM's prompt tokens from B's own prefix cache."""
    fetched: float
    """Blocks B fetched from a peer."""


def took(before: dict[str, float], after: dict[str, float]) -> Took:
    def d(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    return Took(d(MATCHED, tenant="acme"), d(BY_SOURCE, source="external_kv_transfer"),
                d(BY_SOURCE, source="local_cache_hit"), d(FETCHED))


def computed_on_a(fleet: Fleet, tokens: list[int]) -> str:
    """A's text for `tokens`, once A has stored them (its hints follow the stored step)."""
    fleet.home("a")
    stored = counter(fleet.a.metrics(), STORED)
    want = send(fleet, fleet.a, tokens)
    for _ in range(50):
        if counter(settled(fleet.a), STORED) > stored:
            break
    time.sleep(1.0)  # the T2 thread publishes the hints after the workers report the save
    return want


def fetched(fleet: Fleet, b: VllmServe, seed: int) -> tuple[str, str, Took]:
    """A computes a prompt; then B's first request of it: (A's text, B's text, B's counters)."""
    p = prompt(seed, 601)
    want = computed_on_a(fleet, p)
    fleet.home(b.name)
    before = settled(b)
    got = send(fleet, b, p)
    return want, got, took(before, settled(b))


def test_b_fetches_what_a_computed_through_redis(fleet: Fleet) -> None:
    want, got, d = fetched(fleet, fleet.b_redis, seed=11)
    assert got == want
    assert d.external == d.matched == 512 and d.local == 0
    assert d.fetched >= 32  # 600 // 16 blocks held by A; B loads the 512 tokens vLLM can use


def test_b_fetches_what_a_computed_through_the_peer_probe(fleet: Fleet) -> None:
    fleet.proxy.mode = "pass"
    want, got, d = fetched(fleet, fleet.b_probe, seed=12)
    assert got == want
    assert d.external == d.matched == 512 and d.fetched >= 32


def test_a_block_corrupted_in_transit_is_recomputed(fleet: Fleet) -> None:
    fleet.proxy.mode = "flip"
    try:
        want, got, d = fetched(fleet, fleet.b_probe, seed=13)
    finally:
        fleet.proxy.mode = "pass"
    assert got == want
    assert d == Took(0, 0, 0, 0)


def test_a_peer_gone_mid_fetch_is_recomputed(fleet: Fleet) -> None:
    fleet.proxy.mode = "cut"
    cut = fleet.proxy.num_cut
    try:
        want, got, d = fetched(fleet, fleet.b_probe, seed=14)
    finally:
        fleet.proxy.mode = "pass"
    assert fleet.proxy.num_cut > cut  # B's fetch started and A's stream stopped mid-block
    assert got == want
    assert d == Took(0, 0, 0, 0)


def test_a_killed_peer_is_recomputed(fleet: Fleet) -> None:
    """Last in the module: A is gone for good. Redis still names A for the prompt's blocks."""
    p = prompt(15, 601)
    want = computed_on_a(fleet, p)
    assert fleet.a.proc is not None
    os.killpg(fleet.a.proc.pid, signal.SIGKILL)
    fleet.a.proc.wait(timeout=60)
    fleet.home(fleet.b_redis.name)
    before = settled(fleet.b_redis)
    got = send(fleet, fleet.b_redis, p)
    d = took(before, settled(fleet.b_redis))
    assert got == want
    assert d == Took(0, 0, 0, 0)
