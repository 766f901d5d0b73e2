"""Handler bodies: read the object and the world -> call a pure planner -> apply -> write status.

`main.py` holds the kopf decorators; each calls one function here. Each of those is a shell:
`_reconciled` (the one wrapper of a reconcile: conflicts, a namespace going away, API errors)
around a read, pure helpers that turn what was read into a status (`policy_spec`,
`policy_status`, `observations`, `refused_status`: tested without a cluster), and the writes.
Every function is level-triggered: it re-reads the object (never trusts a cached body), so
running it twice, or after a restart, does the same thing; the status is written with the
resourceVersion that was read, so a concurrent change (409) makes it start over from a fresh
read: at once a few times, then through kopf (`TemporaryError(delay=...)`), never by sleeping in
the handler.

An object the operator cannot act on (a spec the models refuse, a target without the named
container) gets a `Ready=False` condition saying why (`_refuse`, for either kind), written once
(an unchanged status is never re-written), and a `kopf.PermanentError`: `schedule.run_scheduled`
then stops ticking it until the object changes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import kopf
from pydantic import ValidationError

from kvfleet_operator.api import (
    TERMINAL_PHASES,
    KVCachePolicySpec,
    KVCachePolicyStatus,
    ModelRolloutSpec,
    ModelRolloutStatus,
    RolloutPhase,
    TierDecisionStatus,
    TierMode,
)
from kvfleet_operator.constants import (
    ENGINE_ANNOTATION,
    FLEET_CONFIGMAP_SUFFIX,
    PEER_PORT_ANNOTATION,
    POLICY_PLURAL,
    ROLLOUT_PLURAL,
    TRACK_LABEL,
    WEIGHTS_DIGEST_ANNOTATION,
)
from kvfleet_operator.kube import Conflict, Kube, KubeError, NamespaceTerminating, retry_on_conflict
from kvfleet_operator.manifests import (
    canary_deployment,
    canary_name,
    fleet_configmap,
    template_version,
    with_version,
)
from kvfleet_operator.metrics import (
    DeploymentPods,
    MetricReading,
    ReadStats,
    read_cache_stats,
    read_hit_rates,
    read_nvme_reports,
)
from kvfleet_operator.planning import (
    DeleteCanary,
    EnsureCanary,
    Event,
    HomeSetPlan,
    Observations,
    ReplicaPod,
    ScaleTarget,
    SetTargetVersion,
    TierPlan,
    Workload,
    advance,
    aggregate_nvme,
    build_fleet_config,
    decide_tiers,
    plan_home_sets,
    ready_replicas,
)
from kvfleet_operator.planning.conditions import set_condition
from kvfleet_operator.planning.rollout import format_time
from kvfleet_runtime.auth import read_operator_token
from kvfleet_runtime.breakeven import GB
from kvfleet_runtime.config.fleet import dump_fleet_config
from kvfleet_runtime.wire import ENGINES, LOAD_PATH, Engine

__all__ = [
    "PostEvent",
    "Published",
    "engine_of",
    "observations",
    "peer_port_of",
    "pod_to_replica",
    "policy_spec",
    "policy_status",
    "reconcile_policy",
    "reconcile_rollout",
    "refused_status",
    "workload_of",
]

Manifest = dict[str, Any]
PostEvent = Callable[[Manifest, Event], None]
Clock = Callable[[], datetime]
_TRANSIENT_DELAY_S = 5.0
# Conflicts that outlived the immediate re-reads: someone else writes the object right now.
CONFLICT_DELAY_S = 1.0
# A ConfigMap holds at most 1 MiB; keep room for its metadata.
MAX_FLEET_CONFIG_BYTES = 1_000_000

log = logging.getLogger(__name__)


def utc_now() -> datetime:
    return datetime.now(UTC)


def post_kopf_event(body: Manifest, event: Event) -> None:
    kopf.event(cast(Any, body), type=event.type, reason=event.reason, message=event.message[:1000])


def _wire(model: Any) -> Manifest:
    data: Manifest = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return data


def _with_nulls(new: Manifest, old: Manifest) -> Manifest:
    """A merge patch that also deletes the fields the new status no longer has."""
    patch = dict(new)
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


# ---------------------------------------------------------------------------------------------
# observation helpers (pure, tested without a cluster)


def pod_to_replica(pod: Manifest) -> ReplicaPod:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )
    return ReplicaPod(
        name=meta["name"],
        ip=status.get("podIP") or "",
        ready=ready,
        deleting=meta.get("deletionTimestamp") is not None,
        weights_digest=(meta.get("annotations") or {}).get(WEIGHTS_DIGEST_ANNOTATION, ""),
        engine=engine_of(meta),
        peer_port=peer_port_of(meta),
    )


def engine_of(meta: Manifest) -> Engine:
    """The engine a pod (or a pod template) names in its metadata; kvfleet when it names none
    or one the operator does not know."""
    value = (meta.get("annotations") or {}).get(ENGINE_ANNOTATION)
    return next((e for e in ENGINES if e == value), "kvfleet")


def peer_port_of(meta: Manifest) -> int | None:
    """The port a vLLM pod's connector serves T2 on (`kvfleet.dev/peer-port`); None for a
    kvfleet pod (T2 is on its API port) or an annotation that is not a TCP port, whose peers then
    use the API URL and fail over to recompute rather than guess a port."""
    if engine_of(meta) != "vllm":
        return None
    value = (meta.get("annotations") or {}).get(PEER_PORT_ANNOTATION)
    if not isinstance(value, str) or not value.isdecimal():
        return None
    port = int(value)
    return port if 0 < port < 65536 else None


def workload_of(deployment: Manifest, container: str | None, env_name: str) -> Workload:
    meta, spec, status = deployment["metadata"], deployment["spec"], deployment.get("status") or {}
    digest, image = template_version(spec["template"], container, env_name)
    return Workload(
        replicas=int(spec.get("replicas", 1)),
        ready_replicas=int(status.get("readyReplicas") or 0),
        updated_replicas=int(status.get("updatedReplicas") or 0),
        weights_digest=digest,
        image=image,
        settled=int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0),
    )


def _transient(exc: KubeError) -> kopf.TemporaryError:
    delay = CONFLICT_DELAY_S if isinstance(exc, Conflict) else _TRANSIENT_DELAY_S
    return kopf.TemporaryError(str(exc), delay=delay)


R = TypeVar("R")


def _reconciled(namespace: str, name: str, once: Callable[[], R], nothing: R) -> R:
    """Run one reconcile from a fresh read, again at once on a conflict (a few times); `nothing`
    when the namespace is being deleted (its objects go with it); any other API error a
    `kopf.TemporaryError`, so that kopf retries after a delay."""
    try:
        return retry_on_conflict(once)
    except NamespaceTerminating as exc:
        log.debug(
            "%s/%s: namespace going away, nothing to do (NamespaceTerminating): %s",
            namespace,
            name,
            exc,
        )
        return nothing
    except KubeError as exc:
        raise _transient(exc) from exc


S = TypeVar("S", KVCachePolicyStatus, ModelRolloutStatus)


def refused_status(status: S, generation: int, reason: str, message: str, stamp: str) -> S:
    """The status of an object the operator cannot act on: `Ready=False` saying why, and
    nothing else changed (a rollout's phase and workload stay as they are). Refusing twice for
    the same reason gives the same status (the condition's time moves only when its value
    does), so it is written once."""
    conditions = set_condition(
        status.conditions, "Ready", False, reason, message[:2000], stamp, generation
    )
    return status.model_copy(update={"observed_generation": generation, "conditions": conditions})


def _refuse(
    kube: Kube,
    namespace: str,
    plural: str,
    obj: Manifest,
    now: Clock,
    reason: str,
    message: str,
    what: str,
) -> kopf.PermanentError:
    """Write the refusal (`refused_status`) and return the error to raise: `schedule` stops
    ticking the object until it changes."""
    meta = obj["metadata"]
    generation = int(meta.get("generation") or 0)
    stamp, wire = format_time(now()), obj.get("status") or {}
    refused: KVCachePolicyStatus | ModelRolloutStatus
    if plural == POLICY_PLURAL:
        old_policy = KVCachePolicyStatus.model_validate(wire)
        refused = refused_status(old_policy, generation, reason, message, stamp)
    else:
        old_rollout = ModelRolloutStatus.model_validate(wire)
        refused = refused_status(old_rollout, generation, reason, message, stamp)
    _write_status(kube, namespace, plural, obj, _wire(refused))
    return kopf.PermanentError(f"{what}: {message}")


def _write_status(kube: Kube, namespace: str, plural: str, obj: Manifest, new: Manifest) -> bool:
    old: Manifest = obj.get("status") or {}
    if new == old:
        return False
    meta = obj["metadata"]
    kube.patch_status(
        namespace, plural, meta["name"], _with_nulls(new, old), meta["resourceVersion"]
    )
    return True


# ---------------------------------------------------------------------------------------------
# KVCachePolicy


ReadNvme = Callable[[Sequence[str]], list[dict[str, Any]]]
"""Replica load-report URLs -> their T3 read-bandwidth sections (`metrics.read_nvme_reports`)."""


def reconcile_policy(
    kube: Kube,
    namespace: str,
    name: str,
    now: Clock = utc_now,
    read_nvme: ReadNvme = read_nvme_reports,
) -> bool:
    """Decide tiers (with the fleet's shadow-mode NVMe measurement), plan home sets over the
    ready replicas, publish the fleet ConfigMap, record the status. Returns whether anything
    was written."""
    return _reconciled(
        namespace,
        name,
        lambda: _reconcile_policy_once(kube, namespace, name, now, read_nvme),
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
    kube: Kube, namespace: str, name: str, now: Clock, read_nvme: ReadNvme
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
    homes = _home_sets(
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


_PLANS: OrderedDict[str, HomeSetPlan] = OrderedDict()
_PLAN_LOCK = threading.Lock()
# Policies whose last plan is kept (least recently reconciled dropped first): one plan of
# 20,000 tenants is ~10 MB.
MAX_HOME_SET_PLANS = 64


def _home_sets(
    policy: str, tenants: tuple[str, ...], replicas: tuple[str, ...], k: int
) -> HomeSetPlan:
    """The policy's plan, from its last one: a timer tick of an unchanged policy rehashes
    nothing, and a pod joining or leaving re-ranks only what it changes (20 million pairs,
    ~10 s, for 20,000 tenants over 1,000 replicas from scratch; ~0.1 s for one pod)."""
    with _PLAN_LOCK:
        previous = _PLANS.get(policy)
    plan = plan_home_sets(tenants, replicas, k, previous=previous)
    with _PLAN_LOCK:
        _PLANS[policy] = plan
        _PLANS.move_to_end(policy)
        while len(_PLANS) > MAX_HOME_SET_PLANS:
            _PLANS.popitem(last=False)
    return plan


def forget_home_sets(namespace: str, name: str) -> None:
    """A deleted policy's last plan goes with it."""
    with _PLAN_LOCK:
        _PLANS.pop(f"{namespace}/{name}", None)


def num_home_set_plans() -> int:
    with _PLAN_LOCK:
        return len(_PLANS)


# ---------------------------------------------------------------------------------------------
# ModelRollout


def reconcile_rollout(
    kube: Kube,
    namespace: str,
    name: str,
    now: Clock = utc_now,
    post_event: PostEvent = post_kopf_event,
    read_stats: ReadStats = read_cache_stats,
) -> float | None:
    """One evaluation of the rollout state machine; returns when to look again (None: on change
    only). Actions are applied before the status that asks for them is written. `read_stats`:
    the `/cache/stats` fallback's read (main passes a `CacheStatsReader`, which backs off pods
    that do not answer)."""
    return _reconciled(
        namespace,
        name,
        lambda: _reconcile_rollout_once(kube, namespace, name, now, post_event, read_stats),
        None,
    )


def _operator_token() -> bytes | None:
    """The operator token for the replicas' `/cache/stats` (None: the fallback goes without and
    secured replicas refuse it, so the readings come from Prometheus alone)."""
    try:
        return read_operator_token()
    except ValueError as exc:
        log.warning("no operator token for /cache/stats: %s", exc)
        return None


def _pods(kube: Kube, namespace: str, name: str, deployment: Manifest | None,
          canary: bool) -> DeploymentPods:
    """The Deployment's pods of one track: the ready ones' IPs, and the names of all that exist."""
    if deployment is None:
        return DeploymentPods(namespace, name, ())
    engine = engine_of(deployment["spec"]["template"].get("metadata") or {})
    labels = dict(deployment["spec"]["selector"].get("matchLabels") or {})
    ips, names = [], []
    for pod in kube.list_pods(namespace, labels):
        is_canary = (pod["metadata"].get("labels") or {}).get(TRACK_LABEL) == "canary"
        if is_canary != canary:
            continue
        replica = pod_to_replica(pod)
        if replica.deleting:
            continue
        names.append(pod["metadata"]["name"])
        if replica.ready and replica.ip:
            ips.append(replica.ip)
    return DeploymentPods(namespace, name, tuple(sorted(ips)), tuple(sorted(names)), engine)


def _reconcile_rollout_once(
    kube: Kube,
    namespace: str,
    name: str,
    now: Clock,
    post_event: PostEvent,
    read_stats: ReadStats,
) -> float | None:
    obj = kube.get_custom(namespace, ROLLOUT_PLURAL, name)
    if obj is None:
        return None
    meta = obj["metadata"]
    status = ModelRolloutStatus.model_validate(obj.get("status") or {})
    try:
        spec = ModelRolloutSpec.model_validate(obj.get("spec") or {})
    except ValidationError as exc:
        what = f"invalid ModelRollout {namespace}/{name}"
        raise _refuse(
            kube, namespace, ROLLOUT_PLURAL, obj, now, "InvalidSpec", str(exc), what
        ) from exc
    target_name = spec.target_ref.name
    target = kube.get_deployment(namespace, target_name)
    canary, foreign = _own_canary(
        kube.get_deployment(namespace, canary_name(target_name)), meta["uid"]
    )
    if foreign is not None and status.phase not in TERMINAL_PHASES | {RolloutPhase.PENDING}:
        raise _canary_taken(target_name, foreign, "waiting")
    try:
        target_w, canary_w = _workloads(spec, target, canary)
    except ValueError as exc:
        message = f"target {target_name}: {exc}"
        what = f"{namespace}/{name}"
        raise _refuse(
            kube, namespace, ROLLOUT_PLURAL, obj, now, "InvalidTarget", message, what
        ) from exc

    reading = MetricReading(None, None, None, status.metric_source)
    if target is not None and status.phase not in TERMINAL_PHASES:
        reading = read_hit_rates(
            spec.metrics,
            _pods(kube, namespace, target_name, target, False),
            None
            if canary is None
            else _pods(kube, namespace, canary_name(target_name), canary, True),
            token=_operator_token(),  # read per reading: a rotated Secret takes effect
            read_stats=read_stats,
        )
    obs = observations(target_w, canary_w, reading)
    transition = advance(spec, status, obs, now(), int(meta.get("generation") or 0))
    new_status = transition.status.model_copy(update={"metric_source": reading.source})

    for action in transition.actions:
        if isinstance(action, DeleteCanary) and canary is None:
            continue  # gone already, or another rollout's: a terminal rollout costs reads only
        if isinstance(action, EnsureCanary) and foreign is not None:
            raise _canary_taken(target_name, foreign, "waiting for it to finish")
        _apply_rollout_action(kube, namespace, obj, spec, target, action)
    _write_status(kube, namespace, ROLLOUT_PLURAL, obj, _wire(new_status))
    for event in transition.events:
        post_event(obj, event)
    return transition.requeue_after_s


def _own_canary(canary: Manifest | None, uid: str) -> tuple[Manifest | None, Manifest | None]:
    """(our canary, another rollout's): a canary another ModelRollout controls (the next rollout
    of the same target) is not ours to observe, scale or delete."""
    if canary is None or _owned_by(canary, uid):
        return canary, None
    return None, canary


def _canary_taken(target_name: str, foreign: Manifest, what: str) -> kopf.TemporaryError:
    return kopf.TemporaryError(
        f"{canary_name(target_name)} belongs to ModelRollout {_controller_name(foreign)}; {what}",
        delay=10,
    )


def _workloads(
    spec: ModelRolloutSpec, target: Manifest | None, canary: Manifest | None
) -> tuple[Workload | None, Workload | None]:
    """What the planner sees of the two Deployments; ValueError when a template lacks the
    container the rollout names."""
    container, env_name = spec.target_ref.container, spec.digest_env
    return (
        None if target is None else workload_of(target, container, env_name),
        None if canary is None else workload_of(canary, container, env_name),
    )


def observations(
    target: Workload | None, canary: Workload | None, reading: MetricReading
) -> Observations:
    return Observations(
        target=target,
        canary=canary,
        target_hit_rate=reading.target_hit_rate,
        canary_hit_rate=reading.canary_hit_rate,
        target_saved_prefill_tokens_per_s=reading.target_saved_prefill_tokens_per_s,
    )


def _apply_rollout_action(
    kube: Kube,
    namespace: str,
    rollout: Manifest,
    spec: ModelRolloutSpec,
    target: Manifest | None,
    action: object,
) -> None:
    target_name = spec.target_ref.name
    container, env_name = spec.target_ref.container, spec.digest_env
    if isinstance(action, DeleteCanary):
        kube.delete_deployment(namespace, canary_name(target_name))
        return
    if target is None:
        return
    if isinstance(action, EnsureCanary):
        wanted = canary_deployment(
            target,
            rollout["metadata"]["name"],
            rollout["metadata"]["uid"],
            container,
            env_name,
            spec.weights_digest,
            spec.image or "",
            action.replicas,
        )
        live = kube.get_deployment(namespace, wanted["metadata"]["name"])
        if live is None or not _same_canary(live, wanted):
            kube.apply(wanted)
    elif isinstance(action, ScaleTarget):
        replicas = action.replicas

        def scale(current: Manifest) -> Manifest | None:
            if int(current["spec"].get("replicas", 1)) == replicas:
                return None
            current["spec"]["replicas"] = replicas
            return current

        kube.update_deployment(namespace, target_name, scale)
    elif isinstance(action, SetTargetVersion):
        digest, image = action.weights_digest, action.image

        def set_version(current: Manifest) -> Manifest | None:
            template = current["spec"]["template"]
            new = with_version(template, container, env_name, digest, image)
            if new == template:
                return None
            current["spec"]["template"] = new
            return current

        kube.update_deployment(namespace, target_name, set_version)


def _controller(obj: Manifest) -> Manifest | None:
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def _owned_by(obj: Manifest, uid: str) -> bool:
    ref = _controller(obj)
    return ref is not None and ref.get("uid") == uid


def _controller_name(obj: Manifest) -> str:
    ref = _controller(obj)
    return "<none>" if ref is None else str(ref.get("name"))


def _same_canary(live: Manifest, wanted: Manifest) -> bool:
    """Whether applying `wanted` would change anything we own (replicas, version, selector)."""
    live_spec, wanted_spec = live["spec"], wanted["spec"]
    if int(live_spec.get("replicas", 1)) != wanted_spec["replicas"]:
        return False
    live_tpl, wanted_tpl = live_spec["template"], wanted_spec["template"]
    live_ann = (live_tpl.get("metadata") or {}).get("annotations") or {}
    wanted_ann = wanted_tpl["metadata"].get("annotations") or {}
    live_images = [c.get("image") for c in live_tpl["spec"]["containers"]]
    wanted_images = [c.get("image") for c in wanted_tpl["spec"]["containers"]]
    return (
        live_ann.get(WEIGHTS_DIGEST_ANNOTATION) == wanted_ann.get(WEIGHTS_DIGEST_ANNOTATION)
        and live_images == wanted_images
    )
