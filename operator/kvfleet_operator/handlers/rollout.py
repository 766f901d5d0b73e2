"""ModelRollout: one evaluation of the rollout state machine per call (`planning.advance`), its
actions (canary, scale, version) applied before the status that asks for them."""

from __future__ import annotations

import kopf
from pydantic import ValidationError

from kvfleet_operator.api import (
    TERMINAL_PHASES,
    ModelRolloutSpec,
    ModelRolloutStatus,
    RolloutPhase,
)
from kvfleet_operator.constants import (
    ROLLOUT_PLURAL,
    TRACK_LABEL,
    WEIGHTS_DIGEST_ANNOTATION,
)
from kvfleet_operator.handlers._shell import (
    Clock,
    Manifest,
    PostEvent,
    _reconciled,
    _refuse,
    _wire,
    _write_status,
    engine_of,
    log,
    pod_to_replica,
    post_kopf_event,
    utc_now,
    workload_of,
)
from kvfleet_operator.kube import Kube
from kvfleet_operator.manifests import (
    canary_deployment,
    canary_name,
    with_version,
)
from kvfleet_operator.metrics import (
    DeploymentPods,
    MetricReading,
    ReadStats,
    read_cache_stats,
    read_hit_rates,
)
from kvfleet_operator.planning import (
    DeleteCanary,
    EnsureCanary,
    Observations,
    ScaleTarget,
    SetTargetVersion,
    Workload,
    advance,
)
from kvfleet_runtime.auth import read_operator_token


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
