"""The fronts `kvfleet bench fronts` knows: adding one is one `Front` entry here.

A front is a process given the two replicas (name -> URL), their KV event endpoints, the model
folder, the tenants' API keys and a port; it must answer `health` with 200 once it routes. The
runner starts each front cold for every run (its own state learned from that run alone) after
the replicas' prefix caches were reset.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FRONTS", "Front", "FrontSetup", "select"]


@dataclass(frozen=True, slots=True)
class FrontSetup:
    """What every front is started from."""

    port: int
    replicas: Mapping[str, str]
    """Replica name -> base URL."""
    events: Mapping[str, str]
    """Replica name -> its KV events' ZMQ endpoint."""
    model: Path
    work: Path
    keys: Mapping[str, str]
    """API key -> tenant."""
    kvfleet_python: str
    fronts_bin: Callable[[str], Path]
    """An env's bin folder by name (scripts/fronts-env.sh)."""
    recompute_s_per_token: float


@dataclass(frozen=True, slots=True)
class Front:
    name: str
    command: Callable[[FrontSetup], list[str]]
    env: Callable[[FrontSetup], dict[str, str]] = lambda setup: {}
    health: str = "/health"
    decision_histogram: str | None = None
    """A histogram on the front's own /metrics (its port) of the time it takes to choose."""
    settle_s: float = 0.0
    """Waited after the first healthy answer (a front that polls loads before routing well)."""
    metrics_offset: int = 0
    """Where `decision_histogram` is: the front's port plus this (a gateway's picker exports its
    metrics beside the gateway's listener)."""


ROUTER_SECRET = "fronts-bench-router-secret"


def _kvfleet_files(setup: FrontSetup) -> tuple[Path, Path]:
    """The fleet config and the keys file both kvfleet fronts read."""
    from kvfleet_runtime.config.fleet import FleetConfig, ReplicaEndpoint, dump_fleet_config

    config = setup.work / "fleet.json"
    # default homes: the config names the replicas and the recompute cost, no home sets
    config.write_text(dump_fleet_config(FleetConfig(
        generation=1, recompute_s_per_token=setup.recompute_s_per_token,
        replicas=tuple(ReplicaEndpoint(name=n, url=u, engine="vllm")
                       for n, u in setup.replicas.items()))))
    keys = setup.work / "keys.json"
    tenants: dict[str, list[str]] = {}
    for key, tenant in setup.keys.items():
        tenants.setdefault(tenant, []).append(key)
    keys.write_text(json.dumps({"tenants": tenants}))
    return config, keys


def _picker_args(setup: FrontSetup) -> list[str]:
    config, keys = _kvfleet_files(setup)
    return ["--keys", str(keys), "--fleet-config", str(config), "--tokenizer", str(setup.model),
            "--poll-interval-s", "0.5", "--log-level", "WARNING",
            *[a for n, e in setup.events.items() for a in ("--kv-events", f"{n}={e}")]]


def _kvfleet_router(setup: FrontSetup) -> list[str]:
    return [setup.kvfleet_python, "-m", "kvfleet_runtime.cli", "router", "--port",
            str(setup.port), "--host", "127.0.0.1", *_picker_args(setup)]


def _kvfleet_epp(setup: FrontSetup) -> list[str]:
    """`kvfleet epp` behind a real Envoy configured as a GIE gateway (kvfleet_lab.gateway)."""
    endpoints = [u.split("://", 1)[1] for u in setup.replicas.values()]
    return [setup.kvfleet_python, "-m", "kvfleet_lab.gateway", "--port", str(setup.port),
            "--metrics-port", str(setup.port + 1), "--work", str(setup.work / "gateway"),
            *[a for e in endpoints for a in ("--endpoint", e)], "--", *_picker_args(setup)]


def _vllm_router(policy: str) -> Callable[[FrontSetup], list[str]]:
    def command(setup: FrontSetup) -> list[str]:
        return [str(setup.fronts_bin("vllm-router") / "vllm-router"), "--host", "127.0.0.1",
                "--port", str(setup.port), "--worker-urls", *setup.replicas.values(),
                "--policy", policy, "--prometheus-port", str(setup.port + 1),
                "--prometheus-host", "127.0.0.1", "--log-level", "warning"]
    return command


def _sglang_router(policy: str) -> Callable[[FrontSetup], list[str]]:
    def command(setup: FrontSetup) -> list[str]:
        return [str(setup.fronts_bin("sglang-router") / "python"), "-m",
                "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(setup.port),
                "--worker-urls", *setup.replicas.values(), "--policy", policy,
                "--prometheus-port", str(setup.port + 1), "--prometheus-host", "127.0.0.1"]
    return command


FRONTS: dict[str, Front] = {f.name: f for f in (
    Front("kvfleet-router", _kvfleet_router,
          env=lambda setup: {"KVFLEET_ROUTER_SECRET": ROUTER_SECRET}, health="/readyz",
          decision_histogram="kvfleet_router_decision_seconds", settle_s=2.0),
    Front("kvfleet-epp", _kvfleet_epp,
          env=lambda setup: {"KVFLEET_ROUTER_SECRET": ROUTER_SECRET}, health="/health",
          decision_histogram="kvfleet_router_decision_seconds", settle_s=2.0,
          metrics_offset=1),
    Front("vllm-router-cache-aware", _vllm_router("cache_aware")),
    Front("vllm-router-round-robin", _vllm_router("round_robin")),
    Front("sglang-router-cache-aware", _sglang_router("cache_aware")),
)}
"""Every front, in the default order (kvfleet's first)."""


def select(text: str | None) -> tuple[str, ...]:
    """`--fronts a,b` -> names in that order; None: all. ValueError names the known ones."""
    if text is None:
        return tuple(FRONTS)
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in FRONTS]
    if unknown or not names:
        raise ValueError(f"unknown or no front(s) {unknown}; known: {', '.join(FRONTS)}")
    return names
