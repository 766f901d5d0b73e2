"""Every tier toggle of the fleet config reaches running `kvfleet replica` processes within ONE
config poll (counted by the replicas' own poll counters, not by a clock), with no restart and no
lost request: T0 off drains the engine's KV into T1 and stores go to T1, on again caches in place;
T1 off drains T1; T2 off stops both fetching from peers and serving them; NVMe on serves what T1
evicted from a real file, shadow reads it back without serving, off forgets it. Outputs always
equal recompute."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from kvfleet_runtime.fleet import peer_token
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.wire import HELD_PATH, TENANT_HEADER
from tests import credentials
from tests.runtime.fleet.test_replicas import PROMPT, _spawn, _wait_ready, complete
from tests.runtime.fleet.test_replicas_no_redis import chain
from tests.support import free_port

pytestmark = pytest.mark.slow

SECRET = "fleet-secret-toggles"
POLL_S = 2.0  # FleetSettings.config_poll_s; a change is applied at the first poll that sees it
APPLY_TIMEOUT_S = 2 * POLL_S + 20  # + slack for a loaded 2-core box (a bound, not an assertion)


@dataclass
class Replica:
    name: str
    url: str
    popen: subprocess.Popen[bytes]


@dataclass
class Fleet:
    replicas: dict[str, Replica]
    config: Path
    ports: dict[str, int]
    generation: int = 0
    polls_after_write: dict[str, int] = field(default_factory=dict)

    def publish(self, **tiers: bool) -> int:
        """Write a new fleet config (the operator's ConfigMap) with these tier toggles (T0 off
        unless given: then every stored prompt lands in T1, the tier the other toggles drain,
        serve to peers and evict into T3)."""
        self.generation += 1
        self.config.write_text(json.dumps({
            "generation": self.generation,
            "tiers": {"t0_device": False, **tiers},
            "replicas": [
                {"name": n, "url": f"http://127.0.0.1:{p}"} for n, p in self.ports.items()
            ],
        }))
        # Polls that start after this read see the new file; the one in flight may not have.
        self.polls_after_write = {
            name: int(load(r.url)["tiers"]["config_polls"]) for name, r in self.replicas.items()
        }
        return self.generation

    def applied(self, name: str, generation: int) -> dict[str, Any]:
        """Wait until replica `name` reports the config `generation` in force, and check that it
        was applied within one poll of the write; its load report."""
        url = self.replicas[name].url
        deadline = time.monotonic() + APPLY_TIMEOUT_S
        while True:
            report = load(url)
            if report["tiers"]["generation"] == generation:
                break
            assert time.monotonic() < deadline, f"{name} did not apply generation {generation}"
            time.sleep(0.1)
        polls = self.polls_after_write.get(name)
        if polls is not None:  # the first poll that surely saw the file applied it
            assert report["tiers"]["applied_at_poll"] <= polls + 1, (report["tiers"], polls)
        return report


def load(url: str) -> dict[str, Any]:
    return dict(requests.get(url + "/fleet/v1/load", timeout=10).json())


def tier_used(url: str, tier: str) -> int:
    stats = requests.get(url + "/cache/stats", headers=credentials.OPERATOR, timeout=10).json()
    return int(next(t["num_blocks_used"] for t in stats["tiers"] if t["tier"] == tier))


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def prompt(i: int) -> str:
    """A distinct 15-usable-block prompt per i (its first block differs)."""
    return f"[{i:04d}] " + PROMPT[7:]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("toggles")
    model_dir = tmp / "tiny"
    generate_checkpoint(model_dir, ModelArgs.from_preset("tiny"), seed=0)
    ports = {"r0": free_port(), "r1": free_port()}
    f = Fleet({}, tmp / "fleet.yaml", ports)
    f.publish(t1_host=True, t2_peer=True, nvme=False, nvme_shadow=False)
    (tmp / "nvme").mkdir()
    try:
        for name, port in ports.items():
            url = f"http://127.0.0.1:{port}"
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")},
                **credentials.ENV,
                "KVFLEET_FLEET_NAME": name,
                "KVFLEET_PEER_URL": url,
                "KVFLEET_PEER_SECRET": SECRET,
                "KVFLEET_FLEET_CONFIG": str(f.config),
                "KVFLEET_REPLICA_CACHE__ADMIT_MIN_SIGHTINGS": "1",
                "KVFLEET_REPLICA_LIMITS__MAX_TOKENS": "32",
                "KVFLEET_HINT_LOOKUP_BUDGET_S": "2.0",
            }
            if name == "r0":  # a small T1, so that a few prompts push one out of T1 into T3
                env |= {
                    "KVFLEET_REPLICA_CACHE__NUM_T1_BLOCKS": "32",
                    "KVFLEET_REPLICA_CACHE__NVME_PATH": str(tmp / "nvme"),
                    "KVFLEET_REPLICA_CACHE__NVME_CAPACITY_BYTES": str(4 << 20),
                    "KVFLEET_REPLICA_CACHE__NVME_MIN_SIGHTINGS": "1",
                }
            args = ["replica", "--model-dir", str(model_dir), "--port", str(port), "--host",
                    "127.0.0.1", "--model-id", "tiny", "--device", "cpu", "--log-level", "INFO"]
            f.replicas[name] = Replica(name, url, _spawn(args, env, tmp / f"{name}.log"))
            credentials.NAME_BY_URL[url] = name
        for replica in f.replicas.values():
            _wait_ready(replica.url, replica.popen)
        yield f
    finally:
        for replica in f.replicas.values():
            if replica.popen.poll() is None:
                replica.popen.send_signal(signal.SIGTERM)
        for replica in f.replicas.values():
            try:
                replica.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.popen.kill()
                replica.popen.wait(timeout=30)


def cached(url: str, text: str, tenant: str = "acme") -> tuple[list[int], int]:
    out, headers = complete(url, text, tenant=tenant, max_tokens=4)
    return out, int(headers["X-Kvfleet-Cached-Tokens"])


class Traffic:
    """Requests sent continuously while a toggle flips: none may fail."""

    def __init__(self, url: str, text: str) -> None:
        self.url, self.text = url, text
        self.outputs: list[list[int]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.outputs.append(cached(self.url, self.text, tenant="steady")[0])
            except BaseException as exc:
                self.errors.append(exc)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def served(url: str, text: str, tenant: str = "acme") -> tuple[list[int], int, str]:
    out, headers = complete(url, text, tenant=tenant, max_tokens=4)
    return out, int(headers["X-Kvfleet-Cached-Tokens"]), headers["X-Kvfleet-Cache-Tier"]


def test_t0_off_drains_the_engines_kv_into_t1_mid_traffic_and_on_caches_in_place(
    fleet: Fleet,
) -> None:
    r1 = fleet.replicas["r1"]
    gen = fleet.publish(t0_device=True, t1_host=True, t2_peer=False, nvme=False,
                        nvme_shadow=False)
    assert fleet.applied("r1", gen)["tiers"]["t0_device"] is True
    text = prompt(50)
    first, hit, _ = served(r1.url, text)
    assert hit == 0
    pid = r1.popen.pid
    with Traffic(r1.url, prompt(51)) as traffic:
        wait_for(lambda: len(traffic.outputs) >= 2, "traffic hitting its own prompt in T0")
        t0_before, t1_before = tier_used(r1.url, "t0"), tier_used(r1.url, "t1")
        assert t0_before >= 2 * 15  # both prompts' 15 full blocks, cached in place
        gen = fleet.publish(t0_device=False, t1_host=True, t2_peer=False, nvme=False,
                            nvme_shadow=False)
        report = fleet.applied("r1", gen)  # within one poll, while requests keep coming
        served_before = len(traffic.outputs)
        wait_for(lambda: len(traffic.outputs) >= served_before + 2, "traffic after the flip")
    assert report["tiers"]["t0_device"] is False
    assert traffic.errors == [] and traffic.outputs  # no lost request
    assert all(o == traffic.outputs[0] for o in traffic.outputs)  # hit or miss, same tokens
    assert tier_used(r1.url, "t0") == 0  # T0 keeps nothing of the engine's KV now
    assert tier_used(r1.url, "t1") == t1_before + t0_before  # demoted by copy, none lost
    assert served(r1.url, text) == (first, 15 * 16, "t1")  # repeats hit T1, not T0
    fresh = prompt(52)
    out, hit, _ = served(r1.url, fresh)
    assert hit == 0
    wait_for(lambda: tier_used(r1.url, "t1") == t1_before + t0_before + 15, "the copy into T1")
    assert tier_used(r1.url, "t0") == 0
    assert served(r1.url, fresh) == (out, 15 * 16, "t1")

    gen = fleet.publish(t0_device=True, t1_host=True, t2_peer=False, nvme=False,
                        nvme_shadow=False)
    assert fleet.applied("r1", gen)["tiers"]["t0_device"] is True
    again = prompt(53)
    out, hit, _ = served(r1.url, again)
    assert hit == 0 and tier_used(r1.url, "t0") == 15  # cached in place again
    assert served(r1.url, again) == (out, 15 * 16, "t0")
    assert served(r1.url, text) == (first, 15 * 16, "t1")
    gen = fleet.publish(t1_host=True, t2_peer=True, nvme=False, nvme_shadow=False)  # T0 off
    assert fleet.applied("r1", gen)["tiers"]["t0_device"] is False
    assert r1.popen.pid == pid and r1.popen.poll() is None  # never restarted


def test_t1_off_drains_t1_without_a_restart_or_a_lost_request(fleet: Fleet) -> None:
    r1 = fleet.replicas["r1"]
    text = prompt(1)
    first, hit = cached(r1.url, text)
    assert hit == 0
    wait_for(lambda: tier_used(r1.url, "t1") >= 15, "the prompt in r1's T1")
    pid = r1.popen.pid
    with Traffic(r1.url, prompt(2)) as traffic:
        gen = fleet.publish(t1_host=False, t2_peer=True, nvme=False, nvme_shadow=False)
        report = fleet.applied("r1", gen)
        time.sleep(0.5)
    assert report["tiers"]["t1_host"] is False
    assert traffic.errors == [] and traffic.outputs  # no lost request
    assert all(o == traffic.outputs[0] for o in traffic.outputs)
    assert tier_used(r1.url, "t1") == 0  # drained: unreachable and freed
    again, hit = cached(r1.url, text)
    assert again == first and hit == 0  # it was only in T1
    assert tier_used(r1.url, "t1") == 0  # and T1 takes nothing while off
    gen = fleet.publish(t1_host=True, t2_peer=True, nvme=False, nvme_shadow=False)
    assert fleet.applied("r1", gen)["tiers"]["t1_host"] is True
    cached(r1.url, prompt(3))
    wait_for(lambda: tier_used(r1.url, "t1") > 0, "T1 in use again")
    assert r1.popen.pid == pid and r1.popen.poll() is None  # never restarted


def held_probe(url: str, tenant: str, hashes: list[str]) -> int:
    r = requests.post(
        url + HELD_PATH,
        json={"block_hashes": hashes},
        headers={TENANT_HEADER: tenant,
                 "Authorization": "Bearer " + peer_token(SECRET.encode(), tenant)},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["leading_blocks"])


def test_t2_off_stops_fetching_and_serving_peers(fleet: Fleet) -> None:
    r0, r1 = fleet.replicas["r0"], fleet.replicas["r1"]
    gen = fleet.publish(t1_host=True, t2_peer=False, nvme=False, nvme_shadow=False)
    fleet.applied("r0", gen)
    fleet.applied("r1", gen)
    text = prompt(10)
    recomputed, _ = cached(r1.url, text, tenant="t2co")
    hashes = chain(r1.url, "t2co", text)
    wait_for(lambda: tier_used(r1.url, "t1") >= 15, "r1 to hold the prompt")
    assert held_probe(r1.url, "t2co", hashes) == 0  # r1 serves no probe while off...
    before = load(r0.url)["t2"]["fetches"]
    out, hit = cached(r0.url, text, tenant="t2co")  # ...and r0 does not fetch
    assert out == recomputed and hit == 0
    assert load(r0.url)["t2"]["fetches"] == before
    gen = fleet.publish(t1_host=True, t2_peer=True, nvme=False, nvme_shadow=False)
    fleet.applied("r0", gen)
    fleet.applied("r1", gen)
    assert held_probe(r1.url, "t2co", hashes) == 15  # serving again
    text = prompt(11)
    recomputed, _ = cached(r1.url, text, tenant="t2co")
    wait_for(lambda: held_probe(r1.url, "t2co", chain(r1.url, "t2co", text)) == 15, "r1 holds")
    out, hit = cached(r0.url, text, tenant="t2co")
    assert out == recomputed and hit == 15 * 16  # fetched over T2
    assert load(r0.url)["t2"]["fetches"].get("ok", 0) >= 1


def push_out_of_t1(url: str, first: int) -> None:
    """Three more 15-block prompts: 45 blocks through a 32-block T1."""
    for i in range(first, first + 3):
        cached(url, prompt(i), tenant="filler")


def nvme(url: str) -> dict[str, Any]:
    return dict(load(url)["nvme"])


def test_nvme_on_serves_t1_evictions_shadow_measures_off_forgets(fleet: Fleet) -> None:
    r0 = fleet.replicas["r0"]
    gen = fleet.publish(t1_host=True, t2_peer=False, nvme=True, nvme_shadow=False)
    assert fleet.applied("r0", gen)["nvme"]["mode"] == "on"
    text = prompt(20)
    recomputed, hit = cached(r0.url, text)
    assert hit == 0
    push_out_of_t1(r0.url, 100)
    wait_for(lambda: nvme(r0.url)["store"]["num_blocks_written"] >= 15, "the prompt in T3")
    out, hit = cached(r0.url, text)
    assert out == recomputed and hit == 15 * 16  # served from the NVMe file
    assert nvme(r0.url)["tier"]["num_blocks_served"] >= 15

    gen = fleet.publish(t1_host=True, t2_peer=False, nvme=False, nvme_shadow=True)
    assert fleet.applied("r0", gen)["nvme"]["mode"] == "shadow"
    text = prompt(30)
    recomputed, _ = cached(r0.url, text)
    push_out_of_t1(r0.url, 200)
    wait_for(lambda: nvme(r0.url)["store"]["num_blocks_written"] >= 30, "shadow writes")
    shadow_before = nvme(r0.url)["tier"]["num_blocks_shadow_read"]
    out, hit = cached(r0.url, text)
    assert out == recomputed and hit == 0  # read back, not served
    report = nvme(r0.url)
    assert report["tier"]["num_blocks_shadow_read"] >= shadow_before + 15
    assert report["read_bandwidth"]["1"]["aggregate_gb_s"] > 0

    gen = fleet.publish(t1_host=True, t2_peer=False, nvme=False, nvme_shadow=False)
    report = fleet.applied("r0", gen)
    assert report["nvme"]["mode"] == "off" and report["nvme"]["blocks"] == 0
    text = prompt(40)
    recomputed, _ = cached(r0.url, text)
    written = nvme(r0.url)["store"]["num_blocks_written"]
    push_out_of_t1(r0.url, 300)
    out, hit = cached(r0.url, text)
    assert out == recomputed and hit == 0
    assert nvme(r0.url)["store"]["num_blocks_written"] == written  # nothing written while off
