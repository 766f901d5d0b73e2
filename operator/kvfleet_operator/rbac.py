"""The operator's least-privilege ClusterRole: the one source of `operator/rbac/clusterrole.yaml`
(generated with the CRDs; the Helm chart copies the file and a test checks the copy).

Each rule says why it exists; nothing is granted that a handler or kopf itself does not use.
"""

from __future__ import annotations

from typing import Any

from kvfleet_operator.constants import GROUP, POLICY_PLURAL, ROLLOUT_PLURAL

__all__ = ["CLUSTER_ROLE_NAME", "RULES", "cluster_role"]

CLUSTER_ROLE_NAME = "kvfleet-operator"

# (apiGroups, resources, verbs, why)
RULES: tuple[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str], ...] = (
    (
        (GROUP,),
        (POLICY_PLURAL, ROLLOUT_PLURAL),
        ("get", "list", "watch", "patch"),
        "watch our resources; kopf patches its annotations on them",
    ),
    (
        (GROUP,),
        (f"{POLICY_PLURAL}/status", f"{ROLLOUT_PLURAL}/status"),
        ("get", "patch"),
        "write the status the planners compute",
    ),
    (
        ("kopf.dev",),
        ("clusterkopfpeerings",),
        ("get", "list", "watch", "patch", "create"),
        "peering: only one operator replica acts; created at startup when missing",
    ),
    (
        ("kopf.dev",),
        ("kopfpeerings",),
        ("get", "list", "watch", "patch", "create"),
        "peering when the operator watches only some namespaces (`run -n NS`); created at "
        "startup when missing",
    ),
    (
        ("apiextensions.k8s.io",),
        ("customresourcedefinitions",),
        ("get", "list", "watch"),
        "kopf discovers the resources it serves",
    ),
    (("",), ("events",), ("create", "patch"), "an event on every transition"),
    (("",), ("pods",), ("get", "list", "watch"), "home sets over the ready replica pods"),
    (
        ("",),
        ("configmaps",),
        ("get", "create", "patch"),
        "publish the fleet config (server-side apply)",
    ),
    (
        ("apps",),
        ("deployments",),
        ("get", "list", "watch", "create", "patch", "update", "delete"),
        "rollouts: the canary Deployment and the target's replicas and template",
    ),
)


def cluster_role() -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {
            "name": CLUSTER_ROLE_NAME,
            "labels": {"app.kubernetes.io/name": "kvfleet-operator"},
        },
        "rules": [
            {"apiGroups": list(groups), "resources": list(resources), "verbs": list(verbs)}
            for groups, resources, verbs, _ in RULES
        ],
    }
