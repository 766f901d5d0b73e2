"""Kubernetes access: the only module that talks to the API server.

Every write is idempotent: server-side apply for what the operator owns (the fleet ConfigMap, the
canary Deployment), a no-op when the live object already says what we want, and read-modify-write
with the resourceVersion (optimistic concurrency) for what it shares with others (the target
Deployment's template, our resources' status). A 409 Conflict re-reads and retries at once, a few
times, without sleeping: a handler never sleeps; when the conflicts persist, `Conflict` reaches the
handler, which asks kopf to call it again later (`kopf.TemporaryError(delay=...)`).

Errors: `ApiException` from the client is translated at this boundary into `KubeError` (with the
status code); handlers turn a transient one into `kopf.TemporaryError`.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvfleet_operator.constants import FIELD_MANAGER, GROUP, VERSION

__all__ = [
    "CONFLICT_RETRIES",
    "Conflict",
    "Kube",
    "KubeError",
    "NamespaceTerminating",
    "retry_on_conflict",
]

# Immediate re-reads on a 409 before giving the conflict back to the handler (and kopf's delay).
CONFLICT_RETRIES = 3
T = TypeVar("T")
Manifest = dict[str, Any]
_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"
_JSON_PATCH = "application/json-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class Conflict(KubeError):
    pass


class NamespaceTerminating(KubeError):
    """403 on a create in a namespace being deleted: nothing to reconcile there any more."""


def _translate(exc: ApiException, what: str) -> KubeError:
    status = int(exc.status or 0)
    reason = exc.reason or ""
    body = exc.body if isinstance(exc.body, str) else ""
    message = f"{what}: {reason} {body[:500]}".strip()
    if status == 409:
        return Conflict(status, message)
    if status == 403 and "NamespaceTerminating" in body:
        return NamespaceTerminating(status, message)
    return KubeError(status, message)


def retry_on_conflict(attempt: Callable[[], T], retries: int = CONFLICT_RETRIES) -> T:
    """Run `attempt` (which must re-read what it writes) until it does not hit a 409, at most
    `retries` times, back to back: the fresh read is what makes the next try differ, so waiting in
    between buys nothing, and a handler must not block its worker thread. The last `Conflict` is
    raised for the handler to turn into a kopf retry with a delay."""
    for i in range(retries):
        try:
            return attempt()
        except Conflict:
            if i == retries - 1:
                raise
    raise AssertionError("unreachable")


class Kube:
    """Thin wrapper over the official client. Every call asks for the raw JSON
    (`_preload_content=False`): the operator reads and writes plain dicts, exactly what the API
    server sent, never the client's typed models (which would drop or reshape fields)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.num_writes = 0

    @classmethod
    def from_environment(cls) -> Kube:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        return cls(client.ApiClient())

    @staticmethod
    def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Manifest | None:
        """Call, parse the JSON body; None on 404; KubeError (Conflict on 409) otherwise."""
        try:
            response = fn(*args, _preload_content=False, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _translate(exc, what) from exc
        data = response.data
        parsed: Manifest = json.loads(data) if data else {}
        return parsed

    def _write(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self._call(what, fn, *args, **kwargs) is None:
            raise KubeError(404, f"{what}: not found")
        self.num_writes += 1

    # -- reads -----------------------------------------------------------------------------

    def get_custom(self, namespace: str, plural: str, name: str) -> Manifest | None:
        return self._call(
            f"get {plural}/{name}",
            self.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            plural,
            name,
        )

    def get_deployment(self, namespace: str, name: str) -> Manifest | None:
        return self._call(
            f"get deployment {name}", self.apps.read_namespaced_deployment, name, namespace
        )

    def list_pods(self, namespace: str, match_labels: dict[str, str]) -> list[Manifest]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        pods = self._call(
            f"list pods {selector}",
            self.core.list_namespaced_pod,
            namespace,
            label_selector=selector,
        )
        items: list[Manifest] = (pods or {}).get("items", [])
        return items

    def get_configmap_data(self, namespace: str, name: str) -> dict[str, str] | None:
        obj = self._call(
            f"get configmap {name}", self.core.read_namespaced_config_map, name, namespace
        )
        if obj is None:
            return None
        data: dict[str, str] = obj.get("data") or {}
        return data

    # -- writes ----------------------------------------------------------------------------

    def apply(self, manifest: Manifest) -> None:
        """Server-side apply (forced: these fields are ours) of a ConfigMap or Deployment."""
        kind, meta = manifest["kind"], manifest["metadata"]
        method = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "Deployment": self.apps.patch_namespaced_deployment,
        }[kind]
        self._write(
            f"apply {kind} {meta['name']}",
            method,
            meta["name"],
            meta["namespace"],
            manifest,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=_APPLY,
        )

    def delete_deployment(self, namespace: str, name: str) -> bool:
        gone = self._call(
            f"delete deployment {name}",
            self.apps.delete_namespaced_deployment,
            name,
            namespace,
            propagation_policy="Background",
        )
        if gone is None:
            return False
        self.num_writes += 1
        return True

    def update_deployment(
        self, namespace: str, name: str, change: Callable[[Manifest], Manifest | None]
    ) -> bool:
        """Read, let `change` return the new object (or None: nothing to do), write its spec back
        with the read resourceVersion as a precondition; a 409 starts over from a fresh read.
        Returns whether it wrote."""

        def attempt() -> bool:
            current = self.get_deployment(namespace, name)
            if current is None:
                raise KubeError(404, f"deployment {namespace}/{name} not found")
            version = current["metadata"]["resourceVersion"]
            wanted = change(copy.deepcopy(current))
            if wanted is None:
                return False
            # A JSON patch that also "replaces" resourceVersion with the one we read: the API
            # server refuses it with 409 when the object changed since.
            ops = [
                {"op": "replace", "path": "/metadata/resourceVersion", "value": version},
                {"op": "replace", "path": "/spec", "value": wanted["spec"]},
            ]
            self._write(
                f"update deployment {name}",
                self.apps.patch_namespaced_deployment,
                name,
                namespace,
                ops,
                field_manager=FIELD_MANAGER,
                _content_type=_JSON_PATCH,
            )
            return True

        return retry_on_conflict(attempt)

    def patch_status(
        self, namespace: str, plural: str, name: str, status: Manifest, resource_version: str
    ) -> None:
        """Merge-patch the status subresource, only if the object is still at `resource_version`
        (409 otherwise: the caller re-reads and recomputes). Null values delete fields."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        self._write(
            f"patch {plural}/{name}/status",
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            plural,
            name,
            body,
            _content_type=_MERGE,
        )

    def ensure_cluster_peering(self, name: str) -> None:
        """kopf's peering object must exist for operator replicas to see each other."""
        body = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": name},
        }
        with contextlib.suppress(Conflict):  # it exists already
            self._call(
                f"create clusterkopfpeering {name}",
                self.custom.create_cluster_custom_object,
                "kopf.dev",
                "v1",
                "clusterkopfpeerings",
                body,
            )

    def ensure_namespace_peering(self, namespace: str, name: str) -> bool:
        """The KopfPeering kopf needs in each namespace an operator watches; True when this call
        created it. 404 (the namespace or the KopfPeering CRD is missing) and 403 raise."""
        body = {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": name, "namespace": namespace},
        }
        try:
            self._write(
                f"create kopfpeering {name} in namespace {namespace}",
                self.custom.create_namespaced_custom_object,
                "kopf.dev",
                "v1",
                namespace,
                "kopfpeerings",
                body,
            )
        except Conflict:
            return False
        return True
