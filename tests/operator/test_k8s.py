"""The operator against the real control plane (tests/cluster): CRDs, RBAC, policies, rollouts.

The operator runs as a subprocess (`kvfleet-operator run`) authenticated as its own ServiceAccount,
bound to the generated ClusterRole (operator/rbac/clusterrole.yaml) and nothing else; its log must
not contain a single 403. CRs are applied with kubectl; bad ones must be refused by the API server
with the field path. Rollouts are gated on a real Prometheus scraping real `kvfleet replica`
processes, one per kwok pod (see replicas.py).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfleet_operator.constants import WEIGHTS_DIGEST_ANNOTATION
from kvfleet_runtime.config.fleet import parse_fleet_config
from tests.cluster.fixtures import Cluster, CommandError, Identity
from tests.operator.conftest import (
    NEW,
    OLD,
    OperatorProcess,
    apply,
    assert_no_forbidden,
    get,
    replica_deployment,
    start_operator,
    wait_for,
)
from tests.operator.replicas import Prometheus, ReplicaFarm

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


# ---------------------------------------------------------------------------------------------
# schema: bad CRs are refused with the field path


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        (
            "KVCachePolicy",
            {"selector": {"matchLabels": {"a": "b"}}, "affinity": {"k": 0}},
            "spec.affinity.k",
        ),
        (
            "KVCachePolicy",
            {
                "selector": {"matchLabels": {"a": "b"}},
                "admission": {"minSightings": 5, "hotSightings": 3},
            },
            "spec.admission.hotSightings: Invalid value",
        ),
        (
            "KVCachePolicy",
            {
                "selector": {"matchLabels": {"a": "b"}},
                "tiers": {"nvme": {"mode": "Disabled", "measuredBandwidthGBps": 6}},
            },
            "spec.tiers.nvme.measuredBandwidthGBps",
        ),
        (
            "KVCachePolicy",
            {"selector": {"matchLabels": {"a": "b"}}, "fleet": "Streaming"},
            'spec.fleet: Unsupported value: "Streaming"',
        ),
        ("KVCachePolicy", {"affinity": {"k": 3}}, "spec.selector: Required value"),
        # The arithmetic's refusal, at admission: 3 GPUs cannot split 8 KV heads evenly.
        (
            "KVCachePolicy",
            {"selector": {"matchLabels": {"a": "b"}}, "model": {"tpDegree": 3}},
            "spec.model.tpDegree: Invalid value",
        ),
        (
            "KVCachePolicy",
            {
                "selector": {"matchLabels": {"a": "b"}},
                "model": {"profile": "llama-3-8b", "tpDegree": 16},
            },
            "tpDegree must divide the 8 KV heads of reference-70b, llama-3-8b, llama-3-405b",
        ),
        (
            "ModelRollout",
            {"targetRef": {"name": "llm"}, "weightsDigest": "latest"},
            "spec.weightsDigest",
        ),
        (
            "ModelRollout",
            {"targetRef": {"name": "llm"}, "weightsDigest": NEW, "steps": [{"percent": 10}]},
            "the last step must be percent: 100",
        ),
        (
            "ModelRollout",
            {
                "targetRef": {"name": "llm"},
                "weightsDigest": NEW,
                "steps": [{"replicas": 1, "percent": 5}, {"percent": 100}],
            },
            "spec.steps[0]",
        ),
        (
            "ModelRollout",
            {"targetRef": {"name": "llm"}, "weightsDigest": NEW, "surge": {"mode": "Computed"}},
            "spec.surge.replicaPrefillTokensPerSecond",
        ),
        (
            "ModelRollout",
            {"targetRef": {"name": "llm"}, "weightsDigest": NEW, "gate": {"recoveryPercent": 150}},
            "spec.gate.recoveryPercent",
        ),
    ],
)
def test_bad_resources_are_refused_with_the_field_path(
    installed: Cluster, k8s_namespace: str, kind: str, spec: dict[str, Any], message: str
) -> None:
    obj = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    with pytest.raises(CommandError) as info:
        apply(installed, k8s_namespace, obj)
    assert message in info.value.stderr


def test_rollout_identity_fields_are_immutable(installed: Cluster, k8s_namespace: str) -> None:
    obj = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "ModelRollout",
        "metadata": {"name": "r"},
        "spec": {"targetRef": {"name": "nothing-here"}, "weightsDigest": NEW},
    }
    apply(installed, k8s_namespace, obj)
    got = get(installed, k8s_namespace, "modelrollout", "r")
    assert got["spec"]["gate"]["windowSeconds"] == 1800  # defaults applied by the API server
    assert len(got["spec"]["steps"]) == 4
    obj["spec"]["weightsDigest"] = OLD
    with pytest.raises(CommandError) as info:
        apply(installed, k8s_namespace, obj)
    assert "spec.weightsDigest: Invalid value" in info.value.stderr
    assert "weightsDigest is immutable" in info.value.stderr
    installed.kubectl(
        "patch", "-n", k8s_namespace, "mro", "r", "--type=merge", "-p", '{"spec": {"abort": true}}'
    )
    with pytest.raises(CommandError, match="abort cannot be undone"):
        installed.kubectl(
            "patch",
            "-n",
            k8s_namespace,
            "mro",
            "r",
            "--type=merge",
            "-p",
            '{"spec": {"abort": false}}',
        )


def test_the_operator_identity_has_exactly_the_cluster_role(
    operator_identity: Identity, installed: Cluster
) -> None:
    def can(*args: str) -> bool:
        out = operator_identity.kubectl("auth", "can-i", *args, check=False).stdout.strip()
        return out == "yes"

    assert can("patch", "modelrollouts.kvfleet.dev/status", "-A")
    assert can("create", "deployments.apps", "-A")
    assert can("list", "pods", "-A")
    assert not can("delete", "pods", "-A")
    assert not can("get", "secrets", "-A")
    assert not can("delete", "configmaps", "-A")
    assert not can("create", "clusterrolebindings")


# ---------------------------------------------------------------------------------------------
# KVCachePolicy


def policy(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "llm"}},
        "tenants": [f"tenant-{i}" for i in range(50)],
        "platformPrefixes": ["sys-preamble-v1"],
    }
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "KVCachePolicy",
        "metadata": {"name": name},
        "spec": base | spec,
    }


def test_policy_publishes_tiers_and_home_sets(
    installed: Cluster, operator: OperatorProcess, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    apply(installed, ns, replica_deployment("llm", 3))
    installed.kubectl("rollout", "status", "-n", ns, "deployment/llm", "--timeout=90s")
    started = time.monotonic()
    apply(installed, ns, policy("kv"))

    def status() -> dict[str, Any]:
        return get(installed, ns, "kvcachepolicy", "kv").get("status") or {}

    wait_for(lambda: status().get("homeSets", {}).get("numReplicas") == 3, "home sets over 3 pods")
    first_status_s = time.monotonic() - started
    st = status()
    assert st["observedGeneration"] == 1
    assert st["tiersSummary"] == "device,host,peer"
    nvme = next(t for t in st["tiers"] if t["tier"] == "nvme")
    assert nvme["enabled"] is False
    assert nvme["reason"].startswith("break-even 9.26 GB/s vs nvme-gen4 profile 7 GB/s: off")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"

    cm = get(installed, ns, "configmap", "kv-fleet")
    config = parse_fleet_config(cm["data"]["fleet.yaml"])
    pods = get(installed, ns, "pods", "-l", "app=llm")["items"]
    assert {r.name for r in config.replicas} == {p["metadata"]["name"] for p in pods}
    assert all(r.weights_digest == OLD for r in config.replicas)
    # The home sets are in the status, not the text: routers compute them from `replicas`.
    assert config.home_sets == {} and st["homeSets"]["numTenants"] == 50
    assert config.tiers.nvme is False and config.tiers.nvme_shadow is True
    assert config.policy == f"{ns}/kv" and config.platform_prefixes == ("sys-preamble-v1",)
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "KVCachePolicy"

    # Level-triggered and idempotent: timer ticks on an unchanged world write nothing.
    versions = (
        cm["metadata"]["resourceVersion"],
        get(installed, ns, "kvcachepolicy", "kv")["metadata"]["resourceVersion"],
    )
    time.sleep(6)
    assert versions == (
        get(installed, ns, "configmap", "kv-fleet")["metadata"]["resourceVersion"],
        get(installed, ns, "kvcachepolicy", "kv")["metadata"]["resourceVersion"],
    )

    # A replica joins: the home sets follow.
    installed.kubectl("scale", "-n", ns, "deployment/llm", "--replicas=4")
    wait_for(lambda: status()["homeSets"]["numReplicas"] == 4, "home sets over 4 pods")
    config = parse_fleet_config(get(installed, ns, "configmap", "kv-fleet")["data"]["fleet.yaml"])
    assert len(config.replicas) == 4

    # A measured NVMe bandwidth above the break-even turns the tier on (R6).
    installed.kubectl(
        "patch",
        "-n",
        ns,
        "kvcp",
        "kv",
        "--type=merge",
        "-p",
        '{"spec": {"tiers": {"nvme": {"measuredBandwidthGBps": 12}}}}',
    )
    wait_for(lambda: status()["observedGeneration"] == 2, "generation 2 observed")
    nvme = next(t for t in status()["tiers"] if t["tier"] == "nvme")
    assert nvme["enabled"] is True
    assert nvme["reason"] == "break-even 9.26 GB/s vs measured 12 GB/s: on"
    config = parse_fleet_config(get(installed, ns, "configmap", "kv-fleet")["data"]["fleet.yaml"])
    assert config.tiers.nvme is True and config.generation == 2
    (operator.log_path.parent / "reconcile_to_status_s.txt").write_text(f"{first_status_s:.3f}\n")


def test_a_tp_degree_every_profile_allows_is_admitted(
    installed: Cluster, k8s_namespace: str
) -> None:
    """The admission rule refuses only what the arithmetic refuses: an MLA model (one latent per
    token, not split by heads) takes any TP degree, a GQA-8 model any divisor of 8."""
    apply(installed, k8s_namespace, policy("mla", model={"profile": "deepseek-v3", "tpDegree": 3}))
    apply(installed, k8s_namespace, policy("tp8", model={"tpDegree": 8}))
    got = get(installed, k8s_namespace, "kvcp", "mla")
    assert got["spec"]["model"]["tpDegree"] == 3


def test_kubectl_explain_describes_the_fields(installed: Cluster) -> None:
    """What users read: the descriptions, with units and defaults, from the API server's OpenAPI."""

    def explain(field: str) -> str:
        return " ".join(installed.kubectl("explain", field).stdout.split())

    k = wait_for(lambda: explain("kvcachepolicy.spec.affinity.k"), "the CRD's OpenAPI published")
    assert "Replicas in each tenant's home set" in k and "Default: 3." in k
    occupancy = explain("kvcachepolicy.spec.affinity.occupancyThreshold")
    assert "KV occupancy (0-1 of a replica's KV memory)" in occupancy
    assert "Default: 0.85." in occupancy
    spec = explain("kvcachepolicy.spec")
    assert "A cache-aware fleet" in spec and "<no description>" not in spec
    abort = explain("modelrollout.spec.abort")
    assert "Roll back now from any phase" in abort and "Default: false." in abort
    window = explain("modelrollout.spec.gate.windowSeconds")
    assert "Seconds from the canary being ready" in window and "Default: 1800." in window
    rollout_spec = explain("modelrollout.spec")
    assert "<empty>" not in rollout_spec and "<no description>" not in rollout_spec


