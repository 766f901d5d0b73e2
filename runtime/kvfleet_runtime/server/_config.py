"""Replica configuration: a YAML or JSON file (the ConfigMap the operator writes) plus environment.

Precedence, lowest first: defaults, the file, `KVFLEET_REPLICA_*` environment variables (nested
fields with `__`: `KVFLEET_REPLICA_LIMITS__MAX_TOKENS=64`), then command-line flags. The file is
watched; a change to a live field (limits, batching, `cache.enabled`, `cache.t0_enabled`,
`cache.nvme_mode`) applies without a restart, a change to anything else is reported as needing
one, and a broken file keeps the last good config. A key that was renamed is refused with its new
name (`RENAMED_FIELDS`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvfleet_runtime.api import ListenerLimits
from kvfleet_runtime.cache import CacheTuning
from kvfleet_runtime.config.watch import MAX_CONFIG_BYTES, one_line_error, parse_config_text
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "LIVE_FIELDS",
    "RENAMED_FIELDS",
    "CacheSettings",
    "EngineSettings",
    "Limits",
    "ReplicaConfig",
    "load_config",
    "restart_fields",
]

ENV_PREFIX = "KVFLEET_REPLICA_"
CONFIG_ENV = "KVFLEET_REPLICA_CONFIG"
"""The config file's path (read by the CLI), not a config field."""
_SHIPPED = CacheTuning(num_t0_blocks=1)
"""The cache's shipped defaults (`CacheTuning`), where a replica setting takes one of them."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    max_prompt_tokens: int = Field(default=2048, ge=1)
    """Longer prompts are refused with 400 (the model's context is a hard limit too)."""
    max_tokens: int = Field(default=1024, ge=1)
    """Largest `max_tokens` a request may ask for."""
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    """Larger request bodies are refused with 413."""
    body_read_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """A request body must arrive within this time, or the request is refused with 408."""


class EngineSettings(_Strict):
    num_kv_blocks: int = Field(default=1024, ge=1)
    max_batch_size: int = Field(default=32, ge=1)
    max_waiting: int = Field(default=256, ge=1)
    max_tokens_per_step: int = Field(default=2048, ge=BLOCK_SIZE, multiple_of=BLOCK_SIZE)
    """Token budget of one engine step, shared by decode (one token per running sequence) and
    block-aligned prefill chunks; larger prefills long prompts faster, smaller keeps the other
    sequences' token streams smoother."""
    deterministic: bool = False
    """One-block prefill chunks: a cache hit equals a miss bitwise (same device and threads), at
    the price docs/replica.md measures; changes the cache key's attention id."""

    @model_validator(mode="after")
    def _budget_leaves_prefill_room(self) -> EngineSettings:
        if self.max_tokens_per_step < self.max_batch_size + BLOCK_SIZE:
            raise ValueError(f"max_tokens_per_step {self.max_tokens_per_step} must be at least "
                             f"max_batch_size {self.max_batch_size} + {BLOCK_SIZE}")
        return self


class CacheSettings(_Strict):
    enabled: bool = True
    """Off: every request is a miss and nothing is stored (live: the pools stay allocated)."""
    t0_enabled: bool = True
    """Live. T0 is the engine's KV itself (`engine.num_kv_blocks` blocks shared by in-flight
    sequences and cached prefixes): on, a prompt's blocks are cached where they are; off, the
    cache keeps none of them (stores go to T1 by copy). A fleet config's `tiers.t0_device` can
    turn it off too: T0 is used only when both say on."""
    num_t1_blocks: int = Field(default=2048, ge=0)
    admit_min_sightings: int = Field(default=_SHIPPED.admit_min_sightings, ge=1)
    """The shipped policy's default (`CacheTuning`'s, its one home): store on first sighting,
    stricter while the cache thrashes."""
    store_queue_max_entries: int = Field(default=64, ge=1)
    nvme_path: str = ""
    """T3: a directory on local NVMe (the chart mounts an emptyDir or a local PV); empty: no T3."""
    nvme_capacity_bytes: int = Field(default=0, ge=0)
    """Size of the T3 file; the chart's volume size bounds it. 0 with a path: no T3."""
    nvme_mode: Literal["off", "shadow", "on"] = "off"
    """Live. "shadow" writes and reads back without serving (measures); "on" serves. A fleet
    config, when the replica has one, decides instead (`tiers.nvme`, `tiers.nvme_shadow`)."""
    nvme_min_sightings: int = Field(default=2, ge=1)
    """T3 keeps only evicted blocks seen at least this often."""


class ReplicaConfig(_Strict):
    model_dir: str = ""
    model_id: str = ""
    """Served model name and the cache key's model id; defaults to the model folder's name."""
    expected_weights_digest: str = ""
    """When set (the CLI takes it from KVFLEET_WEIGHTS_DIGEST, which the chart and ModelRollout
    set), the replica refuses to start on weights with another digest."""
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    header_read_timeout_s: float = Field(default=ListenerLimits().header_timeout_s, gt=0,
                                         le=3600)
    """A request head must be complete within this (slow headers are cut), which is also how
    long an idle keep-alive connection stays open (`api.ListenerLimits`). Needs a restart."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_threads: int = Field(default=0, ge=0)
    """torch intra-op threads; 0 keeps torch's default. On a shared or small CPU, 1 is often
    much faster for a small model (no spinning thread team competing for cores)."""
    attn_impl: Literal["eager", "sdpa"] | None = None
    """Overrides the checkpoint's attention implementation (changes the cache key)."""
    pack_weights: bool = True
    """Serving bf16 on a CPU with bf16 instructions: run the matmuls from oneDNN-prepacked
    weights, q/k/v and gate/up fused (`Transformer.pack_linear_weights`); elsewhere ignored.
    Off: torch's plain `F.linear` per projection. Needs a restart."""
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    """Serving dtype of weights, activations and KV; default: the checkpoint's own (changes the
    cache key's kv_dtype)."""
    config_poll_interval_s: float = Field(default=2.0, gt=0)
    limits: Limits = Field(default_factory=Limits)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)


