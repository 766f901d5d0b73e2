"""Benchmarks of the operator (issue 7), reported as medians: `kvfleet bench operator`.

Planning (pure, no cluster):
  home-sets     rendezvous top-3 homes for 2,000 tenants over 44 replicas (docs/design.md §1)
  fleet-config  the whole publish plan: tiers + home sets + FleetConfig + canonical text
  tiers         the break-even tier decision of one policy
  rollout-step  one evaluation of the rollout state machine
Cluster (tests/lab/operator/test_k8s_bench.py, see `cluster_bench`): reconcile-to-status
latency, operator memory at idle and with 500 KVCachePolicies.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from kvfleet_operator.api import KVCachePolicySpec, ModelRolloutSpec, ModelRolloutStatus
from kvfleet_operator.planning import (
    Observations,
    ReplicaPod,
    Workload,
    advance,
    build_fleet_config,
    decide_tiers,
    plan_home_sets,
)
from kvfleet_runtime.config.fleet import dump_fleet_config

__all__ = ["median_s", "run_all"]


def median_s(fn: Callable[[], object], repeats: int, warmup: int = 1) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {
        "median_ms": round(statistics.median(samples) * 1e3, 3),
        "min_ms": round(min(samples) * 1e3, 3),
        "max_ms": round(max(samples) * 1e3, 3),
        "repeats": repeats,
    }


def run_all(quick: bool = False) -> dict[str, Any]:
    repeats = 5 if quick else 21
    tenants = [f"tenant-{i:04d}" for i in range(2000)]
    pods = [ReplicaPod(f"llm-{i:02d}", f"10.0.0.{i + 1}", ready=True) for i in range(44)]
    names = [p.name for p in pods]
    spec = KVCachePolicySpec.model_validate(
        {"selector": {"matchLabels": {"app": "llm"}}, "tenants": tenants}
    )
    tiers = decide_tiers(spec)

    def publish() -> str:
        # The status's plan is part of what one publish costs.
        plan_home_sets(spec.tenants, names, spec.affinity.k)
        config = build_fleet_config("ns/p", 1, spec, decide_tiers(spec), pods)
        return dump_fleet_config(config)

    rollout = ModelRolloutSpec.model_validate(
        {"targetRef": {"name": "llm"}, "weightsDigest": "sha256:" + "b" * 64}
    )
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    first = advance(
        rollout,
        ModelRolloutStatus(),
        Observations(Workload(44, 44, 44, "sha256:" + "a" * 64, "i"), None, 0.6, None),
        t0,
    )
    gating_obs = Observations(
        Workload(44, 44, 44, "sha256:" + "a" * 64, "i"),
        Workload(1, 1, 1, rollout.weights_digest, "i"),
        0.6,
        0.1,
    )
    text = publish()
    homes = plan_home_sets(tenants, names, 3)
    loads = sorted(homes.tenants_per_replica.values())
    return {
        "home-sets (2000 tenants, 44 replicas, k=3)": median_s(
            lambda: plan_home_sets(tenants, names, 3), repeats
        )
        | {
            "tenants_per_replica_min_median_max": [loads[0], statistics.median(loads), loads[-1]],
        },
        "fleet-config publish plan (same fleet)": median_s(publish, repeats)
        | {"fleet_yaml_bytes": len(text.encode())},
        "tier decision (one policy)": median_s(lambda: decide_tiers(spec), repeats * 10),
        "rollout state machine (one evaluation)": median_s(
            lambda: advance(rollout, first.status, gating_obs, t0 + timedelta(seconds=30)),
            repeats * 10,
        ),
        "break_even_GBps": round(tiers.break_even_bytes_per_s / 1e9, 3),
    }


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def cluster_bench(
    admin: Any,
    namespace: str,
    operator_pid: int,
    num_policies: int = 500,
    num_latency_samples: int = 20,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Reconcile-to-status latency and operator memory on a live cluster.

    `admin` is a kubernetes `ApiClient` allowed to create KVCachePolicies in `namespace`;
    `operator_pid` the running operator (its RSS is read from /proc)."""
    from kubernetes import client

    from kvfleet_operator.constants import GROUP, POLICY_KIND, POLICY_PLURAL, VERSION

    api = client.CustomObjectsApi(admin)

    def create(name: str) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": POLICY_KIND,
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": f"bench-{name}"}}, "tenants": ["a"]},
        }
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, POLICY_PLURAL, body)

    def observed(name: str) -> int:
        obj: dict[str, Any] = api.get_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, namespace, POLICY_PLURAL, name
        )
        return int((obj.get("status") or {}).get("observedGeneration") or 0)

    time.sleep(5)
    idle_rss = _rss_bytes(operator_pid)
    latencies = []
    for i in range(num_latency_samples):
        name = f"latency-{i}"
        start = time.perf_counter()
        create(name)
        while observed(name) < 1:
            if time.perf_counter() - start > 60:
                raise TimeoutError(f"{name}: no status after 60 s")
            time.sleep(0.01)
        latencies.append(time.perf_counter() - start)
    start = time.perf_counter()
    names = [f"load-{i:04d}" for i in range(num_policies - num_latency_samples)]
    for name in names:
        create(name)
    pending = set(names)
    while pending:
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{len(pending)} policies without status after {timeout_s:.0f} s")
        items: dict[str, Any] = api.list_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, namespace, POLICY_PLURAL
        )
        for item in items["items"]:
            if (item.get("status") or {}).get("observedGeneration"):
                pending.discard(item["metadata"]["name"])
        time.sleep(1)
    all_reconciled_s = time.perf_counter() - start
    time.sleep(5)
    loaded_rss = _rss_bytes(operator_pid)
    return {
        "reconcile_to_status_median_ms": round(statistics.median(latencies) * 1e3, 1),
        "reconcile_to_status_max_ms": round(max(latencies) * 1e3, 1),
        "latency_samples": len(latencies),
        "operator_rss_idle_mib": round(idle_rss / 2**20, 1),
        f"operator_rss_{num_policies}_policies_mib": round(loaded_rss / 2**20, 1),
        f"time_to_reconcile_{len(names)}_new_policies_s": round(all_reconciled_s, 1),
    }
