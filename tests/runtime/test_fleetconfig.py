from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_runtime.fleetconfig import (
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


def test_empty_file_is_the_defaults() -> None:
    assert parse_fleet_config("") == FleetConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tiers: {t1_hots: false}", "tiers.t1_hots: Extra inputs are not permitted"),
        ("affinity: {k: 0}", "affinity.k: Input should be greater than or equal to 1"),
        ("affinity: {occupancy_threshold: 1.5}", "affinity.occupancy_threshold"),
        ("replicas: [{name: r0, url: 'ftp://x'}]", "replicas.0.url"),
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