LIVE_FIELDS = frozenset({
    "limits", "engine.max_batch_size", "engine.max_waiting", "engine.max_tokens_per_step",
    "cache.enabled", "cache.t0_enabled", "cache.nvme_mode", "config_poll_interval_s",
})

RENAMED_FIELDS: dict[str, tuple[str, str]] = {
    "cache.num_t0_blocks": ("cache.t0_enabled", "true or false: T0 is the engine's KV, its size "
                                                "is engine.num_kv_blocks"),
}
"""Keys a config may still carry from an older release -> what replaced them."""


def restart_fields(old: ReplicaConfig, new: ReplicaConfig) -> list[str]:
    """Changed fields that only take effect after a restart."""
    changed = []
    for name, value in new:
        old_value = getattr(old, name)
        if isinstance(value, BaseModel):
            for sub, sub_value in value:
                if sub_value != getattr(old_value, sub) and (
                    name not in LIVE_FIELDS and f"{name}.{sub}" not in LIVE_FIELDS
                ):
                    changed.append(f"{name}.{sub}")
        elif value != old_value and name not in LIVE_FIELDS:
            changed.append(name)
    return changed


_STRING_FIELDS = {"model_id", "model_dir", "host", "expected_weights_digest"}


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        path = name[len(ENV_PREFIX):].lower().split("__")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, (int, float)) and path[-1] in _STRING_FIELDS:
            value = raw
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _check_renamed(source: Mapping[str, Any], where: str) -> None:
    """A key an older release knew: a clear error naming its replacement (not pydantic's
    "extra inputs are not permitted")."""
    for old, (new, hint) in RENAMED_FIELDS.items():
        section, name = old.split(".")
        sub = source.get(section)
        if isinstance(sub, Mapping) and name in sub:
            env_old = ENV_PREFIX + old.upper().replace(".", "__")
            env_new = ENV_PREFIX + new.upper().replace(".", "__")
            raise ValueError(f"invalid replica config: {old} ({where}) was replaced by {new} "
                             f"({hint}); in the environment, {env_old} by {env_new}")


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    content: bytes | str | None = None,
) -> ReplicaConfig:
    """Build the config; raises ValueError naming the bad file, field or value. `content`: the
    file's text as already read (the config watcher's), parsed instead of reading `path`."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = _read_config(Path(path)) if content is None else content
        except OSError as exc:
            raise ValueError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
        loaded = parse_config_text(text, f"cannot read config file {path}") or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(loaded).__name__}")
        data = loaded
        _check_renamed(data, f"in {path}")
    env = _env_overrides(os.environ if environ is None else environ)
    _check_renamed(env, "from the environment")
    data = _merge(data, env)
    data = _merge(data, overrides or {})
    _check_renamed(overrides or {}, "in the overrides")
    try:
        return ReplicaConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {_quoted(e.get('input'))})"
            for e in exc.errors()
        )
        raise ValueError(one_line_error(f"invalid replica config: {problems}")) from None


def _read_config(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(MAX_CONFIG_BYTES + 1)


def _quoted(value: Any, limit: int = 60) -> str:
    """A config value quoted in an error: its repr, cut (the value may be an expanded alias)."""
    text = repr(value) if not isinstance(value, dict | list) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
