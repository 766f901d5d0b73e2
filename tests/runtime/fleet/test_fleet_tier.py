"""Fleet settings from the replica's environment, and the peers the fleet config names."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from kvfleet_runtime.fleet import (
    EmbeddedHintIndex,
    PeerProbeHintIndex,
    RedisHintIndex,
    fleet_tier,
)
from kvfleet_runtime.fleet.fleet_tier import FleetSettings
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.server import build_replica, load_config


@pytest.fixture(autouse=True)
def no_mounted_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fleet_tier, "DEFAULT_SECRET_FILE", tmp_path / "absent-token")
    monkeypatch.setattr(fleet_tier, "DEFAULT_FLEET_CONFIG", tmp_path / "absent-fleet.yaml")


def test_nothing_configured_means_no_fleet_tier() -> None:
    assert FleetSettings.from_env({}, port=8000) is None


def test_env_settings() -> None:
    s = FleetSettings.from_env(
        {
            "KVFLEET_FLEET_NAME": "r0",
            "KVFLEET_PEER_SECRET": "s3cret",
            "POD_IP": "10.0.0.7",
            "KVFLEET_REDIS_URL": "redis://127.0.0.1:6379/0",
        },
        port=8001,
    )
    assert s is not None
    assert (s.name, s.secret, s.peer_url, s.redis_url, s.fleet_config) == (
        "r0",
        b"s3cret",
        "http://10.0.0.7:8001",
        "redis://127.0.0.1:6379/0",
        None,
    )


def test_secret_file_and_defaults(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    config = tmp_path / "fleet.yaml"
    s = FleetSettings.from_env(
        {
            "KVFLEET_PEER_SECRET_FILE": str(token),
            "KVFLEET_FLEET_CONFIG": str(config),
            "POD_NAME": "replica-7",
        },
        port=8000,
    )
    assert s is not None
    assert (s.name, s.secret, s.fleet_config) == ("replica-7", b"from-a-file", config)
    assert s.peer_url == f"http://{socket.gethostname()}:8000"
    assert s.redis_url is None  # the embedded index


def test_missing_secret_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absent"):
        FleetSettings.from_env({"KVFLEET_PEER_SECRET_FILE": str(tmp_path / "absent")}, port=1)


def test_hint_lookup_budget(tmp_path: Path) -> None:
    env = {"KVFLEET_FLEET_NAME": "r0"}
    s = FleetSettings.from_env({**env, "KVFLEET_HINT_LOOKUP_BUDGET_S": "0.25"}, port=1)
    assert s is not None and s.hint_lookup_budget_s == 0.25
    with pytest.raises(ValueError, match="seconds"):
        FleetSettings.from_env({**env, "KVFLEET_HINT_LOOKUP_BUDGET_S": "fast"}, port=1)
    with pytest.raises(ValueError, match="> 0"):
        FleetSettings.from_env({**env, "KVFLEET_HINT_LOOKUP_BUDGET_S": "0"}, port=1)


async def test_the_hint_lookup_budget_reaches_the_redis_index() -> None:
    env = {"KVFLEET_PEER_SECRET": "s", "KVFLEET_REDIS_URL": "redis://127.0.0.1:1/0",
           "KVFLEET_HINT_LOOKUP_BUDGET_S": "0.25"}
    settings = FleetSettings.from_env(env, port=1)
    assert settings is not None
    index = fleet_tier.hint_index_for(settings)
    try:
        assert isinstance(index, RedisHintIndex) and index.lookup_budget_s == 0.25
    finally:
        await index.close()
    embedded = FleetSettings.from_env({"KVFLEET_PEER_SECRET": "s"}, port=1)
    assert embedded is not None
    assert isinstance(fleet_tier.hint_index_for(embedded), EmbeddedHintIndex)


async def test_the_peer_probe_reaches_a_vllm_replica_at_its_peer_url(tmp_path: Path) -> None:
    """Without Redis, the peers come from the fleet config: a vLLM replica serves T2 on its
    connector's port (`peer_url`), not its API `url`; a kvfleet replica on its `url`. The probe
    (the hint index) and the fetch's host resolution both take `peer_url or url`."""
    model_dir = tmp_path / "tiny"
    generate_checkpoint(model_dir, ModelArgs.from_preset("tiny"), seed=0)
    replica_yaml = tmp_path / "replica.yaml"
    replica_yaml.write_text(yaml.safe_dump({"model_id": "tiny", "device": "cpu"}))
    overrides = {"model_dir": str(model_dir)}
    replica = build_replica(load_config(replica_yaml, environ={}, overrides=overrides),
                            config_path=replica_yaml, overrides=overrides)
    fleet_yaml = tmp_path / "fleet.yaml"
    fleet_yaml.write_text(json.dumps({"generation": 1, "replicas": [
        {"name": "self", "url": "http://10.0.0.1:8000"},
        {"name": "vllm-a", "url": "http://10.0.0.2:8000", "engine": "vllm",
         "peer_url": "http://10.0.0.2:8701"},
        {"name": "kvfleet-b", "url": "http://10.0.0.3:8000"},
    ]}))
    settings = FleetSettings.from_env({"KVFLEET_FLEET_NAME": "self", "KVFLEET_PEER_SECRET": "s",
                                       "KVFLEET_FLEET_CONFIG": str(fleet_yaml)}, port=8000)
    assert settings is not None
    tier = fleet_tier.FleetTier(replica, settings)
    tier._reload_config()
    assert isinstance(tier.index, PeerProbeHintIndex)
    assert tier.index.peers() == {"vllm-a": "http://10.0.0.2:8701",
                                  "kvfleet-b": "http://10.0.0.3:8000"}
    assert await tier.index.host_url("vllm-a") == "http://10.0.0.2:8701"
    assert tier._resolve("vllm-a") == "http://10.0.0.2:8701"
    assert tier._resolve("kvfleet-b") == "http://10.0.0.3:8000"
