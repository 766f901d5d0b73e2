"""Against the real API server: a KVCachePolicy over 1,000 replica pods and 20,000 tenants.

The published fleet config fits a ConfigMap (it carries the replica list, not the home sets), a
router and a replica read it with the one loader they use, the router's own rendezvous over its
replica list gives the operator's planned homes, and the status summarizes the plan. One pod
leaving is re-planned from the previous plan and published. The pods are kwok's (Running and
Ready, nothing runs in them), bound straight to the fake nodes so the scheduler's pod limit of
the three nodes does not cap the fleet; the reconcile runs in process with the operator's own
ServiceAccount (its RBAC is what it gets in production). Times are printed, never asserted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as kube_client
from kubernetes import config as kube_config

from kvfleet_operator.handlers import HomeSetPlans, reconcile_policy
from kvfleet_operator.kube import Kube
from kvfleet_runtime.affinity import ReplicaLoad, choose_replica, rendezvous_top_k
from kvfleet_runtime.config.fleet import load_fleet_config
from kvfleet_runtime.config.watch import MAX_CONFIG_BYTES
from kvfleet_runtime.picker import FleetView
from tests.cluster.fixtures import Cluster, Identity
from tests.operator.conftest import OLD, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NUM_REPLICAS = 1000
NUM_TENANTS = 20_000
LABELS = {"app": "llm-scale"}


class TimedKube(Kube):
    """The operator's Kube, noting when the fleet ConfigMap was applied."""

    applied_at: float | None = None

    def apply(self, manifest: dict[str, Any]) -> None:
        super().apply(manifest)
        if manifest["kind"] == "ConfigMap":
            self.applied_at = time.perf_counter()


def _pod(i: int, nodes: tuple[str, ...]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"llm-{i:04d}",
            "labels": LABELS,
            "annotations": {"kvfleet.dev/weights-digest": OLD},
        },
        "spec": {
            "nodeName": nodes[i % len(nodes)],
            "containers": [{"name": "replica", "image": "registry.invalid/kvfleet:1"}],
        },
    }


def _running(pods: list[dict[str, Any]]) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in pods
        if (p.get("status") or {}).get("podIP")
        and any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or [])
    ]


@pytest.fixture
def admin(installed: Cluster) -> Iterator[kube_client.CoreV1Api]:
    configuration = kube_client.Configuration()
    kube_config.load_kube_config(str(installed.kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = 8  # the pod creations below run 8 at a time
    api = kube_client.ApiClient(configuration)
    yield kube_client.CoreV1Api(api)
    api.close()


def test_a_policy_over_1000_replicas_and_20000_tenants_publishes_a_config_that_fits(
    installed: Cluster, operator_identity: Identity, k8s_namespace: str,
    admin: kube_client.CoreV1Api, tmp_path: Path,
) -> None:
    ns = k8s_namespace
    if not installed.gpu_nodes:
        pytest.skip("needs the local cluster's kwok nodes")
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: admin.create_namespaced_pod(ns, _pod(i, installed.gpu_nodes)),
                          range(NUM_REPLICAS)))

        def pods() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = json.loads(admin.list_namespaced_pod(
                ns, label_selector="app=llm-scale", _preload_content=False).data)["items"]
            return out

        wait_for(lambda: len(_running(pods())) == NUM_REPLICAS,
                 f"{NUM_REPLICAS} pods Running and Ready", timeout_s=300)
        pods_s = time.perf_counter() - started

        tenants = [f"tenant-{i:05d}" for i in range(NUM_TENANTS)]
        custom = kube_client.CustomObjectsApi(admin.api_client)
        custom.create_namespaced_custom_object("kvfleet.dev", "v1alpha1", ns, "kvcachepolicies", {
            "apiVersion": "kvfleet.dev/v1alpha1",
            "kind": "KVCachePolicy",
            "metadata": {"name": "kv"},
            "spec": {"selector": {"matchLabels": LABELS}, "tenants": tenants},
        })
        kube = TimedKube(kube_config.new_client_from_config(str(operator_identity.kubeconfig)))

        plans = HomeSetPlans()  # the operator's, kept between reconciles
        t0 = time.perf_counter()
        assert reconcile_policy(kube, ns, "kv", plans=plans) is True
        reconcile_s = time.perf_counter() - t0
        assert kube.applied_at is not None
        publish_s = kube.applied_at - t0

        cm = admin.read_namespaced_config_map("kv-fleet", ns)
        text = cm.data["fleet.yaml"]
        size = len(text.encode())
        assert size < MAX_CONFIG_BYTES
        path = tmp_path / "fleet.yaml"
        path.write_text(text)
        t0 = time.perf_counter()
        config = load_fleet_config(path)  # what a replica and the router read
        parse_s = time.perf_counter() - t0
        names = sorted(r.name for r in config.replicas)
        assert len(names) == NUM_REPLICAS and config.home_sets == {}

        st = custom.get_namespaced_custom_object(
            "kvfleet.dev", "v1alpha1", ns, "kvcachepolicies", "kv")["status"]
        homes = st["homeSets"]
        assert (homes["numTenants"], homes["numReplicas"], homes["k"]) == (
            NUM_TENANTS, NUM_REPLICAS, 3)
        # 60 tenants per replica on average; rendezvous spreads them within a few x of it.
        assert 20 <= homes["minTenantsPerReplica"] <= 60 <= homes["maxTenantsPerReplica"] <= 150

        # The router, from the same file, routes each tenant to the operator's planned homes.
        view = FleetView(config_path=path)
        assert view.reload_config()
        loads = [ReplicaLoad(n, 0.1, 0.0) for n in names]
        for tenant in tenants[:: NUM_TENANTS // 100]:
            d = choose_replica(tenant, loads, k=3, occupancy_threshold=0.85,
                               home_set=view.home_set(tenant))
            assert d is not None
            assert d.homes == tuple(rendezvous_top_k(tenant, names, 3))

        # Nothing changed: nothing written.
        assert reconcile_policy(kube, ns, "kv", plans=plans) is False

        # One pod leaves: re-planned from the previous plan, published without it.
        gone = names[17]
        admin.delete_namespaced_pod(gone, ns, grace_period_seconds=0)
        wait_for(lambda: gone not in {p["metadata"]["name"] for p in pods()}, f"{gone} deleted")
        kube.applied_at = None
        t0 = time.perf_counter()
        assert reconcile_policy(kube, ns, "kv", plans=plans) is True
        replan_s = time.perf_counter() - t0
        assert kube.applied_at is not None
        republish_s = kube.applied_at - t0
        path.write_text(admin.read_namespaced_config_map("kv-fleet", ns).data["fleet.yaml"])
        config = load_fleet_config(path)
        assert gone not in {r.name for r in config.replicas} and len(config.replicas) == 999
        st = custom.get_namespaced_custom_object(
            "kvfleet.dev", "v1alpha1", ns, "kvcachepolicies", "kv")["status"]
        assert st["homeSets"]["numReplicas"] == NUM_REPLICAS - 1
        print(
            f"\nfleet at scale: {NUM_REPLICAS} pods Running in {pods_s:.1f} s; first reconcile "
            f"{reconcile_s:.2f} s (ConfigMap applied after {publish_s:.2f} s), config "
            f"{size} bytes, parsed by a reader in {parse_s:.3f} s; one pod gone: reconcile "
            f"{replan_s:.2f} s (applied after {republish_s:.2f} s)"
        )
    finally:
        # Gone at once, so 1,000 terminating pods do not load the cluster for the next tests.
        admin.delete_collection_namespaced_pod(ns, grace_period_seconds=0,
                                               label_selector="app=llm-scale")
