"""The fleet tier end to end: real `kvfleet replica` processes, a real `kvfleet router` process
and a real redis-server on loopback. A prefix stored on one replica is fetched by another over
T2 and the output equals recompute; faults (Redis stopped, a replica killed, stale hints) give
zero client errors and zero wrong outputs; tenants never share blocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from kvfleet_runtime.affinity import bounded_home_sets
from kvfleet_runtime.fleet import peer_token
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.wire import T2_PATH, TENANT_HEADER
from tests import credentials
from tests.runtime.fleet.conftest import RedisProcess
from tests.support import free_port

pytestmark = pytest.mark.slow

SECRET = "fleet-secret-under-test"
NAMES = ["r0", "r1", "r2"]
FIRST_HOMES = {t: homes[0] for t, homes in bounded_home_sets(("acme", "globex"), NAMES, 3).items()}
"""The router's first home per tenant: the tenants of its key file, planned whole on a fleet
this small, so the two tenants' first homes differ (plain rendezvous may rank one replica
first for both)."""
PROMPT = "The fleet tier moves block runs between replicas. " * 5  # 256 tokens: 15 usable blocks


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=30)


@dataclass
class Fleet:
    redis: RedisProcess
    replicas: dict[str, Proc]
    router: Proc
    procs: list[Proc] = field(default_factory=list)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if requests.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "kvfleet_runtime.cli", *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    model_dir = tmp / "tiny"
    generate_checkpoint(model_dir, ModelArgs.from_preset("tiny"), seed=0)
    redis = RedisProcess(free_port(), tmp)
    redis.start()
    procs: list[Proc] = []
    try:
        replicas: dict[str, Proc] = {}
        for name in NAMES:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = {
                **os.environ,
                **credentials.ENV,
                "KVFLEET_FLEET_NAME": name,
                "KVFLEET_PEER_URL": url,
                "KVFLEET_PEER_SECRET": SECRET,
                "KVFLEET_REDIS_URL": redis.url,
                "KVFLEET_REPLICA_CACHE__ADMIT_MIN_SIGHTINGS": "1",
                "KVFLEET_REPLICA_LIMITS__MAX_TOKENS": "32",
                # The shared CI box can be loaded far past its 2 cores: do not let a slow hint
                # lookup (a miss by design) turn into a flaky test.
                "KVFLEET_HINT_LOOKUP_BUDGET_S": "0.5",
            }
            popen = _spawn(
                [
                    "replica",
                    "--model-dir",
                    str(model_dir),
                    "--port",
                    str(port),
                    "--host",
                    "127.0.0.1",
                    "--model-id",
                    "tiny",
                    "--device",
                    "cpu",
                    "--log-level",
                    "WARNING",
                ],
                env,
                tmp / f"{name}.log",
            )
            replicas[name] = Proc(name, url, popen)
            credentials.NAME_BY_URL[url] = name
            procs.append(replicas[name])
        keys = tmp / "keys.yaml"
        keys.write_text(json.dumps({"tenants": {"acme": ["sk-acme"], "globex": ["sk-globex"]}}))
        port = free_port()
        router_args = [
            "router",
            "--keys",
            str(keys),
            "--port",
            str(port),
            "--redis-url",
            redis.url,
            "--recompute-s-per-token",
            "1e-3",
            "--poll-interval-s",
            "0.2",
            "--log-level",
            "WARNING",
        ]
        for name, proc in replicas.items():
            router_args += ["--replica", f"{name}={proc.url}"]
        router = Proc(
            "router",
            f"http://127.0.0.1:{port}",
            _spawn(router_args, {**os.environ, **credentials.ENV}, tmp / "router.log"),
        )
        procs.append(router)
        for proc in procs:
            _wait_ready(proc.url, proc.popen)
        yield Fleet(redis, replicas, router, procs)
    finally:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()


def complete(
    url: str, prompt: str, *, tenant: str | None = None, key: str | None = None, max_tokens: int = 8
) -> tuple[list[int], dict[str, str]]:
    # Straight to a replica: the test signs as the router does.
    headers = (credentials.as_router_to(tenant, url) if tenant
               else {"Authorization": f"Bearer {key}"})
    r = requests.post(
        url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], dict(r.headers)


def wait_for(pred: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def held_blocks(url: str) -> int:
    stats = requests.get(url + "/cache/stats", headers=credentials.OPERATOR, timeout=5).json()
    return int(stats["totals"]["num_blocks"])


def hinted_blocks(fleet: Fleet, host: str) -> int:
    """Blocks the hint index in Redis says `host` holds."""
    client = redis.Redis.from_url(fleet.redis.url)
    try:
        return sum(client.zscore(key, host) is not None
                   for key in client.scan_iter("kvfleet:k:*"))  # keyed: it has a router secret
    finally:
        client.close()


def test_prefix_stored_on_one_replica_is_fetched_by_another_and_equals_recompute(
    fleet: Fleet,
) -> None:
    a, b = fleet.replicas["r0"], fleet.replicas["r1"]
    recomputed, headers = complete(a.url, PROMPT, tenant="acme")
    assert headers["X-Kvfleet-Cached-Tokens"] == "0"
    wait_for(lambda: held_blocks(a.url) >= 15)
    wait_for(lambda: hinted_blocks(fleet, "r0") >= 15)  # published (batched, asynchronously)
    fetched, headers = complete(b.url, PROMPT, tenant="acme")
    assert int(headers["X-Kvfleet-Cached-Tokens"]) == 15 * 16
    assert headers["X-Kvfleet-Cache-Tier"] != "none"
    assert fetched == recomputed


def test_tenant_b_never_gets_tenant_a_blocks(fleet: Fleet) -> None:
    a, c = fleet.replicas["r0"], fleet.replicas["r2"]
    prompt = "secret of tenant a: " + PROMPT
    before = held_blocks(a.url)
    complete(a.url, prompt, tenant="acme")
    wait_for(lambda: held_blocks(a.url) >= before + 16)
    time.sleep(0.5)
    out_b, headers = complete(c.url, prompt, tenant="globex")
    assert headers["X-Kvfleet-Cached-Tokens"] == "0"  # nothing fetched, nothing shared
    out_a, _ = complete(a.url, prompt, tenant="acme")
    assert out_b == out_a  # same model, same tokens: same output, computed separately


def test_unauthenticated_peer_fetch_is_refused(fleet: Fleet) -> None:
    a = fleet.replicas["r0"]
    body = {
        "key": {
            "tenant_id": "acme",
            "model_id": "tiny",
            "weights_digest": "sha256:" + "0" * 64,
            "kv_dtype": "float32",
            "rope_config_hash": "x",
            "attn_impl_id": "x",
        },
        "token_ids": list(range(64)),
        "start_block": 0,
    }
    for headers in (
        {},
        {TENANT_HEADER: "acme", "Authorization": "Bearer nope"},
        {TENANT_HEADER: "acme", "Authorization": "Bearer " + peer_token(b"other-secret", "acme")},
    ):
        assert (
            requests.post(a.url + T2_PATH, json=body, headers=headers, timeout=5).status_code == 401
        )
    good = {
        TENANT_HEADER: "globex",
        "Authorization": "Bearer " + peer_token(SECRET.encode(), "globex"),
    }
    assert requests.post(a.url + T2_PATH, json=body, headers=good, timeout=5).status_code == 403


def test_router_lands_tenants_on_their_homes_and_reports_load(fleet: Fleet) -> None:
    for tenant in ("acme", "globex"):
        home = FIRST_HOMES[tenant]
        for _ in range(3):
            _, headers = complete(fleet.router.url, "hello " + tenant, key=f"sk-{tenant}")
            assert headers["X-Kvfleet-Replica"] == home
    load = requests.get(fleet.replicas["r0"].url + "/fleet/v1/load", timeout=5).json()
    assert load["cache_key"]["model_id"] == "tiny" and load["tokenizer"] == "byte-v1"


def test_faults_give_zero_client_errors_and_zero_wrong_outputs(fleet: Fleet) -> None:
    prompts = [f"{PROMPT} variant {i}" for i in range(4)]
    reference = {p: complete(fleet.replicas["r2"].url, p, tenant="refcheck")[0] for p in prompts}
    # Warm the tenant's home through the router.
    for p in prompts:
        out, _ = complete(fleet.router.url, p, key="sk-acme")
        assert out == reference[p]
    # Redis stops mid-run: hints are gone, routing and serving go on.
    fleet.redis.stop()
    for p in prompts:
        out, _ = complete(fleet.router.url, p, key="sk-acme")
        assert out == reference[p]
        out, _ = complete(fleet.replicas["r1"].url, p, tenant="acme")
        assert out == reference[p]
    fleet.redis.start()
    # Kill the tenant's first home: the router skips it; stale hints pointing at it only cost
    # a failed fetch; outputs stay right.
    home = FIRST_HOMES["acme"]
    fleet.replicas[home].kill()
    survivors = [n for n in NAMES if n != home]
    for p in prompts:
        out, headers = complete(fleet.router.url, p, key="sk-acme")
        assert out == reference[p] and headers["X-Kvfleet-Replica"] in survivors
        for name in survivors:
            out, _ = complete(fleet.replicas[name].url, p + " more", tenant="acme")
            assert out == complete(fleet.replicas[name].url, p + " more", tenant="refcheck")[0]
