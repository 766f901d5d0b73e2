"""KVCachePolicy: decide tiers from the fleet's shadow-mode NVMe measurement, plan home sets over
the ready replicas (from the policy's last plan, kept by `HomeSetPlans`), publish the fleet
ConfigMap, record the status."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvfleet_operator.api import (
    KVCachePolicySpec,
    KVCachePolicyStatus,
    TierDecisionStatus,
    TierMode,
)
from kvfleet_operator.constants import (
    FLEET_CONFIGMAP_SUFFIX,
    POLICY_PLURAL,
)
from kvfleet_operator.handlers._shell import (
    MAX_FLEET_CONFIG_BYTES,
    Clock,
    Manifest,
    _reconciled,
    _refuse,
    _wire,
    _write_status,
    pod_to_replica,
    utc_now,
)
from kvfleet_operator.kube import Kube
from kvfleet_operator.manifests import (
    fleet_configmap,
)
from kvfleet_operator.metrics import (
    read_nvme_reports,
)
from kvfleet_operator.planning import (
    HomeSetPlan,
    ReplicaPod,
    TierPlan,
    aggregate_nvme,
    build_fleet_config,
    decide_tiers,
    plan_home_sets,
    ready_replicas,
)
from kvfleet_operator.planning.conditions import set_condition
from kvfleet_operator.planning.rollout import format_time
from kvfleet_runtime.breakeven import GB
from kvfleet_runtime.config.fleet import dump_fleet_config
from kvfleet_runtime.wire import LOAD_PATH

ReadNvme = Callable[[Sequence[str]], list[dict[str, Any]]]
"""Replica load-report URLs -> their T3 read-bandwidth sections (`metrics.read_nvme_reports`)."""


def reconcile_policy(
    kube: Kube,
    namespace: str,
    name: str,
    now: Clock = utc_now,
    read_nvme: ReadNvme = read_nvme_reports,
    plans: HomeSetPlans | None = None,
) -> bool:
    """Decide tiers (with the fleet's shadow-mode NVMe measurement), plan home sets over the
    ready replicas, publish the fleet ConfigMap, record the status. Returns whether anything
    was written. `plans`: the policies' last plans (main passes the operator's; without it the
    plan is made from scratch)."""
    kept = HomeSetPlans(max_plans=1) if plans is None else plans
    return _reconciled(
        namespace,
        name,
        lambda: _reconcile_policy_once(kube, namespace, name, now, read_nvme, kept),
        False,
    )


def _fleet_measurement(
    spec: KVCachePolicySpec, pods: Sequence[ReplicaPod], read_nvme: ReadNvme
) -> tuple[dict[str, float], dict[str, str]]:
    """The fleet's measured NVMe bandwidth (shadow mode, p95 concurrency), when the tier is
    Auto without a figure in the spec; ({}, {}) when there is nothing measured yet."""
    nvme = spec.tiers.nvme
    if nvme.mode is not TierMode.AUTO or nvme.measured_bandwidth_g_bps is not None:
        return {}, {}
    urls = [f"http://{p.ip}:{spec.replica_port}{LOAD_PATH}" for p in ready_replicas(pods) if p.ip]
    measured = aggregate_nvme(read_nvme(urls))
    if measured is None:
        return {}, {}
    return {"nvme": measured.bytes_per_s}, {"nvme": measured.source}


def policy_spec(obj: Manifest) -> KVCachePolicySpec:
    """The spec, refused (ValidationError, ValueError) when the models or the tier arithmetic
    refuse it: before any pod is read."""
    spec = KVCachePolicySpec.model_validate(obj.get("spec") or {})
    decide_tiers(spec)
    return spec


def policy_status(
    old: KVCachePolicyStatus,
    generation: int,
    tiers: TierPlan,
    homes: HomeSetPlan,
    num_ready: int,
    published: Published,
    stamp: str,
) -> KVCachePolicyStatus:
    """The status of a policy reconciled: its tier decisions, home sets and Ready=True."""
    message = (
        f"{num_ready} ready replica(s), {len(homes.home_sets)} tenant(s), "
        f"tiers {tiers.summary}; published to ConfigMap {published.config_map}"
    )
    return KVCachePolicyStatus(
        observed_generation=generation,
        break_even_g_bps=round(tiers.break_even_bytes_per_s / GB, 4),
        break_even=f"{tiers.break_even_bytes_per_s / GB:.3g} GB/s",
        tiers_summary=tiers.summary,
        tiers=[
            TierDecisionStatus(
                tier=d.tier,
                medium=d.medium,
                enabled=d.enabled,
                reason=d.reason,
                profile_g_bps=_gbps(d.profile_bytes_per_s),
                measured_g_bps=_gbps(d.measured_bytes_per_s),
                measurement=d.measurement,
            )
            for d in tiers.decisions
        ],
        home_sets=homes.summary(published.config_map, published.text),
        conditions=set_condition(
            old.conditions, "Ready", True, "Reconciled", message, stamp, generation
        ),
    )


def _reconcile_policy_once(
    kube: Kube, namespace: str, name: str, now: Clock, read_nvme: ReadNvme, plans: HomeSetPlans
) -> bool:
    obj = kube.get_custom(namespace, POLICY_PLURAL, name)
    if obj is None:
        return False
    try:
        spec = policy_spec(obj)
    except (ValidationError, ValueError) as exc:
        what = f"invalid KVCachePolicy {namespace}/{name}"
        raise _refuse(
            kube, namespace, POLICY_PLURAL, obj, now, "InvalidSpec", str(exc), what
        ) from exc
    pods = [pod_to_replica(p) for p in kube.list_pods(namespace, spec.selector.match_labels)]
    measured, sources = _fleet_measurement(spec, pods, read_nvme)
    tiers = decide_tiers(spec, measured, sources)
    ready = ready_replicas(pods)
    published = _publish_fleet_config(kube, namespace, obj, spec, tiers, pods, now)
    # Planned after the publish: the config does not need the plan (readers rank tenants
    # themselves), only the status does, and a first plan of a large fleet takes seconds.
    homes = plans.plan(
        f"{namespace}/{name}", tuple(spec.tenants), tuple(p.name for p in ready), spec.affinity.k
    )
    old = KVCachePolicyStatus.model_validate(obj.get("status") or {})
    generation = int(obj["metadata"].get("generation") or 0)
    status = policy_status(
        old, generation, tiers, homes, len(ready), published, format_time(now())
    )
    return _write_status(kube, namespace, POLICY_PLURAL, obj, _wire(status)) or published.wrote


@dataclass(frozen=True, slots=True)
class Published:
    """Where the fleet config went, what it says, and whether this call wrote it."""

    config_map: str
    text: str
    wrote: bool


def _publish_fleet_config(
    kube: Kube,
    namespace: str,
    obj: Manifest,
    spec: KVCachePolicySpec,
    tiers: TierPlan,
    pods: Sequence[ReplicaPod],
    now: Clock,
) -> Published:
    """The fleet config in the policy's ConfigMap (written only when it changed); a config over
    what a ConfigMap holds refuses the policy."""
    meta = obj["metadata"]
    name = meta["name"]
    generation = int(meta.get("generation") or 0)
    config = build_fleet_config(f"{namespace}/{name}", generation, spec, tiers, pods)
    text = dump_fleet_config(config)
    cm_name = spec.config_map_name or f"{name}{FLEET_CONFIGMAP_SUFFIX}"
    size = len(text.encode("utf-8"))
    if size > MAX_FLEET_CONFIG_BYTES:
        message = (
            f"fleet config is {size} bytes, over the {MAX_FLEET_CONFIG_BYTES} a ConfigMap holds; "
            f"{len(config.replicas)} ready replicas (~200 bytes each; tenants cost nothing)"
        )
        what = f"{namespace}/{name}"
        raise _refuse(kube, namespace, POLICY_PLURAL, obj, now, "ConfigTooLarge", message, what)
    wrote = False
    live = kube.get_configmap_data(namespace, cm_name)
    if live is None or live.get("fleet.yaml") != text:
        kube.apply(fleet_configmap(namespace, cm_name, name, meta["uid"], text))
        wrote = True
    return Published(cm_name, text, wrote)


def _gbps(bytes_per_s: float | None) -> float | None:
    return None if bytes_per_s is None else round(bytes_per_s / GB, 4)


MAX_HOME_SET_PLANS = 64
"""Policies whose last plan is kept (least recently reconciled dropped first): one plan of
20,000 tenants is ~10 MB."""


class HomeSetPlans:
    """Each policy's last home-set plan, so a timer tick of an unchanged policy rehashes nothing
    and a pod joining or leaving re-ranks only what it changes (20 million pairs, ~10 s, for
    20,000 tenants over 1,000 replicas from scratch; ~0.1 s for one pod). The operator keeps
    one (`main.Tracked`); thread-safe, as kopf runs sync handlers in threads."""

    def __init__(self, max_plans: int = MAX_HOME_SET_PLANS) -> None:
        self.max_plans = max_plans
        self._plans: OrderedDict[str, HomeSetPlan] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, policy: str, tenants: tuple[str, ...], replicas: tuple[str, ...],
             k: int) -> HomeSetPlan:
        """The policy's plan, from its last one."""
        with self._lock:
            previous = self._plans.get(policy)
        plan = plan_home_sets(tenants, replicas, k, previous=previous)
        with self._lock:
            self._plans[policy] = plan
            self._plans.move_to_end(policy)
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        return plan

    def forget(self, namespace: str, name: str) -> None:
        """A deleted policy's last plan goes with it."""
        with self._lock:
            self._plans.pop(f"{namespace}/{name}", None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)


