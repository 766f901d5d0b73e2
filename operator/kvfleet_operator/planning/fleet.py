"""Home sets over the ready replica pods, and the fleet config the operator publishes.

Replica names are pod names; only pods that are Running, Ready and not being deleted get tenants
(a pod that is starting has an empty cache and cannot take traffic; one that is terminating is
leaving). The home sets come from the router's own rendezvous hashing (kvfleet_runtime.affinity),
so the operator and every router agree without talking.

That agreement is also why the published config carries no home sets: each is the rendezvous
top-k over the config's own replica list, which every router computes itself for a tenant the
config does not name. Listing them cost 2.8 of the 3.09 MiB of a 1,000-replica, 20,000-tenant
fleet's config (a ConfigMap holds 1 MiB) and told no reader anything. The operator still plans
them, for the status (`HomeSetSummary`: tenants per replica); `FleetConfig.home_sets` stays for
hand-written pins, which readers honour.

Planning is one sha256 per (tenant, replica) pair: 20 million at that size, ~10 s. A re-plan
after pods come and go starts from the previous plan (`plan_home_sets(..., previous=)`): a tenant
keeps its top k unless one of its homes left, and only a joining replica's weights are new, so one
pod joining or leaving costs one hash per tenant plus a full ranking for the ~k/n of tenants that
lost a home.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvfleet_operator.api import HomeSetSummary, KVCachePolicySpec
from kvfleet_operator.planning.tiers import TierPlan
from kvfleet_runtime.affinity import weighted_top_k
from kvfleet_runtime.config.fleet import (
    AdmissionSettings,
    AffinitySettings,
    FleetConfig,
    ReplicaEndpoint,
)
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
    tenants: tuple[str, ...] = ()
    """The tenants as given (what a re-plan compares to know nothing changed)."""
    weighted: dict[str, tuple[tuple[int, str], ...]] = field(
        default_factory=dict, repr=False, compare=False
    )
    """Each tenant's homes with their rendezvous weights, best first (for `previous=`)."""

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


def plan_home_sets(
    tenants: Sequence[str],
    replicas: Sequence[str],
    k: int,
    previous: HomeSetPlan | None = None,
) -> HomeSetPlan:
    """Rendezvous top-k homes of every tenant over the replicas (none when there are none).

    With `previous` (a plan of the same policy), what it already ranked is reused: the result is
    the same as planning from scratch, at a fraction of the cost when few replicas changed."""
    unique = tuple(sorted(set(replicas)))
    given = tuple(tenants)
    if previous is not None and (previous.tenants, previous.replicas, previous.k) == (
        given, unique, k
    ):
        return previous
    names = list(dict.fromkeys(given))
    weighted: dict[str, tuple[tuple[int, str], ...]] = {}
    if unique:
        old = previous.weighted if previous is not None and previous.k == k else {}
        had = set(previous.replicas) if old and previous is not None else set()
        now = set(unique)
        joined = [r for r in unique if r not in had]
        fresh: list[str] = []
        for tenant in names:
            kept = old.get(tenant)
            if kept is None or any(r not in now for _, r in kept) or (
                len(kept) < k and len(had) > len(kept)
            ):
                fresh.append(tenant)
            else:
                weighted[tenant] = kept
        if joined:
            gains = weighted_top_k(list(weighted), joined, k)
            for tenant, gained in gains.items():
                weighted[tenant] = tuple(heapq.nlargest(k, [*weighted[tenant], *gained]))
        for tenant, ranked in weighted_top_k(fresh, unique, k).items():
            weighted[tenant] = tuple(ranked)
        weighted = {tenant: weighted[tenant] for tenant in names}
    sets = {tenant: tuple(r for _, r in top) for tenant, top in weighted.items()}
    load: Counter[str] = Counter(r for homes in sets.values() for r in homes)
    return HomeSetPlan(sets, unique, k, dict(load), given, weighted)


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def build_fleet_config(
    policy: str,
    generation: int,
    spec: KVCachePolicySpec,
    tiers: TierPlan,
    pods: Sequence[ReplicaPod],
) -> FleetConfig:
    """The fleet config for a policy: what `fleet.yaml` in its ConfigMap says (no home sets:
    readers compute them from `replicas`, see the module docstring)."""
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
        platform_prefixes=tuple(spec.platform_prefixes),
    )
