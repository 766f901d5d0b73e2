"""The test cluster is a real Kubernetes: controllers, scheduler, GC, schemas, RBAC, helm."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.binaries import read_versions
from tests.cluster.controlplane import GPU_RESOURCE, GPUS_PER_NODE
from tests.cluster.fixtures import Cluster

pytestmark = pytest.mark.k8s

TESTDATA = Path(__file__).parent / "testdata"
WAIT_S = 60.0


def wait_for(ready: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true after {timeout_s:.0f} s")
        time.sleep(0.25)


def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def gpu_deployment(name: str, replicas: int, gpus: int) -> str:
    return json.dumps({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "main",
                    "image": "registry.invalid/replica:0",
                    "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                }]},
            },
        },
    })


def test_versions_are_the_pinned_ones(k8s_cluster: Cluster) -> None:
    versions = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)
    pinned = read_versions().kubernetes
    assert versions["clientVersion"]["gitVersion"] == pinned
    if k8s_cluster.local:
        assert versions["serverVersion"]["gitVersion"] == pinned
    assert read_versions().helm in k8s_cluster.helm("version", "--short").stdout


def test_fake_nodes_advertise_gpus(k8s_cluster: Cluster) -> None:
    if not k8s_cluster.gpu_nodes:
        pytest.skip("existing cluster: no fake GPU nodes")
    nodes = {n["metadata"]["name"]: n for n in get_json(k8s_cluster, "nodes")["items"]}
    assert set(k8s_cluster.gpu_nodes) <= set(nodes)
    assert len(k8s_cluster.gpu_nodes) >= 3
    for name in k8s_cluster.gpu_nodes:
        assert nodes[name]["status"]["allocatable"][GPU_RESOURCE] == str(GPUS_PER_NODE)


def test_deployment_becomes_running_pods_and_is_garbage_collected(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    if not k8s_cluster.gpu_nodes:
        pytest.skip("existing cluster: no fake GPU nodes")
    ns = ("-n", k8s_namespace)
    k8s_cluster.kubectl("apply", *ns, "-f", "-", stdin=gpu_deployment("fleet", 3, gpus=1))
    k8s_cluster.kubectl("rollout", "status", *ns, "deployment/fleet", f"--timeout={WAIT_S:.0f}s")

    pods = get_json(k8s_cluster, "pods", *ns, "-l", "app=fleet")["items"]
    assert len(pods) == 3
    assert {p["status"]["phase"] for p in pods} == {"Running"}
    assert {p["spec"]["nodeName"] for p in pods} <= set(k8s_cluster.gpu_nodes)
    # Deployment -> ReplicaSet -> Pods, each owned by the one before (what GC follows).
    (rs,) = get_json(k8s_cluster, "replicasets", *ns, "-l", "app=fleet")["items"]
    assert rs["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    assert {p["metadata"]["ownerReferences"][0]["name"] for p in pods} == {rs["metadata"]["name"]}

    k8s_cluster.kubectl("delete", *ns, "deployment/fleet", "--wait=false")
    wait_for(lambda: not k8s_cluster.kubectl("get", "pods,replicasets", *ns, "-l", "app=fleet",
                                             "-o", "name").stdout.strip(),
             "pods and ReplicaSet of a deleted Deployment garbage-collected")


def test_pod_asking_more_gpus_than_a_node_has_stays_pending(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    if not k8s_cluster.gpu_nodes:
        pytest.skip("existing cluster: no fake GPU nodes")
    ns = ("-n", k8s_namespace)
    k8s_cluster.kubectl("apply", *ns, "-f", "-",
                        stdin=gpu_deployment("greedy", 1, gpus=GPUS_PER_NODE + 1))

    def unschedulable_for_gpus() -> bool:
        events = k8s_cluster.kubectl("get", "events", *ns,
                                     "--field-selector=reason=FailedScheduling").stdout
        return f"Insufficient {GPU_RESOURCE}" in events

    wait_for(unschedulable_for_gpus, "FailedScheduling event naming the GPU shortage")
    (pod,) = get_json(k8s_cluster, "pods", *ns, "-l", "app=greedy")["items"]
    assert pod["status"]["phase"] == "Pending"


def test_crd_schema_rejects_a_bad_object_with_the_field_path(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    group = f"t{secrets.token_hex(3)}.kvfleet.test"
    crd = (TESTDATA / "widget-crd.yaml").read_text().replace("GROUP", group)
    k8s_cluster.kubectl("apply", "-f", "-", stdin=crd)
    try:
        k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{group}",
                            f"--timeout={WAIT_S:.0f}s")
        widget = {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": "w"}}
        bad = k8s_cluster.kubectl(
            "apply", "-n", k8s_namespace, "-f", "-", check=False,
            stdin=json.dumps({**widget, "spec": {"replicas": "three"}}),
        )
        assert bad.returncode != 0
        assert "spec.replicas" in bad.stderr
        assert "integer" in bad.stderr

        k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-",
                            stdin=json.dumps({**widget, "spec": {"replicas": 2}}))
        stored = get_json(k8s_cluster, "widgets", "w", "-n", k8s_namespace)
        assert stored["spec"] == {"replicas": 2, "tier": "dram"}  # the schema's default applied
    finally:
        k8s_cluster.kubectl("delete", "crd", f"widgets.{group}", "--wait=false")


def test_restricted_identity_is_denied_what_its_role_does_not_grant(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    ns = ("-n", k8s_namespace)
    identity = k8s_cluster.mint_identity(k8s_namespace, "reader")
    k8s_cluster.kubectl("create", "role", "pod-reader", *ns, "--verb=get,list,watch",
                        "--resource=pods")
    k8s_cluster.kubectl("create", "rolebinding", "reader", *ns, "--role=pod-reader",
                        f"--serviceaccount={k8s_namespace}:reader")

    assert identity.kubectl("get", "pods", *ns).returncode == 0
    for denied in (
        ("get", "secrets", *ns),
        ("create", "configmap", "x", *ns),
        ("get", "pods", "-n", "kube-system"),
        ("get", "nodes"),
    ):
        result = identity.kubectl(*denied, check=False)
        assert result.returncode != 0, denied
        assert "forbidden" in result.stderr.lower(), result.stderr
        assert identity.username in result.stderr
    assert identity.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"
                            ).stdout == identity.username


def test_kubectl_apply_and_helm_install(k8s_cluster: Cluster, k8s_namespace: str) -> None:
    ns = ("-n", k8s_namespace)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"},
                  "data": {"k": "1"}}
    created = k8s_cluster.kubectl("apply", *ns, "-f", "-", stdin=json.dumps(config_map))
    assert "created" in created.stdout
    config_map["data"] = {"k": "2"}
    changed = k8s_cluster.kubectl("apply", *ns, "-f", "-", stdin=json.dumps(config_map))
    assert "configured" in changed.stdout

    wait = ["--wait", f"--timeout={WAIT_S:.0f}s"] if k8s_cluster.gpu_nodes else []
    k8s_cluster.helm("install", "smoke", str(TESTDATA / "chart"), *ns,
                     "--set", "greeting=from-helm", *wait)
    assert get_json(k8s_cluster, "configmap", "smoke-greeting", *ns)["data"] == {
        "greeting": "from-helm"
    }
    assert "deployed" in k8s_cluster.helm("status", "smoke", *ns).stdout
    k8s_cluster.helm("uninstall", "smoke", *ns, "--wait", f"--timeout={WAIT_S:.0f}s")
    assert k8s_cluster.kubectl("get", "configmap", "smoke-greeting", *ns,
                               check=False).returncode != 0
