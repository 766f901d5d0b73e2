"""`kvfleet-operator run -n NS` on the real API server: the operator makes the KopfPeering kopf
needs in the namespace and acts (before, it waited for one forever and said nothing at INFO), or,
when it may not make it, exits at once with one line that names the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.fixtures import Cluster, Identity
from tests.operator.conftest import apply, assert_no_forbidden, get, start_operator, wait_for

pytestmark = [pytest.mark.k8s]


def _policy() -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "KVCachePolicy",
        "metadata": {"name": "kv"},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "tenants": ["a"]},
    }


def test_run_in_one_namespace_makes_its_peering_and_acts(
    installed: Cluster, operator_identity: Identity, k8s_namespace: str, tmp_path: Path
) -> None:
    ns = k8s_namespace
    op = start_operator(operator_identity, tmp_path / "op.log", priority=700,
                        extra_args=("-n", ns))
    try:
        assert f"peering: KopfPeering {ns}/kvfleet created" in op.log()
        assert f"watching namespaces {ns}; peering 'kvfleet' at priority 700" in op.log()
        apply(installed, ns, _policy())
        wait_for(lambda: get(installed, ns, "configmap", "kv-fleet")["data"]["fleet.yaml"],
                 "the policy's fleet ConfigMap published by the namespaced operator")
        get(installed, ns, "kopfpeering", "kvfleet")
        # The wide table is for people: the break-even rounded, with its unit.
        wait_for(lambda: "9.26 GB/s" in installed.kubectl("get", "-n", ns, "kvcp", "kv",
                                                          "-o", "wide").stdout,
                 "kubectl get kvcp -o wide shows BREAKEVEN 9.26 GB/s")
    finally:
        op.stop()
    assert_no_forbidden(op.log())


def test_run_without_the_right_to_make_the_peering_refuses_at_start(
    installed: Cluster, k8s_namespace: str
) -> None:
    nobody = installed.mint_identity(k8s_namespace, "nobody")  # no role bound
    script = Path(sys.executable).with_name("kvfleet-operator")
    out = subprocess.run([str(script), "run", "-n", k8s_namespace], capture_output=True,
                         text=True, timeout=60, env={"KUBECONFIG": str(nobody.kubeconfig),
                                                    "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out
    (line,) = out.stderr.splitlines()
    assert line.startswith(
        f"kvfleet-operator: cannot create KopfPeering 'kvfleet' in namespace {k8s_namespace!r} "
        "(403): grant `create` on kopfpeerings.kopf.dev"), line
    assert "--standalone" in line
