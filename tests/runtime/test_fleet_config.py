from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet_runtime.config.fleet import (
    FleetConfig,
    ReplicaEndpoint,
    dump_fleet_config,
    load_fleet_config,
    parse_fleet_config,
)


def test_round_trip_is_canonical() -> None:
    config = FleetConfig(
        policy="default/kv",
        generation=3,
        replicas=(ReplicaEndpoint(name="r0", url="http://127.0.0.1:9000"),),
        home_sets={"acme": ("r0",)},
    )
    text = dump_fleet_config(config)
    assert parse_fleet_config(text) == config
    assert dump_fleet_config(parse_fleet_config(text)) == text


def test_peer_url_round_trips_and_is_left_out_when_none() -> None:
    """A vLLM replica's T2 port is its own (`peer_url`); a kvfleet replica's is its API port, and
    its entry's text is what it was before the field existed (no ConfigMap churn on upgrade)."""
    vllm = ReplicaEndpoint(name="v0", url="http://10.0.0.1:8000", engine="vllm",
                           peer_url="http://10.0.0.1:8701")
    kvfleet = ReplicaEndpoint(name="k0", url="http://10.0.0.2:8000")
    config = FleetConfig(policy="default/kv", generation=1, replicas=(vllm, kvfleet))
    text = dump_fleet_config(config)
    assert parse_fleet_config(text) == config
    assert dump_fleet_config(parse_fleet_config(text)) == text
    written = {r["name"]: r for r in json.loads(text)["replicas"]}
    assert written["v0"]["peer_url"] == "http://10.0.0.1:8701"
    assert written["k0"] == {"name": "k0", "url": "http://10.0.0.2:8000",
                             "weights_digest": None, "ready": True}
    assert parse_fleet_config(text).replicas[1].peer_url is None


def test_empty_file_is_the_defaults() -> None:
    assert parse_fleet_config("") == FleetConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tiers: {t1_hots: false}", "tiers.t1_hots: Extra inputs are not permitted"),
        ("affinity: {k: 0}", "affinity.k: Input should be greater than or equal to 1"),
        ("affinity: {occupancy_threshold: 1.5}", "affinity.occupancy_threshold"),
        ("replicas: [{name: r0, url: 'ftp://x'}]", "replicas.0.url"),
        ("replicas: [{name: r0, url: 'http://x', peer_url: 'x:8701'}]", "replicas.0.peer_url"),
        ("version: 2", "version"),
        ("- 1", "expected a mapping"),
        ("a: [", "not valid YAML/JSON"),
    ],
)
def test_bad_config_names_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fleet_config(text, "fleet.yaml")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read fleet config"):
        load_fleet_config(tmp_path / "fleet.yaml")
