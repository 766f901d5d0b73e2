"""`cache.t0_enabled` follows the watched replica config live (no fleet config here), applied at
the first poll that sees the change: a real replica (its own server thread, deterministic mode so
a hit equals the miss bitwise) drains T0 into T1, serves the drained prefix from T1, and indexes
prompts in the engine's KV again once T0 is back on."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import yaml

from kvfleet_runtime.server import ReplicaAuth, build_replica, load_config
from kvfleet_runtime.wire import TENANT_HEADER
from tests.runtime.server.conftest import (
    OPERATOR_TOKEN,
    ROUTER_SECRET,
    TEST_CONFIG,
    ServerThread,
    as_router,
)


def write(path: Path, t0_enabled: bool) -> None:
    cfg = TEST_CONFIG | {
        "engine": TEST_CONFIG["engine"] | {"deterministic": True},
        "cache": TEST_CONFIG["cache"] | {"t0_enabled": t0_enabled, "admit_min_sightings": 1},
    }
    path.write_text(yaml.safe_dump(cfg))


def wait_for(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60  # a bound for a loaded box, not a speed assertion
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_t0_follows_the_config_file_within_one_poll(model_dir: Path, tmp_path: Path) -> None:
    config_path = tmp_path / "replica.yaml"
    write(config_path, t0_enabled=True)
    overrides = {"model_dir": str(model_dir)}
    replica = build_replica(load_config(config_path, environ={}, overrides=overrides),
                            config_path=config_path, overrides=overrides)
    auth = ReplicaAuth(router_secret=ROUTER_SECRET, operator_token=OPERATOR_TOKEN)
    with ServerThread(replica, auth) as server:
        url = f"http://127.0.0.1:{server.port}"

        def get(path: str) -> dict[str, Any]:
            r = requests.get(url + path, headers=as_router({}, "GET", url + path), timeout=30)
            return dict(r.json())

        def used() -> tuple[int, int]:
            t0, t1 = get("/cache/stats")["tiers"]
            return int(t0["num_blocks_used"]), int(t1["num_blocks_used"])

        def complete(prompt: list[int]) -> tuple[str, int, str]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            headers = as_router({TENANT_HEADER: "acme"}, "POST", url + "/v1/completions")
            r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            text = str(r.json()["choices"][0]["text"])
            return (text, int(r.headers["X-Kvfleet-Cached-Tokens"]),
                    r.headers["X-Kvfleet-Cache-Tier"])

        def flip(on: bool) -> None:
            write(config_path, t0_enabled=on)
            polls = get("/readyz")["config_polls"]  # this poll may have read the old file
            wait_for(lambda: get("/cache/stats")["t0_enabled"] is on, f"T0 {on}")
            assert get("/readyz")["config_applied_at_poll"] <= polls + 1  # within one poll

        a, b = [7] * 3 + list(range(40, 77)), [9] * 3 + list(range(80, 117))  # 40 tokens each
        first, hit, _ = complete(a)
        assert hit == 0 and used() == (2, 0)  # indexed in place in the engine's KV
        flip(False)
        assert used() == (0, 2)  # drained: demoted into T1
        assert replica.restart_pending == []  # a live field
        assert complete(a) == (first, 32, "t1")
        other, hit, _ = complete(b)
        assert hit == 0
        wait_for(lambda: used() == (0, 4), "the new prompt copied into T1")
        flip(True)
        c = [11] * 3 + list(range(120, 157))
        third, hit, _ = complete(c)
        assert hit == 0 and used() == (2, 4)  # in place again
        assert complete(c) == (third, 32, "t0")
        assert complete(b) == (other, 32, "t1")
