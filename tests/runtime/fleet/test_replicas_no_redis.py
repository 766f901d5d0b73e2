"""The fleet tier without Redis: real `kvfleet replica` processes on loopback that know each other
only through a fleet config file (the replica list). Their hint index is the peer probe: a
replica that misses a prefix asks the others (`POST /kv/v1/held`) and fetches the longest run over
T2. A prefix stored on one replica is fetched by another and the output equals recompute; tenant
B learns nothing about tenant A's blocks, neither through a request nor through the probe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey, block_hashes
from kvfleet_runtime.fleet import peer_token
from kvfleet_runtime.fleet.t2_nixl import load_nixl
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.picker import prompt_token_ids
from kvfleet_runtime.wire import HELD_PATH, TENANT_HEADER, parse_load_report
from tests import credentials
from tests.runtime.fleet.test_replicas import PROMPT, _spawn, _wait_ready, complete, held_blocks
from tests.support import free_port

pytestmark = pytest.mark.slow

SECRET = "fleet-secret-no-redis"
NAMES = ["r0", "r1", "r2"]


@dataclass
class Replica:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path
    fleet_config: Path


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Replica]]:
    tmp = tmp_path_factory.mktemp("fleet-no-redis")
    model_dir = tmp / "tiny"
    generate_checkpoint(model_dir, ModelArgs.from_preset("tiny"), seed=0)
    ports = {name: free_port() for name in NAMES}
    fleet_config = tmp / "fleet.yaml"
    fleet_config.write_text(json.dumps({"replicas": [
        {"name": n, "url": f"http://127.0.0.1:{p}"} for n, p in ports.items()
    ]}))
    out: dict[str, Replica] = {}
    try:
        for name, port in ports.items():
            url = f"http://127.0.0.1:{port}"
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")},
                **credentials.ENV,
                "KVFLEET_FLEET_NAME": name,
                "KVFLEET_PEER_URL": url,
                "KVFLEET_PEER_SECRET": SECRET,
                "KVFLEET_FLEET_CONFIG": str(fleet_config),  # no KVFLEET_REDIS_URL
                "KVFLEET_REPLICA_CACHE__ADMIT_MIN_SIGHTINGS": "1",
                "KVFLEET_REPLICA_LIMITS__MAX_TOKENS": "32",
                # The shared CI box can be loaded far past its 2 cores: a probe slower than its
                # budget is a miss by design, which would make this test flaky.
                "KVFLEET_HINT_LOOKUP_BUDGET_S": "2.0",
            }
            args = ["replica", "--model-dir", str(model_dir), "--port", str(port), "--host",
                    "127.0.0.1", "--model-id", "tiny", "--device", "cpu", "--log-level", "WARNING"]
            out[name] = Replica(name, url, _spawn(args, env, tmp / f"{name}.log"),
                                tmp / f"{name}.log", fleet_config)
            credentials.NAME_BY_URL[url] = name
        for replica in out.values():
            _wait_ready(replica.url, replica.popen)
        yield out
    finally:
        for replica in out.values():
            if replica.popen.poll() is None:
                replica.popen.send_signal(signal.SIGTERM)
        for replica in out.values():
            try:
                replica.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.popen.kill()
                replica.popen.wait(timeout=30)


def chain(url: str, tenant: str, prompt: str) -> list[str]:
    """The prompt's usable chain (hex), as the replicas compute it (the key from the load
    report, the byte tokenizer, the last prompt token left to the engine)."""
    report = parse_load_report(requests.get(url + "/fleet/v1/load", timeout=5).json())
    tokens = prompt_token_ids(prompt, report.tokenizer)
    assert report.cache_key is not None and tokens is not None
    key = CacheKey(tenant, *report.cache_key)
    usable = (len(tokens) - 1) // BLOCK_SIZE
    return [h.hex() for h in block_hashes(key, tokens[: usable * BLOCK_SIZE])]


def held(url: str, tenant: str, hashes: list[str], *, as_tenant: str | None = None) -> int:
    """Ask a replica's held probe, with a valid credential for `as_tenant` (default `tenant`)."""
    who = as_tenant or tenant
    r = requests.post(
        url + HELD_PATH,
        json={"block_hashes": hashes},
        headers={TENANT_HEADER: who, "Authorization": "Bearer " + peer_token(SECRET.encode(), who)},
        timeout=5,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["leading_blocks"])


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def t2(url: str) -> dict[str, Any]:
    report = requests.get(url + "/fleet/v1/load", timeout=5).json()
    return dict(report["t2"])