def test_invalid_rollout_writes_its_condition_once_and_stops(
    installed: Cluster, operator: OperatorProcess, k8s_namespace: str
) -> None:
    """A ModelRollout the operator cannot act on (its target has no container of that name): a
    Ready=False condition that says why, written once; then no more evaluations at all (the
    timer ticks every second; the error is logged once, not once per tick)."""
    ns = k8s_namespace
    apply(installed, ns, replica_deployment("lone", 1))
    apply(
        installed,
        ns,
        {
            "apiVersion": "kvfleet.dev/v1alpha1",
            "kind": "ModelRollout",
            "metadata": {"name": "no-container"},
            "spec": {"targetRef": {"name": "lone", "container": "nope"}, "weightsDigest": NEW},
        },
    )

    def condition() -> dict[str, Any] | None:
        st = get(installed, ns, "mro", "no-container").get("status") or {}
        return next((c for c in st.get("conditions", []) if c["type"] == "Ready"), None)

    cond = wait_for(condition, "Ready condition")
    assert (cond["status"], cond["reason"]) == ("False", "InvalidTarget")
    assert "container 'nope' not in the pod template (has: replica)" in cond["message"]
    def failures() -> list[str]:
        # kopf's line: "Handler 'rollout_changed' failed permanently: <ns>/no-container: ..."
        return [
            line
            for line in operator.log().splitlines()
            if "failed permanently" in line and f"{ns}/no-container:" in line
        ]

    wait_for(failures, "the permanent failure logged")
    version = get(installed, ns, "mro", "no-container")["metadata"]["resourceVersion"]
    time.sleep(5)  # five timer ticks of a 1 s rollout timer
    assert get(installed, ns, "mro", "no-container")["metadata"]["resourceVersion"] == version
    assert len(failures()) == 1, failures()
    status = get(installed, ns, "mro", "no-container")["status"]
    assert status["phase"] == "Pending"
    with pytest.raises(CommandError):
        get(installed, ns, "deployment", "lone-canary")


