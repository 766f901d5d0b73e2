"""tests/cluster/api.py against the real API server: what the kubelet shim and the demo ask of it
(list with selectors, a status patch, a TokenRequest) on one connection, as the admin and as a
minted ServiceAccount, and errors that say the request and the server's answer."""

from __future__ import annotations

import json

import pytest

from tests.cluster.api import STRATEGIC_MERGE, ApiClient, ApiError
from tests.cluster.fixtures import Cluster

pytestmark = pytest.mark.k8s


def test_lists_patches_and_tokens_on_one_connection(k8s_cluster: Cluster,
                                                    k8s_namespace: str) -> None:
    k8s_cluster.kubectl("create", "configmap", "cfg", "-n", k8s_namespace, "--from-literal=a=1")
    k8s_cluster.kubectl("create", "secret", "generic", "plain", "-n", k8s_namespace,
                        "--from-literal=b=2")
    k8s_cluster.kubectl("create", "secret", "generic", "release", "-n", k8s_namespace,
                        "--type=helm.sh/release.v1", "--from-literal=release=x")
    k8s_cluster.kubectl("create", "serviceaccount", "runner", "-n", k8s_namespace)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "labels": {"app": "x"}},
           "spec": {"serviceAccountName": "runner", "nodeName": k8s_cluster.gpu_nodes[0],
                    "containers": [{"name": "c", "image": "example/none:1"}]}}
    k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", stdin=json.dumps(pod))
    api = ApiClient(k8s_cluster.kubeconfig)
    try:
        base = f"/api/v1/namespaces/{k8s_namespace}"
        secrets = api.get(f"{base}/secrets", fieldSelector="type!=helm.sh/release.v1")["items"]
        assert "plain" in {s["metadata"]["name"] for s in secrets}
        assert "release" not in {s["metadata"]["name"] for s in secrets}
        (found,) = api.get(f"{base}/pods", labelSelector="app=x")["items"]
        assert api.get(f"{base}/pods", labelSelector="app=y")["items"] == []
        assert api.get(f"{base}/configmaps/cfg")["data"] == {"a": "1"}
        # A condition type of our own: kwok writes the pod's Ready itself, at its own pace, and
        # may overwrite a patched Ready after the patch (seen on a loaded box).
        condition = {"type": "example.com/Probed", "status": "False",
                     "lastTransitionTime": "2026-01-01T00:00:00Z"}
        api.patch(f"{base}/pods/p/status", {"status": {"conditions": [condition]}},
                  STRATEGIC_MERGE)
        status = json.loads(k8s_cluster.kubectl("get", "pod", "p", "-n", k8s_namespace,
                                                "-o", "json").stdout)["status"]
        assert {"type": "example.com/Probed", "status": "False"}.items() <= next(
            c for c in status["conditions"] if c["type"] == "example.com/Probed").items()
        token = api.post(f"{base}/serviceaccounts/runner/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600, "boundObjectRef": {
                "apiVersion": "v1", "kind": "Pod", "name": "p",
                "uid": found["metadata"]["uid"]}}})["status"]["token"]
        assert token.count(".") == 2  # a JWT
        with pytest.raises(ApiError, match=r"GET .*/configmaps/absent: 404") as missing:
            api.get(f"{base}/configmaps/absent")
        assert missing.value.status == 404
    finally:
        api.close()


def test_a_token_user_gets_what_rbac_gives_it(k8s_cluster: Cluster, k8s_namespace: str) -> None:
    identity = k8s_cluster.mint_identity(k8s_namespace, "nobody")
    api = ApiClient(identity.kubeconfig)
    try:
        with pytest.raises(ApiError, match="403") as refused:
            api.get(f"/api/v1/namespaces/{k8s_namespace}/secrets")
        assert refused.value.status == 403
    finally:
        api.close()
