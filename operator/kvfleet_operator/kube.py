"""Kubernetes access: the only module that talks to the API server.

Every write is idempotent: server-side apply for what the operator owns (the fleet ConfigMap, the
canary Deployment), a no-op when the live object already says what we want, and read-modify-write
with the resourceVersion (optimistic concurrency) for what it shares with others (the target
Deployment's template, our resources' status). A 409 Conflict re-reads and retries.

Errors: `ApiException` from the client is translated at this boundary into `KubeError` (with the
status code); handlers turn a transient one into `kopf.TemporaryError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvfleet_operator.constants import FIELD_MANAGER, GROUP, VERSION

__all__ = ["CONFLICT_RETRIES", "Conflict", "Kube", "KubeError", "retry_on_conflict"]

CONFLICT_RETRIES = 5
T = TypeVar("T")
Manifest = dict[str, Any]
_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class Conflict(KubeError):
    pass


def _translate(exc: ApiException, what: str) -> KubeError:
    status = int(exc.status or 0)
    reason = exc.reason or ""
    body = exc.body if isinstance(exc.body, str) else ""
    message = f"{what}: {reason} {body[:500]}".strip()
    return Conflict(status, message) if status == 409 else KubeError(status, message)


def retry_on_conflict(
    attempt: Callable[[], T], retries: int = CONFLICT_RETRIES, backoff_s: float = 0.05
) -> T:
    """Run `attempt` (which must re-read what it writes) until it does not hit a 409."""
    for i in range(retries):
        try:
            return attempt()
        except Conflict:
            if i == retries - 1:
                raise
            time.sleep(backoff_s * (2**i))
    raise AssertionError("unreachable")


class Kube:
    """Thin typed wrapper over the official client; returns plain dicts (the API's JSON)."""

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

    def _json(self, obj: Any) -> Manifest:
        if isinstance(obj, dict):
            return obj
        data: Manifest = self.api.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return data

    # -- reads -----------------------------------------------------------------------------

    def get_custom(self, namespace: str, plural: str, name: str) -> Manifest | None:
        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _translate(exc, f"get {plural}/{name}") from exc
        return self._json(obj)

    def get_deployment(self, namespace: str, name: str) -> Manifest | None:
        try:
            return self._json(self.apps.read_namespaced_deployment(name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _translate(exc, f"get deployment {name}") from exc

    def list_pods(self, namespace: str, match_labels: dict[str, str]) -> list[Manifest]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        try:
            pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        except ApiException as exc:
            raise _translate(exc, f"list pods {selector}") from exc
        items: list[Manifest] = self._json(pods).get("items", [])
        return items

    # -- writes ----------------------------------------------------------------------------

    def apply(self, manifest: Manifest) -> None:
        """Server-side apply (forced: these fields are ours) of a ConfigMap or Deployment."""
        kind, meta = manifest["kind"], manifest["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        method = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "Deployment": self.apps.patch_namespaced_deployment,
        }[kind]
        try:
            method(
                name,
                namespace,
                manifest,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=_APPLY,
            )
        except ApiException as exc:
            raise _translate(exc, f"apply {kind} {name}") from exc
        self.num_writes += 1

    def get_configmap_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            obj = self._json(self.core.read_namespaced_config_map(name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _translate(exc, f"get configmap {name}") from exc
        data: dict[str, str] = obj.get("data") or {}
        return data

    def delete_deployment(self, namespace: str, name: str) -> bool:
        try:
            self.apps.delete_namespaced_deployment(name, namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise _translate(exc, f"delete deployment {name}") from exc
        self.num_writes += 1
        return True

    def update_deployment(
        self, namespace: str, name: str, change: Callable[[Manifest], Manifest | None]
    ) -> bool:
        """Read, let `change` return the new object (or None: nothing to do), replace with the
        read resourceVersion; a 409 starts over from a fresh read. Returns whether it wrote."""

        def attempt() -> bool:
            current = self.get_deployment(namespace, name)
            if current is None:
                raise KubeError(404, f"deployment {namespace}/{name} not found")
            wanted = change(current)
            if wanted is None:
                return False
            try:
                self.apps.replace_namespaced_deployment(
                    name,
                    namespace,
                    wanted,  # type: ignore[arg-type]
                    field_manager=FIELD_MANAGER,
                )
            except ApiException as exc:
                raise _translate(exc, f"update deployment {name}") from exc
            self.num_writes += 1
            return True

        return retry_on_conflict(attempt)

    def patch_status(
        self, namespace: str, plural: str, name: str, status: Manifest, resource_version: str
    ) -> None:
        """Merge-patch the status subresource, only if the object is still at `resource_version`
        (409 otherwise: the caller re-reads and recomputes). Null values delete fields."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        try:
            self.custom.api_client.call_api(
                f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{plural}/{name}/status",
                "PATCH",
                header_params={"Content-Type": _MERGE, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                response_type="object",
                _return_http_data_only=True,
            )
        except ApiException as exc:
            raise _translate(exc, f"patch {plural}/{name}/status") from exc
        self.num_writes += 1

    def ensure_cluster_peering(self, name: str) -> None:
        """kopf's peering object must exist for operator replicas to see each other."""
        body = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": name},
        }
        try:
            self.custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", body)
        except ApiException as exc:
            if exc.status != 409:
                raise _translate(exc, f"create clusterkopfpeering {name}") from exc