def test_prefix_stored_on_a_is_fetched_by_b_without_redis_and_equals_recompute(
    replicas: dict[str, Replica],
) -> None:
    a, b = replicas["r0"], replicas["r1"]
    assert t2(b.url)["hint_index"] == "peer-probe"
    hashes = chain(a.url, "acme", PROMPT)
    assert len(hashes) == 15
    recomputed, headers = complete(a.url, PROMPT, tenant="acme")
    assert headers["X-Kvfleet-Cached-Tokens"] == "0"
    wait_for(lambda: held(a.url, "acme", hashes) == 15, "r0 to hold the prefix")
    fetched, headers = complete(b.url, PROMPT, tenant="acme")
    assert int(headers["X-Kvfleet-Cached-Tokens"]) == 15 * 16
    assert fetched == recomputed
    stats = t2(b.url)
    assert stats["fetches"] == {"ok": 1} and stats["blocks_fetched"] == 15
    # Where NIXL is installed, both replicas have an agent and the run went over it (a lease,
    # a one-sided READ into b's engine blocks); without, over HTTP.
    assert stats["nixl"] is (load_nixl() is not None)
    assert stats["blocks_fetched_over_nixl"] == (15 if stats["nixl"] else 0)
    # And now b holds it too.
    assert held(b.url, "acme", hashes) == 15


def test_tenant_b_learns_nothing_about_tenant_a_blocks(replicas: dict[str, Replica]) -> None:
    a, c = replicas["r0"], replicas["r2"]
    prompt = "secret of tenant a, no redis: " + PROMPT
    hashes_a = chain(a.url, "acme", prompt)
    hashes_b = chain(a.url, "globex", prompt)
    assert not set(hashes_a) & set(hashes_b)
    before = held_blocks(a.url)
    out_a, _ = complete(a.url, prompt, tenant="acme")
    wait_for(lambda: held(a.url, "acme", hashes_a) == len(hashes_a), "r0 to hold the prefix")
    assert held_blocks(a.url) > before
    # The probe, with tenant B's valid credential: neither B's chain nor A's exact hashes count.
    assert held(a.url, "globex", hashes_b) == 0
    assert held(a.url, "acme", hashes_a, as_tenant="globex") == 0
    # A request as tenant B on another replica: nothing found, nothing fetched, same output.
    fetches_before = t2(c.url)["fetches"]
    out_b, headers = complete(c.url, prompt, tenant="globex")
    assert headers["X-Kvfleet-Cached-Tokens"] == "0"
    assert out_b == out_a
    assert t2(c.url)["fetches"].get("ok", 0) == fetches_before.get("ok", 0)


def test_a_dead_peer_costs_nothing_but_its_blocks(replicas: dict[str, Replica]) -> None:
    """Kill the replica that holds a prefix: the others recompute it, same output, no error."""
    a, b, c = replicas["r0"], replicas["r1"], replicas["r2"]
    prompt = "held only by a replica about to die: " + PROMPT
    hashes = chain(c.url, "acme", prompt)
    reference, _ = complete(c.url, prompt, tenant="acme")
    wait_for(lambda: held(c.url, "acme", hashes) == len(hashes), "r2 to hold the prefix")
    c.popen.send_signal(signal.SIGKILL)
    c.popen.wait(timeout=30)
    out, headers = complete(a.url, prompt, tenant="acme")  # its only holder is gone
    assert out == reference and headers["X-Kvfleet-Cached-Tokens"] == "0"
    out, _ = complete(b.url, prompt, tenant="acme")  # recomputed, or fetched from r0 by now
    assert out == reference


def test_a_hostile_fleet_config_is_refused_in_one_line_and_the_next_valid_one_applies(
    replicas: dict[str, Replica]
) -> None:
    # Fails before issue 25: the deep file's RecursionError kills the fleet tier's watcher (the
    # next valid file, here generation 7, is never applied) and nothing says why.
    r0 = replicas["r0"]
    good = r0.fleet_config.read_text()
    deep = "replicas: " + "[" * 5000 + "]" * 5000 + "\n"

    def readyz() -> dict[str, Any]:
        return dict(requests.get(r0.url + "/readyz", timeout=5).json())

    def generation() -> Any:
        return requests.get(r0.url + "/fleet/v1/load", timeout=5).json()["tiers"]["generation"]

    try:
        r0.fleet_config.write_text(deep)
        wait_for(lambda: "fleet" in readyz()["config_errors"], "the refusal")
        reason = readyz()["config_errors"]["fleet"]
        assert "nests deeper than 32 levels" in reason and "\n" not in reason
        lines = [line for line in r0.log.read_text().splitlines()
                 if "fleet config rejected" in line]
        assert len(lines) == 1 and len(lines[0]) < 1000
        assert complete(r0.url, PROMPT, tenant="acme")[0]  # still serving, on the last good config
        r0.fleet_config.write_text(json.dumps({**json.loads(good), "generation": 7}))
        wait_for(lambda: generation() == 7, "the next valid file")
        assert readyz()["config_errors"] == {}
    finally:
        r0.fleet_config.write_text(json.dumps({**json.loads(good), "generation": 8}))
