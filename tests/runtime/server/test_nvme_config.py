"""The replica's T3 settings: a real replica (its own server thread) with a T3 store on a real
directory, the store's mode following the watched config file live (no fleet config here), a
path that cannot hold the store leaving T3 off instead of failing the start, and a capacity below
one block refused with the value."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from kvfleet_runtime.nvme import STORE_FILENAME
from kvfleet_runtime.server import ReplicaAuth, build_replica, load_config
from kvfleet_runtime.wire import TENANT_HEADER
from tests.runtime.server.conftest import (
    OPERATOR_TOKEN,
    ROUTER_SECRET,
    TEST_CONFIG,
    ServerThread,
    as_router,
)


def write(path: Path, nvme: dict[str, Any]) -> None:
    cfg = TEST_CONFIG | {"cache": TEST_CONFIG["cache"] | nvme}
    path.write_text(yaml.safe_dump(cfg))


def test_t3_mode_follows_the_config_file_live(model_dir: Path, tmp_path: Path) -> None:
    store_dir = tmp_path / "nvme"
    store_dir.mkdir()
    config_path = tmp_path / "replica.yaml"
    nvme = {"nvme_path": str(store_dir), "nvme_capacity_bytes": 1 << 20, "nvme_mode": "off"}
    write(config_path, nvme)
    overrides = {"model_dir": str(model_dir)}
    replica = build_replica(load_config(config_path, environ={}, overrides=overrides),
                            config_path=config_path, overrides=overrides)
    assert replica.nvme is not None and replica.nvme.mode == "off"
    assert (store_dir / STORE_FILENAME).stat().st_size <= 1 << 20
    auth = ReplicaAuth(router_secret=ROUTER_SECRET, operator_token=OPERATOR_TOKEN)
    with ServerThread(replica, auth) as server:
        url = f"http://127.0.0.1:{server.port}"
        write(config_path, nvme | {"nvme_mode": "shadow"})
        deadline = time.monotonic() + 30
        while replica.nvme.mode != "shadow":
            assert time.monotonic() < deadline, "the mode change was not applied"
            time.sleep(0.05)
        assert replica.restart_pending == []  # a live field
        body = {"model": "tiny", "prompt": [5] * 40, "max_tokens": 2}
        r = requests.post(url + "/v1/completions", json=body, timeout=60,
                          headers=as_router({TENANT_HEADER: "acme"}, "POST",
                                            url + "/v1/completions"))
        assert r.status_code == 200, r.text
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert 'kvfleet_nvme_mode{mode="shadow"} 1.0' in metrics
        assert "kvfleet_nvme_capacity_blocks" in metrics


def test_a_path_that_cannot_hold_t3_leaves_it_off(model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, environ={}, overrides={
        "model_dir": str(model_dir), "device": "cpu",
        "cache": {"nvme_path": str(tmp_path / "missing"), "nvme_capacity_bytes": 1 << 20},
    })
    assert build_replica(cfg).nvme is None


def test_a_capacity_below_one_block_is_refused(model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, environ={}, overrides={
        "model_dir": str(model_dir), "device": "cpu",
        "cache": {"nvme_path": str(tmp_path), "nvme_capacity_bytes": 100},
    })
    with pytest.raises(ValueError, match=r"cache\.nvme_capacity_bytes 100 is smaller than one KV"):
        build_replica(cfg)
