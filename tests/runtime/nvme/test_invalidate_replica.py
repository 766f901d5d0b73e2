"""`POST /cache/invalidate` on a real replica (its own server thread, a real T3 file): the weights
version it names is withdrawn from T3 as well as from T0/T1, so a repeat request recomputes
instead of being served from NVMe; a version the replica does not hold changes nothing, and what
T3 holds keeps being served."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests
import yaml

from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.nvme import NvmeTier
from kvfleet_runtime.server import (
    Replica,
    ReplicaAuth,
    build_replica,
    load_config,
)
from kvfleet_runtime.wire import TENANT_HEADER
from tests.runtime.server.conftest import (
    OPERATOR_TOKEN,
    ROUTER_SECRET,
    TEST_CONFIG,
    ServerThread,
    as_router,
)

T0_OFF = {"t0_enabled": False}
NUM_BLOCKS = 15  # whole blocks of each prompt (the engine computes the last token itself)


def prompt(i: int) -> list[int]:
    return [(i * 31 + j) % 200 + 3 for j in range(NUM_BLOCKS * 16 + 1)]


@dataclass
class Running:
    replica: Replica
    url: str

    @property
    def tier(self) -> NvmeTier:
        assert self.replica.nvme is not None
        return self.replica.nvme

    def complete(self, tenant: str, tokens: list[int]) -> tuple[list[int], int]:
        """(generated token ids, prompt tokens the cache supplied)."""
        url = self.url + "/v1/completions"
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0}
        r = requests.post(url, json=body, timeout=120,
                          headers=as_router({TENANT_HEADER: tenant}, "POST", url))
        assert r.status_code == 200, r.text
        out: list[int] = r.json()["choices"][0]["token_ids"]
        return out, int(r.headers["X-Kvfleet-Cached-Tokens"])

    def invalidate(self, digest: str) -> None:
        url = self.url + "/cache/invalidate"
        r = requests.post(url, json={"model_version": digest}, timeout=30,
                          headers=as_router({}, "POST", url))
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 60
        while self.replica.background:  # the invalidation runs in a thread after the 202
            assert time.monotonic() < deadline, "the invalidation did not finish"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("invalidate-t3")
    generate_checkpoint(tmp / "tiny", ModelArgs.from_preset("tiny"), seed=0)
    (tmp / "nvme").mkdir()
    config_path = tmp / "replica.yaml"
    config_path.write_text(yaml.safe_dump(TEST_CONFIG | {"cache": {
        # T0 (the engine's own KV) off: every stored prompt lands in a 32-block T1, and two
        # more prompts push a prompt out of it into T3.
        **T0_OFF, "num_t1_blocks": 32, "admit_min_sightings": 1,
        "nvme_path": str(tmp / "nvme"), "nvme_capacity_bytes": 8 << 20, "nvme_mode": "on",
        "nvme_min_sightings": 1,
    }}))
    overrides = {"model_dir": str(tmp / "tiny")}
    replica = build_replica(load_config(config_path, environ={}, overrides=overrides),
                            config_path=config_path, overrides=overrides)
    auth = ReplicaAuth(router_secret=ROUTER_SECRET, operator_token=OPERATOR_TOKEN)
    with ServerThread(replica, auth) as server:
        yield Running(replica, f"http://127.0.0.1:{server.port}")


def test_invalidate_withdraws_the_version_from_t3(running: Running) -> None:
    tier = running.tier
    assert tier.store.num_slots >= 4 * NUM_BLOCKS
    acme, _ = running.complete("acme", prompt(1))
    other, _ = running.complete("other", prompt(2))
    for i in (10, 11, 12):  # 45 more blocks through the 32-block T1
        running.complete("filler", prompt(i))
    tier.flush()
    held = len(tier.store)
    assert held >= 2 * NUM_BLOCKS  # both tenants' prompts were evicted into T3

    # A version this replica does not serve: nothing is withdrawn, T3 keeps serving.
    running.invalidate("sha256:" + "0" * 64)
    assert len(tier.store) == held and tier.store.stats.num_invalidated == 0
    served = tier.stats.num_blocks_served
    out, cached = running.complete("other", prompt(2))
    assert out == other and cached == NUM_BLOCKS * 16
    assert tier.stats.num_blocks_served == served + NUM_BLOCKS  # from the NVMe file
    tier.flush()
    held = len(tier.store)

    # The served version: every T3 block of it is unreachable and its slot free.
    running.invalidate(running.replica.loaded.weights_digest)
    assert len(tier.store) == 0 and tier.store.stats.num_invalidated == held
    served = tier.stats.num_blocks_served
    out, cached = running.complete("acme", prompt(1))
    assert out == acme and cached == 0  # recomputed, equal to the first computation
    assert tier.stats.num_blocks_served == served  # no T3 hit
    tier.flush()
    assert len(tier.store) == 0  # T1 was emptied too: nothing of the old entries evicted into T3
    metrics = requests.get(running.url + "/metrics", timeout=10).text
    assert f"kvfleet_nvme_invalidated_blocks_total {float(held)}" in metrics
