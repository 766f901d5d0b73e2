"""The connector's extra config, parsed once for both roles (`kvfleet_vllm._options`): every
key checked, each bad value refused with its key named, absent ones left to their homes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_vllm._options import DEFAULT_HOST_POOL_PATH, ConnectorOptions


def test_defaults_and_values() -> None:
    opts = ConnectorOptions.parse({"kvfleet.num_host_blocks": "64"})
    assert opts == ConnectorOptions(host_pool_path=Path(DEFAULT_HOST_POOL_PATH),
                                    num_host_blocks=64)
    opts = ConnectorOptions.parse({
        "kvfleet.num_host_blocks": 8, "kvfleet.host_pool_path": "/dev/shm/p",
        "kvfleet.model_id": "m", "kvfleet.salt_secret_file": "/s", "kvfleet.peer_port": "0",
        "kvfleet.peer_wait_s": "1.5", "kvfleet.admit_min_sightings": 2, "kvfleet.tp_rank": 1})
    assert (opts.host_pool_path, opts.model_id, opts.salt_secret_file) == (
        Path("/dev/shm/p"), "m", Path("/s"))
    assert (opts.peer_port, opts.peer_wait_s, opts.admit_min_sightings, opts.tp_rank) == (
        0, 1.5, 2, 1)
    assert opts.hot_min_sightings is None and opts.peer_host == "0.0.0.0"


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvfleet.num_host_blocks": 8, "kvfleet.nope": 1}, "unknown kv_connector_extra_config keys"),
    ({"kvfleet.num_host_blocks": 8, "host_pool_path": "/x"}, "['host_pool_path']"),
    ({}, "kvfleet.num_host_blocks must be > 0, got 0"),
    ({"kvfleet.num_host_blocks": "many"}, "kvfleet.num_host_blocks must be an integer"),
    ({"kvfleet.num_host_blocks": True}, "kvfleet.num_host_blocks must be an integer"),
    ({"kvfleet.num_host_blocks": 8, "kvfleet.peer_port": 70000}, "peer_port must be a TCP port"),
    ({"kvfleet.num_host_blocks": 8, "kvfleet.peer_port": True}, "peer_port must be a TCP port"),
    ({"kvfleet.num_host_blocks": 8, "kvfleet.peer_wait_s": 0}, "peer_wait_s must be seconds"),
    ({"kvfleet.num_host_blocks": 8, "kvfleet.admit_min_sightings": "x"},
     "kvfleet.admit_min_sightings must be an integer"),
])
def test_bad_values_name_their_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ConnectorOptions.parse(extra)
