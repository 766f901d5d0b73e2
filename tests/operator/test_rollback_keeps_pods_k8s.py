"""A rolled-back stable fleet keeps its pods: the chart's replica Deployment, installed with helm on
the real API server (kwok runs its pods), through an aborted rollout and a following `helm
upgrade` with the same values, never gets a new ReplicaSet.

Why it matters: a Deployment whose pod template changes by one byte replaces every pod, and a
replaced replica starts with an empty cache. The rollback restores the stable version with
`manifests.with_version`; when that moved KVFLEET_WEIGHTS_DIGEST to the end of the env list the
restored template differed from the chart's, every stable pod was replaced on the rollback, and
`helm upgrade` put the order back and replaced them all again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.fixtures import Cluster
from tests.operator.conftest import (
    NEW,
    OLD,
    ROOT,
    assert_no_forbidden,
    get,
    start_operator,
    wait_for,
)

pytestmark = [pytest.mark.k8s]

RELEASE = "stable"
TARGET = f"{RELEASE}-kvfleet-replica"
CHART = ROOT / "charts" / "kvfleet"


def _values() -> dict[str, Any]:
    return {
        # The operator runs below as a local process with the chart's ServiceAccount; it makes
        # the ClusterKopfPeering itself (another test's operator may have made it already).
        "operator": {"peering": {"enabled": False}},
        "replica": {
            "replicas": 2,
            "model": {"volume": {"hostPath": {"path": "/nonexistent"}}, "id": "tiny",
                      "weightsDigest": OLD},
        },
        "redis": {"bundled": {"enabled": False},
                  "external": {"url": "redis://127.0.0.1:1/0"}},
    }


def _rollout() -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "ModelRollout",
        "metadata": {"name": "v2"},
        "spec": {
            "targetRef": {"name": TARGET, "container": "replica"},
            "weightsDigest": NEW,
            "steps": [{"replicas": 1}, {"percent": 100}],
            "gate": {"windowSeconds": 600, "holdSeconds": 5, "checkIntervalSeconds": 1},
            "surge": {"mode": "None"},
            # Nothing answers there: the gate waits for a hit rate until the abort.
            "metrics": {"prometheus": {"url": "http://127.0.0.1:1"},
                        "cacheStats": {"enabled": False}},
        },
    }


def _replica_sets(cluster: Cluster, ns: str) -> list[str]:
    items = get(cluster, ns, "replicasets")["items"]
    return sorted(
        rs["metadata"]["name"] for rs in items
        if any(o.get("name") == TARGET for o in rs["metadata"].get("ownerReferences") or [])
    )


def _pods(cluster: Cluster, ns: str) -> list[str]:
    items = get(cluster, ns, "pods")["items"]
    return sorted(
        p["metadata"]["name"] for p in items
        if p["metadata"]["name"].startswith(f"{TARGET}-")
        and "-canary-" not in p["metadata"]["name"]
        and p["metadata"].get("deletionTimestamp") is None
    )


def _template(cluster: Cluster, ns: str) -> str:
    return json.dumps(get(cluster, ns, "deployment", TARGET)["spec"]["template"])


def _settled(cluster: Cluster, ns: str, replicas: int) -> bool:
    d = get(cluster, ns, "deployment", TARGET)
    st = d.get("status") or {}
    return (st.get("observedGeneration") == d["metadata"]["generation"]
            and st.get("readyReplicas") == replicas == st.get("replicas")
            and st.get("updatedReplicas") == replicas)


def test_an_aborted_rollout_and_helm_upgrade_make_no_new_replica_set(
    k8s_cluster: Cluster, k8s_namespace: str, tmp_path: Path
) -> None:
    cluster, ns = k8s_cluster, k8s_namespace
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_values()))
    helm = ("-n", ns, "-f", str(values), "--wait=false")
    cluster.helm("install", RELEASE, str(CHART), *helm, timeout_s=180)
    wait_for(lambda: _settled(cluster, ns, 2), "the chart's 2 replica pods ready (kwok)")
    installed_rs, installed_tpl = _replica_sets(cluster, ns), _template(cluster, ns)
    assert len(installed_rs) == 1, installed_rs

    identity = cluster.mint_identity(ns, f"{RELEASE}-kvfleet-operator")
    op = start_operator(identity, tmp_path / "operator.log", priority=900)
    try:
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=json.dumps(_rollout()))

        def status() -> dict[str, Any]:
            return get(cluster, ns, "mro", "v2").get("status") or {}

        # Step 1 hands one stable replica's share to the canary: the stable is scaled to 1, so
        # the abort must restore its version and its size (the path that changed the template).
        wait_for(lambda: status().get("stepState") == "Gating"
                 and get(cluster, ns, "deployment", TARGET)["spec"]["replicas"] == 1,
                 "step 1 gating with the stable scaled to 1")
        survivors = _pods(cluster, ns)
        cluster.kubectl("patch", "-n", ns, "mro", "v2", "--type=merge",
                        "-p", '{"spec": {"abort": true}}')
        wait_for(lambda: status().get("phase") == "RolledBack", "rolled back", 120)
        wait_for(lambda: _settled(cluster, ns, 2), "the stable back on 2 ready pods")
    finally:
        op.stop()
    assert_no_forbidden(op.log())
    assert _template(cluster, ns) == installed_tpl
    assert _replica_sets(cluster, ns) == installed_rs
    after_rollback = _pods(cluster, ns)
    assert set(survivors) <= set(after_rollback), (survivors, after_rollback)

    out = cluster.helm("upgrade", RELEASE, str(CHART), *helm, timeout_s=180).stdout
    assert "REVISION: 2" in out, out
    wait_for(lambda: _settled(cluster, ns, 2), "the stable settled after helm upgrade")
    assert _template(cluster, ns) == installed_tpl
    assert _replica_sets(cluster, ns) == installed_rs
    assert _pods(cluster, ns) == after_rollback  # same pods: same names, same warm caches
    cluster.helm("uninstall", RELEASE, "-n", ns, "--wait=false", check=False)
