"""CRDs are generated from the typed models, are structural, and the committed YAML is current."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator.api import KVCachePolicySpec, ModelRolloutSpec
from kvfleet_operator.crdgen import main, render_all

ROOT = Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "c" * 64


def test_committed_crds_are_up_to_date() -> None:
    for name, text in render_all().items():
        path = ROOT / name
        assert path.read_text(encoding="utf-8") == text, (
            f"{path} is stale: run python -m kvfleet_operator.crdgen"
        )


def test_check_mode_reports_a_stale_folder(tmp_path: Path) -> None:
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert main(["--root", str(tmp_path)]) == 0
    assert main(["--check", "--root", str(tmp_path)]) == 0


def _crds() -> dict[str, dict[str, Any]]:
    out = {}
    for path, text in render_all().items():
        if not path.startswith("crds/"):
            continue
        for doc in yaml.safe_load_all(text):
            out[doc["spec"]["names"]["kind"]] = doc
    return out


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


@pytest.mark.parametrize("kind", ["KVCachePolicy", "ModelRollout"])
def test_schema_is_structural(kind: str) -> None:
    version = _crds()[kind]["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title", "const"):
            assert forbidden not in node, f"{path}: {forbidden}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
    assert version["subresources"] == {"status": {}}
    assert "default" not in yaml.safe_dump(schema["properties"]["status"])


def test_names_columns_and_rules() -> None:
    crds = _crds()
    policy, rollout = crds["KVCachePolicy"], crds["ModelRollout"]
    assert policy["spec"]["group"] == rollout["spec"]["group"] == "kvfleet.dev"
    assert policy["spec"]["scope"] == rollout["spec"]["scope"] == "Namespaced"
    assert policy["spec"]["names"]["shortNames"] == ["kvcp", "kvpolicy"]
    assert rollout["spec"]["names"]["shortNames"] == ["mro", "mrollout"]
    columns = [c["name"] for c in rollout["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:4] == ["Target", "Phase", "Step", "Steps"] and columns[-1] == "Age"
    # Columns for people: rounded strings with units, each a field of the status schema.
    for crd, wanted in ((policy, {"BreakEven": ".status.breakEven"}),
                        (rollout, {"HitRate": ".status.hitRatePercent",
                                   "Baseline": ".status.baselinePercent"})):
        version = crd["spec"]["versions"][0]
        shown = {c["name"]: c for c in version["additionalPrinterColumns"]}
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        for name, path in wanted.items():
            assert (shown[name]["jsonPath"], shown[name]["type"]) == (path, "string")
            assert status[path.rsplit(".", 1)[1]]["type"] == "string"
    spec = rollout["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert "self.weightsDigest == oldSelf.weightsDigest" in rules
    assert spec["properties"]["gate"]["properties"]["windowSeconds"]["default"] == 1800
    assert spec["properties"]["gate"]["properties"]["recoveryPercent"]["default"] == 90
    assert spec["properties"]["steps"]["default"] == [
        {"replicas": 1},
        {"percent": 10},
        {"percent": 50},
        {"percent": 100},
    ]


def test_defaults_of_the_models_match_the_design() -> None:
    spec = ModelRolloutSpec.model_validate({"targetRef": {"name": "llm"}, "weightsDigest": DIGEST})
    assert [(s.replicas, s.percent) for s in spec.steps] == [
        (1, None),
        (None, 10),
        (None, 50),
        (None, 100),
    ]
    assert (spec.gate.recovery_percent, spec.gate.window_seconds) == (90, 1800)
    policy = KVCachePolicySpec.model_validate({"selector": {"matchLabels": {"app": "llm"}}})
    assert (policy.affinity.k, policy.affinity.occupancy_threshold) == (3, 0.85)
    assert policy.tiers.nvme.shadow is True


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"steps": [{"percent": 50}]}, "the last step must be percent: 100"),
        ({"steps": [{"replicas": 1, "percent": 10}, {"percent": 100}]}, "exactly one"),
        ({"surge": {"mode": "Fixed"}}, "mode Fixed needs replicas"),
        ({"surge": {"mode": "Computed"}}, "replicaPrefillTokensPerSecond"),
        ({"metrics": {"cacheStats": {"enabled": False}}}, "need a metric source"),
        ({"weightsDigest": "latest"}, "weightsDigest"),
        ({"gate": {"recoveryPercent": 0}}, "recoveryPercent"),
    ],
)
def test_model_validators_mirror_the_cel_rules(data: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"targetRef": {"name": "llm"}, "weightsDigest": DIGEST}
    with pytest.raises(ValidationError, match=message):
        ModelRolloutSpec.model_validate(base | data)


def test_policy_admission_rule() -> None:
    with pytest.raises(ValidationError, match="hotSightings"):
        KVCachePolicySpec.model_validate(
            {
                "selector": {"matchLabels": {"app": "llm"}},
                "admission": {"minSightings": 4, "hotSightings": 3},
            }
        )


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("examples/kvcachepolicy.yaml", KVCachePolicySpec),
        ("examples/modelrollout.yaml", ModelRolloutSpec),
    ],
)
def test_examples_are_valid(path: str, model: type[KVCachePolicySpec | ModelRolloutSpec]) -> None:
    doc = yaml.safe_load((ROOT / path).read_text(encoding="utf-8"))
    assert doc["apiVersion"] == "kvfleet.dev/v1alpha1"
    model.model_validate(doc["spec"])


def test_cluster_role_is_generated_and_grants_no_secrets() -> None:
    role = yaml.safe_load(render_all()["operator/rbac/clusterrole.yaml"])
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert "secrets" not in resources and "*" not in resources
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs and "escalate" not in verbs


def _fields(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every named field under `node` (what `kubectl explain` lists), through arrays of objects."""
    found = []
    for name, child in node.get("properties", {}).items():
        found.append((f"{path}.{name}", child))
        found += _fields(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        found += _fields(node["items"], f"{path}[]")
    return found


@pytest.mark.parametrize("kind", ["KVCachePolicy", "ModelRollout"])
def test_every_field_has_a_description(kind: str) -> None:
    schema = _crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = _fields(schema)
    assert len(fields) > 40  # the walk reaches the nested fields, not just the top
    missing = [
        path
        for path, node in fields
        # metadata is ObjectMeta, which the API server describes (and allows nothing else on).
        if path != ".metadata" and not node.get("description", "").strip()
    ]
    assert not missing, f"{kind}: fields without a description: {', '.join(missing)}"


@pytest.mark.parametrize("kind", ["KVCachePolicy", "ModelRollout"])
def test_every_spec_default_is_in_its_description(kind: str) -> None:
    spec = _crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for path, node in _fields(spec, ".spec"):
        if "default" in node and node.get("type") != "object":
            default = node["default"]
            if default in ("", []):
                shown = "empty"
            elif isinstance(default, bool | list):
                shown = json.dumps(default, separators=(", ", ": "))
            else:
                shown = str(default)
            assert node["description"].endswith(f"Default: {shown}."), (path, node["description"])


def test_explain_texts_of_the_fields_the_issue_named() -> None:
    crds = _crds()
    policy = crds["KVCachePolicy"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = policy["properties"]["spec"]
    affinity = spec["properties"]["affinity"]["properties"]
    assert affinity["k"]["description"].endswith("Default: 3.")
    assert "KV occupancy (0-1" in affinity["occupancyThreshold"]["description"]
    assert spec["description"].startswith("A cache-aware fleet")
    measured = spec["properties"]["tiers"]["properties"]["nvme"]["properties"]
    assert "GB/s (1e9 bytes/s)" in measured["measuredBandwidthGBps"]["description"]
    rollout = crds["ModelRollout"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props = rollout["properties"]["spec"]["properties"]
    assert props["abort"]["description"].endswith("cannot be undone. Default: false.")
    assert props["paused"]["description"].endswith("Default: false.")
    assert "Seconds between two evaluations" in (
        props["gate"]["properties"]["checkIntervalSeconds"]["description"]
    )
    assert props["digestEnv"]["description"].endswith("Default: KVFLEET_WEIGHTS_DIGEST.")
    assert props["steps"]["description"].endswith(
        'Default: [{"replicas": 1}, {"percent": 10}, {"percent": 50}, {"percent": 100}].'
    )
    assert rollout["properties"]["status"]["description"].startswith("Where the rollout is")


def test_the_tp_degree_rule_covers_every_head_split_profile() -> None:
    """The CEL twin of check_tp_degree: one rule per KV head count naming its profiles, with the
    field path; MLA profiles (any TP degree) are in none."""
    policy = _crds()["KVCachePolicy"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    model = policy["properties"]["spec"]["properties"]["model"]
    (rule,) = model["x-kubernetes-validations"]
    assert rule == {
        "rule": "!(self.profile in ['reference-70b', 'llama-3-8b', 'llama-3-405b'])"
        " || 8 % self.tpDegree == 0",
        "message": "tpDegree must divide the 8 KV heads of reference-70b, llama-3-8b, "
        "llama-3-405b (1, 2, 4, 8): rank r of a replica holds heads h % tpDegree == r, so "
        "every rank needs the same number of whole heads",
        "fieldPath": ".tpDegree",
    }


@pytest.mark.parametrize(
    ("profile", "tp", "ok"),
    [
        ("reference-70b", 4, True),
        ("reference-70b", 8, True),
        ("reference-70b", 3, False),
        ("reference-70b", 16, False),
        ("llama-3-8b", 6, False),
        ("deepseek-v3", 3, True),  # MLA: one latent per token, not split by heads
    ],
)
def test_the_model_validator_mirrors_the_tp_degree_rule(profile: str, tp: int, ok: bool) -> None:
    data = {"selector": {"matchLabels": {"app": "llm"}}, "model": {"profile": profile}}
    data["model"]["tpDegree"] = tp  # type: ignore[index]
    if ok:
        assert KVCachePolicySpec.model_validate(data).model.tp_degree == tp
    else:
        with pytest.raises(ValidationError, match=f"TP degree {tp} does not divide"):
            KVCachePolicySpec.model_validate(data)
