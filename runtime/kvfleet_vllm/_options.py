"""The connector's `kv_connector_extra_config` keys: one home, read by the connector and checked
by the chart's render test against what `replica.engine: vllm` passes. No vllm, no torch."""

from __future__ import annotations

__all__ = ["CACHE_KNOBS", "DEFAULT_HOST_POOL_PATH", "EXTRA_KEYS", "MODULE_PATH", "NAME", "PREFIX",
           "T2_KEYS"]

NAME = "KvfleetConnector"
MODULE_PATH = "kvfleet_vllm.connector"
"""What `--kv-transfer-config` names: {"kv_connector": NAME, "kv_connector_module_path": ...}."""

PREFIX = "kvfleet."
DEFAULT_HOST_POOL_PATH = "/dev/shm/kvfleet-host-pool"
CACHE_KNOBS = ("admit_min_sightings", "hot_min_sightings")  # read one by one in connector.py
"""`CacheConfig` fields a deployment may set (`kvfleet.<name>`); the rest keep kvfleet's
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
