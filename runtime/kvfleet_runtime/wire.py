"""The wire between kvfleet's processes: header names, paths, the load report, shared constants.

One home for what a replica, the router, a peer and the operator must agree on. A leaf module: it
imports nothing of kvfleet (not even lazily), so every package (the torch-free router and operator
included) can use it.

Replica load protocol: `GET {replica}{LOAD_PATH}` answers JSON

    {"ready": true, "kv_occupancy": 0.42, "kv_capacity_tokens": 65536,
     "num_waiting": 3, "num_running": 8, "queue_delay_s": 0.12,
     "cache_key": {"model_id", "weights_digest", "kv_dtype", "rope_config_hash", "attn_impl_id"},
     "tokenizer": "byte-v1"}

(a replica may add fields for reports, e.g. "name" and "t2"; readers ignore what they do not know).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "ASSERTION_HEADER",
    "BLOCK_SIZE",
    "BYTE_BOS_ID",
    "BYTE_TOKENIZER_ID",
    "CACHE_KEY_FIELDS",
    "CACHE_SALT_FIELD",
    "ENGINES",
    "HELD_PATH",
    "LEASE_PATH",
    "LOAD_PATH",
    "MAX_CACHE_SALT_CHARS",
    "PLATFORM_TENANT",
    "RELEASE_PATH",
    "T2_PATH",
    "TENANT_HEADER",
    "Engine",
    "LoadReport",
    "parse_load_report",
]

BLOCK_SIZE = 16
"""Tokens per KV block: the paged-attention block, the prefix cache's block and the unit of chain
hashes, hint indexes and T2 transfers. A match ends on a block boundary (1,507 tokens -> 1,504)."""

PLATFORM_TENANT = "__platform__"
"""Tenant component of keys for allow-listed platform prefixes, the only cross-tenant sharing."""

TENANT_HEADER = "X-Kvfleet-Tenant"
"""The tenant a request belongs to: set by the router on proxied requests, and by a replica on the
T2 requests it makes to peers."""

ASSERTION_HEADER = "X-Kvfleet-Tenant-Assertion"
"""The router's signed tenant assertion, sent with `TENANT_HEADER` on every proxied request
(`kvfleet_runtime.auth`: format and checks)."""

CACHE_SALT_FIELD = "cache_salt"
"""vLLM's request field that salts its block hash (T0) and names the tenant to kvfleet's vLLM
connector. The router overwrites it in every body it proxies to a vLLM replica with the
authenticated tenant's salt (`kvfleet_runtime.auth.cache_salt`); a client's own is replaced."""

MAX_CACHE_SALT_CHARS = 128
"""vLLM 0.33 refuses a longer `cache_salt` (and one with '@', '/', '\\' or NUL; tenant names
never contain those)."""

Engine = Literal["kvfleet", "vllm"]
ENGINES: tuple[Engine, ...] = get_args(Engine)
"""What runs in a replica pod (the chart's `replica.engine`): kvfleet's own replica runtime, or
`vllm serve` with kvfleet's KV connector. The fleet config names it per replica; the router
salts vLLM requests and probes vLLM's `/health`, the operator reads vLLM's hit-rate series."""

LOAD_PATH = "/fleet/v1/load"
"""A replica's load report (the router polls it; schema above)."""

T2_PATH = "/kv/v1/blocks"
"""A peer's block export (authenticated T2 transfer)."""

HELD_PATH = "/kv/v1/held"
"""A peer's held-blocks probe (which of these chain hashes do you hold?)."""

LEASE_PATH = "/kv/v1/lease"
"""T2 over NIXL, the control request: a peer's run pinned for a short lease, answered with its
descriptors and the serving agent's metadata (`fleet.t2_serve.lease_routes`)."""

RELEASE_PATH = "/kv/v1/lease/release"
"""T2 over NIXL: the lease's end (`{"held": true}` when it was still live: the bytes read are
the run's)."""

BYTE_TOKENIZER_ID = "byte-v1"
"""The byte tokenizer's name in load reports (the generated demo model's: ids 0-255 are UTF-8
bytes, 256 is BOS, `BYTE_BOS_ID`). A model folder's own tokenizer is named "hf-sha256:" + a digest
of its files; the router tokenizes text only with a tokenizer of the reported name."""

BYTE_BOS_ID = 256

CACHE_KEY_FIELDS = ("model_id", "weights_digest", "kv_dtype", "rope_config_hash", "attn_impl_id")
"""The cache key's fields in a load report: all but the tenant, in `CacheKey` order."""


@dataclass(slots=True, frozen=True)
class LoadReport:
    ready: bool
    kv_occupancy: float = 0.0
    kv_capacity_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    queue_delay_s: float = 0.0
    cache_key: tuple[str, str, str, str, str] | None = None
    """(model_id, weights_digest, kv_dtype, rope_config_hash, attn_impl_id), all but the tenant:
    `CacheKey(tenant, *report.cache_key)` is a tenant's key (built by the reader: the cache
    package imports this module, so this one never imports the cache)."""
    tokenizer: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON a replica answers on LOAD_PATH."""
        return {
            "ready": self.ready,
            "kv_occupancy": self.kv_occupancy,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "queue_delay_s": self.queue_delay_s,
            "cache_key": None
            if self.cache_key is None
            else dict(zip(CACHE_KEY_FIELDS, self.cache_key, strict=True)),
            "tokenizer": self.tokenizer,
        }


def parse_load_report(data: Any) -> LoadReport:
    """Validate a load report; raises ValueError on a malformed one."""
    if not isinstance(data, dict):
        raise ValueError(f"load report must be an object, got {type(data).__name__}")
    occupancy = float(data.get("kv_occupancy", 0.0))
    if not 0.0 <= occupancy <= 1.5:
        raise ValueError(f"kv_occupancy out of range: {occupancy}")
    raw_key = data.get("cache_key")
    key = None
    if isinstance(raw_key, dict) and all(isinstance(raw_key.get(f), str) for f in CACHE_KEY_FIELDS):
        key = (
            raw_key["model_id"],
            raw_key["weights_digest"],
            raw_key["kv_dtype"],
            raw_key["rope_config_hash"],
            raw_key["attn_impl_id"],
        )
    return LoadReport(
        ready=bool(data.get("ready", True)),
        kv_occupancy=occupancy,
        kv_capacity_tokens=max(0, int(data.get("kv_capacity_tokens", 0))),
        num_waiting=max(0, int(data.get("num_waiting", 0))),
        num_running=max(0, int(data.get("num_running", 0))),
        queue_delay_s=max(0.0, float(data.get("queue_delay_s", 0.0))),
        cache_key=key,
        tokenizer=str(data.get("tokenizer", "")),
    )
