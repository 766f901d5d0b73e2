"""Routing from vLLM's own KV events: two serving vLLM replicas WITHOUT kvfleet's connector
(nothing publishes hints; what A holds lives only in A's own prefix cache) publish their KV
events (`--kv-events-config`, ZMQ), and kvfleet's router (router secret set) subscribes
(`--kv-events`). After A computed a prompt, acme's home moves to B: the same prompt still goes
to A (route `warm`, a local prefix hit there), a new prompt goes to B, another tenant's
request of A's prompt is not drawn to A (its salt roots another chain), and after A's prefix
cache is reset (`AllBlocksCleared`, published with A's next step) the router forgets A's
blocks and affinity decides.

Three processes (two vLLM servers, one router), started at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from tests.support import BY_SOURCE, counter

from .conftest import MODEL, VllmServe, free_port, start_all, stop_all
from .test_serve import prompt, settled

SECRET = "router-secret-vllm-kv-events-tests"
KEYS = {"acme": "sk-acme", "globex": "sk-globex"}
PROBE = [1, 2, 3, 4]
"""A prompt of no full block: it lands in no prefix cache and no event."""


@dataclass
class World:
    a: VllmServe
    b: VllmServe
    router_url: str
    router_config: Path
    generation: int = 0

    def home(self, **homes: str) -> None:
        """Pin each tenant's home to one replica (the operator's `home_sets`), a new
        generation."""
        self.generation += 1
        self.router_config.write_text(dump_fleet_config(FleetConfig(
            generation=self.generation, recompute_s_per_token=1e-3,
            replicas=tuple(ReplicaEndpoint(name=s.name, url=s.url, engine="vllm")
                           for s in (self.a, self.b)),
            # One home each (k = 1): a tenant's prefixes are spread over all of its homes, and
            # a shorter published set is filled up to k with the tenant's next rendezvous choices.
            affinity=AffinitySettings(k=1),
            home_sets={tenant: (name,) for tenant, name in homes.items()})))

    def send(self, tenant: str, tokens: list[int]) -> tuple[str | None, str | None]:
        """(replica, route) of one completion through the router."""
        client = openai.OpenAI(base_url=self.router_url + "/v1", api_key=KEYS[tenant],
                               max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=tokens, max_tokens=4, temperature=0)
        return raw.headers.get("x-kvfleet-replica"), raw.headers.get("x-kvfleet-route")

    def wait_home(self, tenant: str, name: str) -> None:
        """Until the router sends `tenant`'s probes to `name` (it reloads its config within
        a second or so)."""
        for _ in range(120):
            try:
                if self.send(tenant, PROBE)[0] == name:
                    return
            except openai.APIStatusError as exc:
                if exc.status_code != 503:  # not seen healthy yet
                    raise
            time.sleep(0.5)
        raise AssertionError(f"the router never sent {tenant} to {name}")


@pytest.fixture(scope="module")
def world(serve_model: Path, serve_dir: Path) -> Iterator[World]:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}

    def replica(name: str) -> tuple[VllmServe, str]:
        # vLLM binds an ipc:// endpoint (a tcp:// one only as tcp://*:PORT, every interface)
        endpoint = f"ipc://{serve_dir / f'events-{name}.sock'}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
        return VllmServe(name, serve_model, serve_dir / f"events-{name}.log",
                         args=["--kv-events-config", json.dumps(events)],
                         env={**base_env, "VLLM_SERVER_DEV_MODE": "1"}), endpoint

    (a, a_events), (b, b_events) = replica("a"), replica("b")
    keys = serve_dir / "events-keys.json"
    keys.write_text(json.dumps({"tenants": {t: [k] for t, k in KEYS.items()}}))
    router_port = free_port()
    w = World(a, b, f"http://127.0.0.1:{router_port}", serve_dir / "events-router.json")
    w.home(acme="a", globex="b")
    with (serve_dir / "events-router.log").open("wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_runtime.cli", "router", "--keys", str(keys),
             "--fleet-config", str(w.router_config), "--port", str(router_port),
             "--poll-interval-s", "0.5", "--log-level", "INFO",
             "--kv-events", f"a={a_events}", "--kv-events", f"b={b_events}"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**base_env, "KVFLEET_ROUTER_SECRET": SECRET})
    try:
        start_all([a, b])
        yield w
    finally:
        router.terminate()
        router.wait(timeout=30)
        stop_all([a, b])


def local_hits(server: VllmServe) -> float:
    return counter(settled(server), BY_SOURCE, source="local_cache_hit")


def computed_on_a(w: World, tokens: list[int]) -> None:
    w.home(acme="a", globex="b")
    w.wait_home("acme", "a")
    assert w.send("acme", tokens) == ("a", "home")
    time.sleep(1.0)  # the events of A's step reach the router
    w.home(acme="b", globex="b")
    w.wait_home("acme", "b")


def test_a_prefix_held_only_in_as_own_cache_draws_the_request_to_a(world: World) -> None:
    p = prompt(21, 601)
    computed_on_a(world, p)
    before = local_hits(world.a)
    assert world.send("acme", p) == ("a", "warm")  # affinity alone says b
    assert local_hits(world.a) - before == 512  # A's own prefix cache answered it
    assert world.send("acme", prompt(22, 601)) == ("b", "home")  # nobody holds this one
    # globex's request of the same tokens: its salt roots another chain (and vLLM's own
    # cache keeps the tenants apart the same way)
    assert world.send("globex", p) == ("b", "home")


def test_a_reset_prefix_cache_drops_as_view(world: World) -> None:
    p = prompt(23, 601)
    computed_on_a(world, p)
    world.a.post("/reset_prefix_cache")
    # vLLM publishes its queued events (the clear) with its next step
    world.a.post("/v1/completions", {"model": MODEL, "prompt": PROBE, "max_tokens": 1})
    time.sleep(1.0)
    assert world.send("acme", p) == ("b", "home")
