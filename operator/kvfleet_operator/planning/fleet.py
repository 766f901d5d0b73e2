"""Home sets over the ready replica pods, and the fleet config the operator publishes.

Replica names are pod names; only pods that are Running, Ready and not being deleted get tenants
(a pod that is starting has an empty cache and cannot take traffic; one that is terminating is
leaving). The home sets come from the router's own rendezvous hashing (kvfleet_runtime.routing),
so the operator and every router agree without talking.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvfleet_operator.api import HomeSetSummary, KVCachePolicySpec
from kvfleet_operator.planning.tiers import TierPlan
from kvfleet_runtime.fleetconfig import (
    AdmissionSettings,
    AffinitySettings,
    FleetConfig,
    ReplicaEndpoint,
)
from kvfleet_runtime.routing import home_sets
from kvfleet_runtime.wire import Engine

__all__ = [
    "HomeSetPlan",
    "ReplicaPod",
    "build_fleet_config",
    "config_hash",
    "plan_home_sets",
    "ready_replicas",
]


@dataclass(frozen=True, slots=True)
class ReplicaPod:
    name: str
    ip: str
    ready: bool
    deleting: bool = False
    weights_digest: str = ""
    engine: Engine = "kvfleet"
    peer_port: int | None = None
    """A vLLM pod's connector T2 port (`kvfleet.dev/peer-port`); None: T2 is on the API port."""


@dataclass(frozen=True, slots=True)
class HomeSetPlan:
    home_sets: dict[str, tuple[str, ...]]
    replicas: tuple[str, ...]
    k: int
    tenants_per_replica: dict[str, int]

    def summary(self, config_map: str, text: str) -> HomeSetSummary:
        counts = [self.tenants_per_replica.get(r, 0) for r in self.replicas]
        return HomeSetSummary(
            num_tenants=len(self.home_sets),
            num_replicas=len(self.replicas),
            k=self.k,
            min_tenants_per_replica=min(counts, default=0),
            max_tenants_per_replica=max(counts, default=0),
            config_map=config_map,
            config_hash=config_hash(text),
        )


def ready_replicas(pods: Iterable[ReplicaPod]) -> list[ReplicaPod]:
    """The pods that may be home to tenants, by name."""
    return sorted((p for p in pods if p.ready and not p.deleting and p.ip), key=lambda p: p.name)


def plan_home_sets(tenants: Sequence[str], replicas: Sequence[str], k: int) -> HomeSetPlan:
    """Rendezvous top-k homes of every tenant over the replicas (none when there are none)."""
    unique = tuple(sorted(set(replicas)))
    names = list(dict.fromkeys(tenants))
    sets = home_sets(names, unique, k) if unique else {}
    load: Counter[str] = Counter(r for homes in sets.values() for r in homes)
    return HomeSetPlan(sets, unique, k, dict(load))


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def build_fleet_config(
    policy: str,
    generation: int,
    spec: KVCachePolicySpec,
    tiers: TierPlan,
    pods: Sequence[ReplicaPod],
    homes: HomeSetPlan,
) -> FleetConfig:
    """The fleet config for a policy: what `fleet.yaml` in its ConfigMap says."""
    endpoints = tuple(
        ReplicaEndpoint(
            name=p.name,
            url=f"http://{p.ip}:{spec.replica_port}",
            weights_digest=p.weights_digest or None,
            ready=True,
            engine=p.engine,
            peer_url=None if p.peer_port is None else f"http://{p.ip}:{p.peer_port}",
        )
        for p in ready_replicas(pods)
    )
    return FleetConfig(
        policy=policy,
        generation=generation,
        model_id=spec.model.model_id or spec.model.profile,
        tiers=tiers.toggles,
        admission=AdmissionSettings(
            min_sightings=spec.admission.min_sightings,
            hot_sightings=spec.admission.hot_sightings,
            pin_max_tokens=spec.admission.pin_max_tokens,
            store_queue_size=spec.admission.store_queue_size,
            thrash_ratio=spec.admission.thrash_ratio,
        ),
        affinity=AffinitySettings(
            k=spec.affinity.k, occupancy_threshold=spec.affinity.occupancy_threshold
        ),
        recompute_s_per_token=tiers.recompute_s_per_token,
        replicas=endpoints,
        home_sets=homes.home_sets,
        platform_prefixes=tuple(spec.platform_prefixes),
    )
