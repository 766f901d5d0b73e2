"""The connector's `kv_connector_extra_config` keys: one home, read by the connector and checked
by the chart's render test against what `replica.engine: vllm` passes, and parsed once
(`ConnectorOptions.parse`) for both of the connector's roles. No vllm, no torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CACHE_KNOBS", "DEFAULT_HOST_POOL_PATH", "EXTRA_KEYS", "MODULE_PATH", "NAME", "PREFIX",
           "T2_KEYS", "ConnectorOptions"]

NAME = "KvfleetConnector"
MODULE_PATH = "kvfleet_vllm.connector"
"""What `--kv-transfer-config` names: {"kv_connector": NAME, "kv_connector_module_path": ...}."""

PREFIX = "kvfleet."
DEFAULT_HOST_POOL_PATH = "/dev/shm/kvfleet-host-pool"
CACHE_KNOBS = ("admit_min_sightings", "hot_min_sightings")
"""`CacheTuning` fields a deployment may set (`kvfleet.<name>`); the rest keep kvfleet's
defaults, the same as a kvfleet replica's."""
T2_KEYS = ("peer_port", "peer_host", "peer_wait_s")
"""T2 (docs/vllm.md "T2"): the port the engine-core process serves peers on (absent: no T2),
the address it binds (default 0.0.0.0), and the longest a request waits for a fetch (seconds).
The rest of the fleet settings come from the same environment as a kvfleet replica's."""
EXTRA_KEYS = frozenset({"host_pool_path", "num_host_blocks", "model_id", "weights_digest",
                        "default_tenant", "salt_secret_file", "tp_rank", *CACHE_KNOBS,
                        *T2_KEYS})
"""Every key is `PREFIX + name`; `tp_rank` only for a worker built outside a distributed run.
`salt_secret_file`: the router's secret (the chart passes the file it mounts,
`kvfleet_runtime.auth.ROUTER_SECRET_FILE`), to verify each request's `cache_salt`; unset, a salt
is taken as the tenant's name as it is."""


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """`kv_connector_extra_config`, parsed once for both of the connector's roles (each reads
    its own fields). Absent optional fields are None: each default has its home where it is
    used (`CacheTuning`, `_peer.DEFAULT_WAIT_S`, vLLM's served model name)."""

    host_pool_path: Path
    num_host_blocks: int
    model_id: str | None = None
    weights_digest: str | None = None
    default_tenant: str = "default"
    salt_secret_file: Path | None = None
    admit_min_sightings: int | None = None
    hot_min_sightings: int | None = None
    peer_port: int | None = None
    """T2 on this port (0: any free one); None: no T2."""
    peer_host: str = "0.0.0.0"
    peer_wait_s: float | None = None
    tp_rank: int | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        """Raises ValueError naming the key for an unknown key or a value it cannot use."""
        unknown = sorted(k for k in extra if not k.startswith(PREFIX)
                         or k.removeprefix(PREFIX) not in EXTRA_KEYS)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; the kvfleet "
                             f"connector reads {sorted(PREFIX + k for k in EXTRA_KEYS)}")
        get = {k.removeprefix(PREFIX): v for k, v in extra.items()}.get
        num_slots = _int(get("num_host_blocks", 0), "num_host_blocks")
        if num_slots <= 0:
            raise ValueError(f"{PREFIX}num_host_blocks must be > 0, got {num_slots}")
        raw_port = get("peer_port")
        port: int | None = None
        if raw_port is not None:
            try:
                port = -1 if isinstance(raw_port, bool) else int(raw_port)
            except (TypeError, ValueError):
                port = -1
            if not 0 <= port < 65536:
                raise ValueError(f"{PREFIX}peer_port must be a TCP port (0-65535), got "
                                 f"{raw_port!r}")
        raw_wait = get("peer_wait_s")
        wait_s: float | None = None
        if raw_wait is not None:
            try:
                wait_s = float(raw_wait)
            except (TypeError, ValueError):
                wait_s = float("nan")
            if not 0 < wait_s <= 60:
                raise ValueError(f"{PREFIX}peer_wait_s must be seconds in (0, 60], got "
                                 f"{raw_wait!r}")
        secret_file = get("salt_secret_file")
        knobs = {name: None if get(name) is None else _int(get(name), name)
                 for name in CACHE_KNOBS}
        return cls(
            host_pool_path=Path(str(get("host_pool_path", DEFAULT_HOST_POOL_PATH))),
            num_host_blocks=num_slots,
            model_id=None if get("model_id") is None else str(get("model_id")),
            weights_digest=None if get("weights_digest") is None else str(get("weights_digest")),
            default_tenant=str(get("default_tenant", "default")),
            salt_secret_file=None if secret_file is None else Path(str(secret_file)),
            admit_min_sightings=knobs["admit_min_sightings"],
            hot_min_sightings=knobs["hot_min_sightings"],
            peer_port=port,
            peer_host=str(get("peer_host", "0.0.0.0")),
            peer_wait_s=wait_s,
            tp_rank=None if get("tp_rank") is None else _int(get("tp_rank"), "tp_rank"),
        )


def _int(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{PREFIX}{name} must be an integer, got {value!r}") from None
