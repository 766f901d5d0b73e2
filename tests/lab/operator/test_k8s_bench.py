"""Benchmarks on the test cluster (issue 7), not tests: skipped unless KVFLEET_BENCH=1.

    KVFLEET_BENCH=1 pytest tests/lab/operator/test_k8s_bench.py -s -p no:cacheprovider

Prints reconcile-to-status latency and the operator's memory at idle and with 500 policies, and
writes them to $KVFLEET_BENCH_OUT (default: bench-operator-cluster.json in the pytest temp dir).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from kubernetes import client, config

from kvfleet_lab.operator.bench import cluster_bench
from kvfleet_operator.constants import GROUP, POLICY_PLURAL, VERSION
from tests.cluster.fixtures import Cluster, Identity
from tests.operator.conftest import start_operator

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("KVFLEET_BENCH") != "1", reason="KVFLEET_BENCH=1 not set"),
]


def test_cluster_bench(
    installed: Cluster,
    operator_identity: Identity,
    operator_logs: Path,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    op = start_operator(operator_identity, operator_logs / "bench.log", 100, policy_interval_s=60)
    try:
        admin = config.new_client_from_config(str(installed.kubeconfig))
        figures = cluster_bench(admin, k8s_namespace, op.proc.pid, num_policies=500)
        items = client.CustomObjectsApi(admin).list_namespaced_custom_object(
            GROUP, VERSION, k8s_namespace, POLICY_PLURAL
        )["items"]
    finally:
        op.stop()
    # The figures describe what happened: 500 policies, each one reconciled to a status.
    assert len(items) == 500
    assert all((i.get("status") or {}).get("observedGeneration", 0) >= 1 for i in items)
    assert figures["latency_samples"] == 20
    assert 0 < figures["reconcile_to_status_median_ms"] <= figures["reconcile_to_status_max_ms"]
    assert figures["reconcile_to_status_max_ms"] < 60_000  # cluster_bench's per-policy limit
    assert figures["operator_rss_idle_mib"] > 0 and figures["operator_rss_500_policies_mib"] > 0
    assert 0 < figures["time_to_reconcile_480_new_policies_s"] <= 600
    out = Path(os.environ.get("KVFLEET_BENCH_OUT", tmp_path / "bench-operator-cluster.json"))
    out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(figures, indent=2))