def test_a_second_operator_never_acts_while_the_first_lives(
    installed: Cluster,
    operator_identity: Identity,
    operator_logs: Path,
    operator: OperatorProcess,
    k8s_namespace: str,
) -> None:
    """Peering: two replicas of the operator never act at once; the lower priority one waits."""
    second = start_operator(operator_identity, operator_logs / "operator-low.log", 1)
    try:
        apply(installed, k8s_namespace, policy("peer"))
        wait_for(
            lambda: get(installed, k8s_namespace, "kvcp", "peer").get("status"),
            "the active operator reconciles",
        )
        time.sleep(3)
    finally:
        second.stop()
    log = second.log()
    assert "Pausing the watch-stream for kvcachepolicies" in log
    assert "Handler 'policy_changed'" not in log and "Timer 'policy_tick'" not in log
    assert "Handler 'policy_changed' is invoked" in operator.log()
    assert_no_forbidden(log)


# ---------------------------------------------------------------------------------------------
# ModelRollout gated on a real Prometheus


@dataclass
class Fleet:
    prometheus: Prometheus
    farm: ReplicaFarm
    old: str  # weights digests of the two tiny checkpoints
    new: str


@pytest.fixture(scope="module")
def fleet(installed: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A real Prometheus and a real replica process per Running pod labelled app=llm."""
    work = tmp_path_factory.mktemp("fleet")
    prom = Prometheus(work)

    def list_pods() -> list[dict[str, Any]]:
        out = installed.kubectl("get", "pods", "-A", "-l", "app=llm", "-o", "json", timeout_s=10)
        items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
        return items

    farm = ReplicaFarm(work, list_pods, prom)
    old, new = farm.generate_models()
    farm.start()
    yield Fleet(prom, farm, old, new)
    farm.close()
    prom.close()


def scraped(fleet: Fleet, ns: str, num_pods: int) -> bool:
    series = fleet.prometheus.query(f'kvfleet_cache_matched_tokens_total{{namespace="{ns}"}} > 0')
    return len({s["metric"]["pod"] for s in series}) >= num_pods


HIT_RATE_QUERY = (
    'sum(rate(kvfleet_cache_matched_tokens_total{namespace="${namespace}",pod=~"${pod_regex}"}'
    '[8s])) / sum(rate(kvfleet_cache_lookup_tokens_total{namespace="${namespace}",'
    'pod=~"${pod_regex}"}[8s]))'
)


def rollout(name: str, fleet: Fleet, window_s: int, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "targetRef": {"name": "llm"},
        "weightsDigest": fleet.new,
        "steps": [{"replicas": 1}, {"percent": 100}],
        "gate": {
            "recoveryPercent": 90,
            "windowSeconds": window_s,
            "holdSeconds": 3,
            "readyTimeoutSeconds": 120,
            "checkIntervalSeconds": 1,
        },
        "surge": {"mode": "Fixed", "replicas": 1},
        "metrics": {
            "prometheus": {"url": fleet.prometheus.url, "hitRateQuery": HIT_RATE_QUERY},
            "cacheStats": {"enabled": False},
        },
    }
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "ModelRollout",
        "metadata": {"name": name},
        "spec": base | spec,
    }


def events(cluster: Cluster, ns: str, name: str) -> list[str]:
    items = get(
        cluster,
        ns,
        "events",
        "--field-selector",
        f"involvedObject.name={name},involvedObject.kind=ModelRollout",
    )["items"]
    items.sort(
        key=lambda e: (
            e.get("lastTimestamp") or e.get("eventTime") or "",
            e["metadata"]["creationTimestamp"],
        )
    )
    return [e["reason"] for e in items]


def test_rollout_that_recovers_is_promoted_step_by_step_across_an_operator_kill(
    installed: Cluster,
    operator: OperatorProcess,
    operator_identity: Identity,
    operator_logs: Path,
    fleet: Fleet,
    k8s_namespace: str,
) -> None:
    ns = k8s_namespace
    apply(installed, ns, replica_deployment("llm", 2, fleet.old))
    installed.kubectl("rollout", "status", "-n", ns, "deployment/llm", "--timeout=90s")
    wait_for(lambda: scraped(fleet, ns, 2), "prometheus scrapes the warm stable replicas", 180)
    apply(installed, ns, rollout("roll", fleet, window_s=240))

    def status() -> dict[str, Any]:
        return get(installed, ns, "mro", "roll").get("status") or {}

    wait_for(lambda: status().get("currentStep") == 2, "step 2 started", 300)
    # Kill the operator without warning in the middle of the rollout, start a fresh one.
    operator.stop(signal.SIGKILL)
    # A higher priority than the killed one, whose peering record outlives it for its lifetime
    # (a lower one would wait that long, as it should).
    replacement = start_operator(operator_identity, operator_logs / "operator-2.log", 200)
    try:
        wait_for(lambda: status().get("phase") == "Succeeded", "rollout succeeded", 420)
        # The event follows the status write: stopping the operator at once could drop it.
        wait_for(lambda: "Succeeded" in events(installed, ns, "roll"), "Succeeded event", 60)
    finally:
        replacement.stop()
        assert_no_forbidden(replacement.log())
    st = status()
    assert [s["index"] for s in st["steps"]] == [0, 1]
    assert [s["result"] for s in st["steps"]] == ["Passed"] * 2
    assert [
        (s["canaryReplicas"], s["stableReplicas"], s["surgeReplicas"]) for s in st["steps"]
    ] == [(1, 1, 1), (2, 0, 1)]
    for s in st["steps"]:
        # Real replicas: the stable's warm hit rate, the canary's recovered one.
        assert s["observedHitRate"] >= s["targetHitRate"] > 0.5
    started = [h["step"] for h in st["history"] if h["reason"] == "StepStarted"]
    assert started == [1, 2]  # nothing skipped, nothing repeated across the kill
    assert st["metricSource"] == "prometheus"
    target = get(installed, ns, "deployment", "llm")
    tpl = target["spec"]["template"]
    assert tpl["metadata"]["annotations"][WEIGHTS_DIGEST_ANNOTATION] == fleet.new
    assert target["spec"]["replicas"] == 2
    wait_for(
        lambda: (
            installed.kubectl("get", "-n", ns, "deployment", "llm-canary", check=False).returncode
            != 0
        ),
        "canary deleted",
    )
    reasons = events(installed, ns, "roll")
    for reason in (
        "StepStarted",
        "CanaryReady",
        "StepPassed",
        "Promoting",
        "TargetReady",
        "Succeeded",
    ):
        assert reason in reasons
    assert not fleet.farm.errors


def test_rollout_that_never_recovers_is_rolled_back(
    installed: Cluster,
    operator_identity: Identity,
    operator_logs: Path,
    fleet: Fleet,
    k8s_namespace: str,
) -> None:
    ns = k8s_namespace
    fleet.farm.broken.add(ns)
    op = start_operator(operator_identity, operator_logs / "operator-3.log", 300)
    try:
        apply(installed, ns, replica_deployment("llm", 2, fleet.old))
        installed.kubectl("rollout", "status", "-n", ns, "deployment/llm", "--timeout=90s")
        wait_for(lambda: scraped(fleet, ns, 2), "prometheus scrapes the warm stable replicas", 180)
        apply(installed, ns, rollout("bad", fleet, window_s=90))

        def status() -> dict[str, Any]:
            return get(installed, ns, "mro", "bad").get("status") or {}

        wait_for(lambda: status().get("phase") == "RolledBack", "rolled back", 300)
        st = status()
        assert st["reason"] == "HitRateNotRecovered"
        assert "a cache-key field probably changed" in st["message"]
        assert st["steps"][0]["result"] == "TimedOut"
        assert st["steps"][0]["observedHitRate"] < 0.2 < st["steps"][0]["baselineHitRate"]
        assert st["previous"] == {
            "weightsDigest": fleet.old,
            "image": "registry.invalid/kvfleet:1",
            "replicas": 2,
        }
        target = get(installed, ns, "deployment", "llm")
        assert target["spec"]["replicas"] == 2
        tpl = target["spec"]["template"]
        assert tpl["metadata"]["annotations"][WEIGHTS_DIGEST_ANNOTATION] == fleet.old
        wait_for(
            lambda: (
                installed.kubectl(
                    "get", "-n", ns, "deployment", "llm-canary", check=False
                ).returncode
                != 0
            ),
            "canary deleted",
        )
        wait_for(lambda: {"HitRateNotRecovered", "RolledBack"} <= set(events(installed, ns, "bad")),
                 "HitRateNotRecovered and RolledBack events", 60)
        degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True"
    finally:
        op.stop()
    assert_no_forbidden(op.log())


def test_pause_and_abort_through_the_spec(
    installed: Cluster,
    operator_identity: Identity,
    operator_logs: Path,
    fleet: Fleet,
    k8s_namespace: str,
) -> None:
    ns = k8s_namespace
    fleet.farm.broken.add(ns)
    op = start_operator(operator_identity, operator_logs / "operator-4.log", 400)
    try:
        apply(installed, ns, replica_deployment("llm", 2, fleet.old))
        installed.kubectl("rollout", "status", "-n", ns, "deployment/llm", "--timeout=90s")
        apply(installed, ns, rollout("p", fleet, window_s=600))

        def status() -> dict[str, Any]:
            return get(installed, ns, "mro", "p").get("status") or {}

        wait_for(lambda: status().get("stepState") == "Gating", "gating")
        installed.kubectl(
            "patch", "-n", ns, "mro", "p", "--type=merge", "-p", '{"spec": {"paused": true}}'
        )
        wait_for(lambda: status().get("phase") == "Paused", "paused")
        installed.kubectl(
            "patch", "-n", ns, "mro", "p", "--type=merge", "-p", '{"spec": {"abort": true}}'
        )
        wait_for(lambda: status().get("phase") == "RolledBack", "aborted", 120)
        assert status()["reason"] == "Aborted"
        assert get(installed, ns, "deployment", "llm")["spec"]["replicas"] == 2
    finally:
        op.stop()
    assert_no_forbidden(op.log())


def test_operator_log_has_no_forbidden(operator: OperatorProcess, operator_logs: Path) -> None:
    for path in sorted(operator_logs.glob("operator*.log")):
        assert_no_forbidden(path.read_text(encoding="utf-8", errors="replace"))
