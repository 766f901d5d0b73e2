"""docs/quickstart.md stays true: its values file passes the chart's schema and renders, and the
KVCachePolicy and ModelRollout it applies are valid for the operator and point at what the chart
renders (the replica pods, the mounted ConfigMap, the replica Deployment and container)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.api import KVCachePolicySpec, ModelRolloutSpec
from kvfleet_operator.constants import API_VERSION
from tests.chart.conftest import (
    CHART,
    ROOT,
    Rendered,
    kube_version,
    kvfleet_cli_params,
    run_helm,
)

QUICKSTART = ROOT / "docs" / "quickstart.md"
TEXT = QUICKSTART.read_text()
RELEASE, NAMESPACE = "kvfleet", "llm"


def _yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", TEXT, flags=re.S)


def _heredocs() -> list[dict[str, Any]]:
    """Objects of every `kubectl apply -f - <<'EOF' ... EOF` in the guide."""
    docs = []
    for body in re.findall(r"<<'EOF'\n(.*?)\nEOF", TEXT, flags=re.S):
        docs += [d for d in yaml.safe_load_all(body) if d]
    return docs


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _heredocs() if d["kind"] == kind]


def _values_file(tmp_path: Path) -> Path:
    (block,) = [b for b in _yaml_blocks() if b.startswith("operator:")]
    path = tmp_path / "my-values.yaml"
    path.write_text(block.replace("<the digest printed above>", "0" * 64))
    return path


@pytest.fixture
def rendered(helm: Path, helm_env: dict[str, str], tmp_path: Path) -> Rendered:
    result = run_helm(
        helm, helm_env, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--kube-version", kube_version(), "--values", str(_values_file(tmp_path)),
    )
    assert result.returncode == 0, result.stderr
    return Rendered([d for d in yaml.safe_load_all(result.stdout) if d])


def test_values_file_lints(helm: Path, helm_env: dict[str, str], tmp_path: Path) -> None:
    result = run_helm(
        helm, helm_env, "lint", "--strict", str(CHART), "--values", str(_values_file(tmp_path)),
        "--kube-version", kube_version(),
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_policy_is_valid_and_governs_the_charts_replicas(rendered: Rendered) -> None:
    (policy,) = _of_kind("KVCachePolicy")
    assert policy["apiVersion"] == API_VERSION
    spec = KVCachePolicySpec.model_validate(policy["spec"])
    replica = rendered.get("Deployment", "kvfleet-replica")
    pod_labels = replica["spec"]["template"]["metadata"]["labels"]
    assert spec.selector.match_labels.items() <= pod_labels.items()
    assert spec.replica_port == replica["spec"]["template"]["spec"]["containers"][0]["ports"][0][
        "containerPort"
    ]
    mounted = {
        v["configMap"]["name"]
        for v in replica["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    }
    assert spec.config_map_name in mounted
    assert policy["metadata"]["name"] == "kvfleet"
    # The router's keys file knows the tenants whose home sets are published.
    keys = yaml.safe_load(rendered.get("Secret", "kvfleet-router-keys")["stringData"]["keys.yaml"])
    assert set(spec.tenants) <= set(keys["tenants"])


def test_rollout_is_valid_and_targets_the_charts_deployment(rendered: Rendered) -> None:
    (rollout,) = _of_kind("ModelRollout")
    spec = ModelRolloutSpec.model_validate(rollout["spec"])
    target = rendered.get("Deployment", spec.target_ref.name)
    containers = [c["name"] for c in target["spec"]["template"]["spec"]["containers"]]
    assert spec.target_ref.container in containers
    current = target["spec"]["template"]["metadata"]["annotations"]["kvfleet.dev/weights-digest"]
    assert spec.weights_digest != current, "a rollout to what already runs"
    # Both digests are the folders the guide copies onto the volume.
    assert current in TEXT and spec.weights_digest in TEXT


def test_guide_names_only_real_objects(rendered: Rendered) -> None:
    names = set(rendered.names())
    for name in ("Service/kvfleet-router", "Deployment/kvfleet-replica", "Secret/kvfleet-peer"):
        assert name in names, name
    assert "svc/kvfleet-router 8080:80" in TEXT
    assert rendered.get("Service", "kvfleet-router")["spec"]["ports"][0]["port"] == 80


def test_guide_uses_the_real_kvfleet_commands() -> None:
    lines = re.findall(r"scripts/kvfleet\.sh (model generate [^\n]+)", TEXT)
    assert len(lines) == 2
    seeds = set()
    for line in lines:
        params = kvfleet_cli_params(line.split())
        assert params["preset"] == "small"
        seeds.add(params["seed"])
    assert seeds == {0, 1}
