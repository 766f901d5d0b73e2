"""Every object the chart renders, validated by a real kube-apiserver (tests/cluster): the chart's
CRDs are applied, then `kubectl apply --dry-run=server` of the rendered release, so the API server
checks each object against its schema (strict field validation: an unknown or misspelt field is an
error), the peering object against kopf's CRD, and RBAC objects against the admin's rights.
Nothing is created. Installing and running the chart for real is the end-to-end suite's job."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.chart.conftest import CHART, CI_VALUES, kube_version, template_args
from tests.cluster.fixtures import Cluster

pytestmark = pytest.mark.k8s


GIE_CRD = Path(__file__).parent / "testdata" / "inference.networking.k8s.io_inferencepools.yaml"
"""The GIE's InferencePool CRD, for the epp scenario's pool (a GIE cluster has it installed)."""


@pytest.mark.parametrize(
    "scenario", ["default-values.yaml", "external-redis-secret-values.yaml", "vllm-values.yaml",
                 "epp-values.yaml"]
)
def test_api_server_accepts_every_rendered_object(
    k8s_cluster: Cluster, k8s_namespace: str, scenario: str
) -> None:
    assert (CI_VALUES / scenario).is_file()
    k8s_cluster.kubectl("apply", "-f", str(CHART / "crds"))
    for crd in ("kvcachepolicies.kvfleet.dev", "modelrollouts.kvfleet.dev",
                "kopfpeerings.kopf.dev"):
        k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    if scenario == "epp-values.yaml":
        k8s_cluster.kubectl("apply", "-f", str(GIE_CRD))
        k8s_cluster.kubectl("wait", "--for=condition=Established",
                            "crd/inferencepools.inference.networking.k8s.io", "--timeout=60s")
    # A release named after the test's namespace: its cluster-scoped objects (ClusterRole and
    # binding) cannot collide with another test's, and watching only this namespace puts the
    # peering object there (the ClusterKopfPeering "kvfleet" is shared by the whole cluster).
    args = template_args([scenario], [f"operator.watchNamespaces={{{k8s_namespace}}}"])
    args[1] = k8s_namespace
    args[args.index("--namespace") + 1] = k8s_namespace
    rendered = k8s_cluster.helm(*args).stdout
    objects = [d for d in yaml.safe_load_all(rendered) if d]
    result = k8s_cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", k8s_namespace, "-f", "-",
        stdin=rendered,
    )
    accepted = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    assert len(accepted) == len(objects), result.stdout + result.stderr
    assert kube_version().startswith("v1.")
