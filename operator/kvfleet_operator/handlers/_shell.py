"""What both resource kinds' handlers share: the one wrapper of a reconcile (`_reconciled`), a
refusal written once (`_refuse`), the status write, and the pods' and workloads' observations."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import kopf

from kvfleet_operator.api import (
    KVCachePolicyStatus,
    ModelRolloutStatus,
)
from kvfleet_operator.constants import (
    ENGINE_ANNOTATION,
    PEER_PORT_ANNOTATION,
    POLICY_PLURAL,
    WEIGHTS_DIGEST_ANNOTATION,
)
from kvfleet_operator.kube import Conflict, Kube, KubeError, NamespaceTerminating, retry_on_conflict
from kvfleet_operator.manifests import (
    template_version,
)
from kvfleet_operator.planning import (
    Event,
    ReplicaPod,
    Workload,
)
from kvfleet_operator.planning.conditions import set_condition
from kvfleet_operator.planning.rollout import format_time
from kvfleet_runtime.wire import ENGINES, Engine

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


