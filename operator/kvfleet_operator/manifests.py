"""Pure manifest builders: the fleet ConfigMap, the canary Deployment, a template's version.

Everything here takes and returns plain dicts (the API server's JSON) and is tested without a
cluster. The kube access layer applies what these return.
"""

from __future__ import annotations

import copy
from typing import Any

from kvfleet_operator.constants import (
    API_VERSION,
    CANARY_SUFFIX,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    POLICY_KIND,
    POLICY_LABEL,
    ROLLOUT_KIND,
    ROLLOUT_LABEL,
    TRACK_LABEL,
    WEIGHTS_DIGEST_ANNOTATION,
)
from kvfleet_runtime.config.fleet import FLEET_CONFIG_FILENAME

__all__ = [
    "canary_deployment",
    "canary_name",
    "container_of",
    "fleet_configmap",
    "owner_reference",
    "template_version",
    "with_version",
]

Manifest = dict[str, Any]


def canary_name(target: str) -> str:
    return f"{target}{CANARY_SUFFIX}"


def owner_reference(kind: str, name: str, uid: str) -> dict[str, Any]:
    """Makes what we create go away with the resource that asked for it (garbage collection)."""
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def fleet_configmap(namespace: str, name: str, policy: str, policy_uid: str, text: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, POLICY_LABEL: policy},
            "ownerReferences": [owner_reference(POLICY_KIND, policy, policy_uid)],
        },
        "data": {FLEET_CONFIG_FILENAME: text},
    }


def container_of(template: Manifest, container: str | None) -> Manifest:
    """The container carrying the weights: the named one, else the first."""
    containers: list[Manifest] = template.get("spec", {}).get("containers", [])
    if not containers:
        raise ValueError("the pod template has no containers")
    if container is None:
        return containers[0]
    for candidate in containers:
        if candidate.get("name") == container:
            return candidate
    names = ", ".join(str(c.get("name")) for c in containers)
    raise ValueError(f"container {container!r} not in the pod template (has: {names})")


def template_version(template: Manifest, container: str | None, env_name: str) -> tuple[str, str]:
    """(weights digest, image) a pod template runs; the annotation wins over the env var."""
    annotations = template.get("metadata", {}).get("annotations") or {}
    target = container_of(template, container)
    digest = annotations.get(WEIGHTS_DIGEST_ANNOTATION, "")
    if not digest:
        for env in target.get("env") or []:
            if env.get("name") == env_name and "value" in env:
                digest = env["value"]
    return str(digest), str(target.get("image", ""))


def with_version(
    template: Manifest, container: str | None, env_name: str, digest: str, image: str
) -> Manifest:
    """A copy of the pod template running `digest` (and `image`, when not empty).

    The annotation and the env var are edited where they stand (added at the end only when
    missing), so a template set to the version it already runs comes back equal to itself, and
    setting a version and then the previous one gives the template back as it was: a Deployment
    whose pod template changes replaces every pod, and a stable fleet restored on a rollback (or
    re-applied by `helm upgrade` with the same values) must keep its pods and their caches. An
    empty digest removes both: what a template that never had them looks like."""
    out = copy.deepcopy(template)
    metadata = out.setdefault("metadata", {})
    annotations = dict(metadata.get("annotations") or {})
    if digest:
        annotations[WEIGHTS_DIGEST_ANNOTATION] = digest
    else:
        annotations.pop(WEIGHTS_DIGEST_ANNOTATION, None)
    if annotations:
        metadata["annotations"] = annotations
    else:
        metadata.pop("annotations", None)
    target = container_of(out, container)
    env: list[Manifest] = list(target.get("env") or [])
    at = next((i for i, e in enumerate(env) if e.get("name") == env_name), None)
    if digest and at is not None:
        env[at] = {"name": env_name, "value": digest}
    elif digest:
        env.append({"name": env_name, "value": digest})
    elif at is not None:
        del env[at]
    if env:
        target["env"] = env
    else:
        target.pop("env", None)
    if image:
        target["image"] = image
    return out


def canary_deployment(
    target: Manifest,
    rollout: str,
    rollout_uid: str,
    container: str | None,
    env_name: str,
    digest: str,
    image: str,
    replicas: int,
) -> Manifest:
    """The canary Deployment: the target's pod template with the new version, its own selector
    (the target's plus the canary track label, so the two never claim each other's ReplicaSets),
    owned by the ModelRollout. Pods keep the target's labels, so the same Service selects both."""
    meta = target["metadata"]
    spec = target["spec"]
    selector = dict(spec["selector"].get("matchLabels") or {})
    selector[TRACK_LABEL] = "canary"
    template = with_version(spec["template"], container, env_name, digest, image)
    template_meta = template.setdefault("metadata", {})
    template_meta["labels"] = {**(template_meta.get("labels") or {}), TRACK_LABEL: "canary"}
    labels = {
        **(meta.get("labels") or {}),
        MANAGED_BY_LABEL: MANAGED_BY_VALUE,
        ROLLOUT_LABEL: rollout,
        TRACK_LABEL: "canary",
    }
    body: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": canary_name(meta["name"]),
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": {f"{WEIGHTS_DIGEST_ANNOTATION}": digest},
            "ownerReferences": [owner_reference(ROLLOUT_KIND, rollout, rollout_uid)],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }
    for key in ("strategy", "minReadySeconds", "progressDeadlineSeconds"):
        if key in spec:
            body["spec"][key] = copy.deepcopy(spec[key])
    return body
