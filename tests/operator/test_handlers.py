"""Handler glue on an in-memory API server: idempotence, 409 retries, actions before status.

The real API server is exercised in test_k8s.py; this pins the handlers' own logic (what they
read, in which order they write, what they skip) with exact write counts."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvfleet_operator import handlers
from kvfleet_operator.constants import WEIGHTS_DIGEST_ANNOTATION
from kvfleet_operator.kube import Conflict, KubeError, retry_on_conflict
from kvfleet_operator.metrics import MetricReading
from kvfleet_operator.planning import Event
from kvfleet_runtime.config.fleet import parse_fleet_config

OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64
Manifest = dict[str, Any]


class FakeKube:
    """Just enough of `Kube`: objects by (kind, name), resourceVersions, injected conflicts.
    Deployments become ready as soon as they are written (like kwok, instantly)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Manifest] = {}
        self.version = 0
        self.writes: list[str] = []
        self.status_conflicts = 0

    def _bump(self, obj: Manifest) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)

    def put(self, kind: str, obj: Manifest) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        obj["metadata"].setdefault("generation", 1)
        self._bump(obj)
        if kind == "Deployment":
            self._settle(obj)
        self.objects[(kind, obj["metadata"]["name"])] = obj

    @staticmethod
    def _settle(dep: Manifest) -> None:
        n = dep["spec"]["replicas"]
        dep["status"] = {
            "observedGeneration": dep["metadata"]["generation"],
            "readyReplicas": n,
            "updatedReplicas": n,
        }

    def get_custom(self, namespace: str, plural: str, name: str) -> Manifest | None:
        obj = self.objects.get((plural, name))
        return copy.deepcopy(obj) if obj else None

    def get_deployment(self, namespace: str, name: str) -> Manifest | None:
        obj = self.objects.get(("Deployment", name))
        return copy.deepcopy(obj) if obj else None

    def list_pods(self, namespace: str, match_labels: dict[str, str]) -> list[Manifest]:
        return [
            copy.deepcopy(o)
            for (kind, _), o in self.objects.items()
            if kind == "Pod" and match_labels.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    def get_configmap_data(self, namespace: str, name: str) -> dict[str, str] | None:
        obj = self.objects.get(("ConfigMap", name))
        return None if obj is None else dict(obj["data"])

    def apply(self, manifest: Manifest) -> None:
        self.writes.append(f"apply {manifest['kind']} {manifest['metadata']['name']}")
        self.put(manifest["kind"], manifest)

    def delete_deployment(self, namespace: str, name: str) -> bool:
        self.writes.append(f"delete {name}")
        return self.objects.pop(("Deployment", name), None) is not None

    def update_deployment(
        self, namespace: str, name: str, change: Callable[[Manifest], Manifest | None]
    ) -> bool:
        current = self.get_deployment(namespace, name)
        assert current is not None
        wanted = change(current)
        if wanted is None:
            return False
        self.writes.append(f"update {name}")
        wanted["metadata"]["generation"] += 1
        self.put("Deployment", wanted)
        return True

    def patch_status(
        self, namespace: str, plural: str, name: str, status: Manifest, resource_version: str
    ) -> None:
        obj = self.objects[(plural, name)]
        if self.status_conflicts:
            self.status_conflicts -= 1
            self._bump(obj)  # someone else wrote in between
            raise Conflict(409, "the object has been modified")
        assert obj["metadata"]["resourceVersion"] == resource_version
        merged = dict(obj.get("status") or {})
        for key, value in status.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        obj["status"] = merged
        self._bump(obj)
        self.writes.append(f"status {plural}/{name}")


def pod(name: str, ip: str, ready: bool = True) -> Manifest:
    return {
        "metadata": {"name": name, "labels": {"app": "llm"}},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def deployment(replicas: int) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": "ns", "labels": {"app": "llm"}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "llm"}},
            "template": {
                "metadata": {
                    "labels": {"app": "llm"},
                    "annotations": {WEIGHTS_DIGEST_ANNOTATION: OLD},
                },
                "spec": {"containers": [{"name": "replica", "image": "kvfleet:1"}]},
            },
        },
    }


@pytest.fixture
def kube() -> FakeKube:
    fake = FakeKube()
    for i in range(3):
        fake.put("Pod", pod(f"llm-{i}", f"10.0.0.{i + 1}"))
    fake.put("Pod", pod("llm-9", "10.0.0.9", ready=False))
    return fake


def test_policy_publishes_once_and_then_writes_nothing(kube: FakeKube) -> None:
    kube.put(
        "kvcachepolicies",
        {
            "metadata": {"name": "kv", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "llm"}}, "tenants": ["a", "b"]},
        },
    )
    assert handlers.reconcile_policy(kube, "ns", "kv") is True  # type: ignore[arg-type]
    assert kube.writes == ["apply ConfigMap kv-fleet", "status kvcachepolicies/kv"]
    config = parse_fleet_config(kube.objects[("ConfigMap", "kv-fleet")]["data"]["fleet.yaml"])
    assert [r.name for r in config.replicas] == ["llm-0", "llm-1", "llm-2"]
    status = kube.objects[("kvcachepolicies", "kv")]["status"]
    assert status["homeSets"]["numReplicas"] == 3 and status["tiersSummary"] == "device,host,peer"
    assert handlers.reconcile_policy(kube, "ns", "kv") is False  # type: ignore[arg-type]
    assert len(kube.writes) == 2


def test_policy_status_conflict_is_retried_from_a_fresh_read(kube: FakeKube) -> None:
    kube.put(
        "kvcachepolicies",
        {"metadata": {"name": "kv"}, "spec": {"selector": {"matchLabels": {"app": "llm"}}}},
    )
    kube.status_conflicts = 2
    handlers.reconcile_policy(kube, "ns", "kv")  # type: ignore[arg-type]
    assert kube.objects[("kvcachepolicies", "kv")]["status"]["observedGeneration"] == 1


def test_conflicts_give_up_after_the_retries() -> None:
    calls = []

    def always() -> None:
        calls.append(1)
        raise Conflict(409, "again")

    with pytest.raises(Conflict):
        retry_on_conflict(always, retries=3)
    assert len(calls) == 3


def test_persistent_conflicts_become_a_kopf_retry_with_a_delay_not_a_sleep(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Conflicts are re-read at once a few times; then the handler hands the wait to kopf
    (TemporaryError(delay=...)) instead of blocking its worker thread in time.sleep."""
    import time

    import kopf

    from kvfleet_operator.kube import CONFLICT_RETRIES

    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"a handler slept {seconds} s")

    monkeypatch.setattr(time, "sleep", no_sleep)
    kube.put(
        "kvcachepolicies",
        {"metadata": {"name": "kv"}, "spec": {"selector": {"matchLabels": {"app": "llm"}}}},
    )
    kube.status_conflicts = CONFLICT_RETRIES
    with pytest.raises(kopf.TemporaryError) as info:
        handlers.reconcile_policy(kube, "ns", "kv")  # type: ignore[arg-type]
    assert info.value.delay == handlers.CONFLICT_DELAY_S
    assert "status" not in kube.objects[("kvcachepolicies", "kv")]
    # kopf's retry: a fresh read, no conflict any more.
    assert handlers.reconcile_policy(kube, "ns", "kv") is True  # type: ignore[arg-type]
    assert kube.objects[("kvcachepolicies", "kv")]["status"]["observedGeneration"] == 1


def test_transient_api_errors_become_temporary_errors(kube: FakeKube) -> None:
    import kopf

    def broken(*_: object) -> None:
        raise KubeError(503, "unavailable")

    kube.get_custom = broken  # type: ignore[method-assign, assignment]
    with pytest.raises(kopf.TemporaryError):
        handlers.reconcile_policy(kube, "ns", "kv")  # type: ignore[arg-type]


def test_invalid_policy_is_permanent_and_says_why(kube: FakeKube) -> None:
    import kopf

    kube.put(
        "kvcachepolicies",
        {
            "metadata": {"name": "kv"},
            "spec": {"selector": {"matchLabels": {"app": "llm"}}, "model": {"tpDegree": 3}},
        },
    )
    with pytest.raises(kopf.PermanentError, match="TP degree 3"):
        handlers.reconcile_policy(kube, "ns", "kv")  # type: ignore[arg-type]
    (cond,) = kube.objects[("kvcachepolicies", "kv")]["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", "InvalidSpec")


def test_rollout_drives_the_deployments_and_writes_status_after_the_actions(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube.put("Deployment", deployment(4))
    kube.put(
        "modelrollouts",
        {
            "metadata": {"name": "roll", "namespace": "ns"},
            "spec": {
                "targetRef": {"name": "llm"},
                "weightsDigest": NEW,
                "gate": {"holdSeconds": 0},
                "steps": [{"percent": 50}, {"percent": 100}],
            },
        },
    )
    rates = {"canary": 0.0}
    monkeypatch.setattr(
        handlers.rollout,
        "read_hit_rates",
        lambda *_, **__: MetricReading(0.6, rates["canary"], None, "prometheus"),
    )
    clock = [datetime(2026, 1, 1, tzinfo=UTC)]
    posted: list[Event] = []

    def tick(seconds: float = 5) -> Manifest:
        clock[0] += timedelta(seconds=seconds)
        handlers.reconcile_rollout(
            kube,  # type: ignore[arg-type]
            "ns",
            "roll",
            now=lambda: clock[0],
            post_event=lambda _body, event: posted.append(event),
        )
        return dict(kube.objects[("modelrollouts", "roll")]["status"])

    status = tick()
    assert (status["phase"], status["currentStep"], status["stepState"]) == (
        "Progressing",
        1,
        "Scaling",
    )
    assert kube.writes[-2:] == ["apply Deployment llm-canary", "status modelrollouts/roll"]
    canary = kube.objects[("Deployment", "llm-canary")]
    assert canary["spec"]["replicas"] == 2
    assert canary["spec"]["template"]["metadata"]["annotations"][WEIGHTS_DIGEST_ANNOTATION] == NEW
    status = tick()
    assert status["stepState"] == "Gating"
    assert kube.objects[("Deployment", "llm")]["spec"]["replicas"] == 2
    writes = len(kube.writes)
    status = tick()  # not recovered yet: only the observed hit rate may change
    assert status["stepState"] == "Gating" and len(kube.writes) - writes <= 1
    rates["canary"] = 0.6
    status = tick()
    assert status["currentStep"] == 2
    tick()
    rates["canary"] = 0.6
    status = tick()
    assert status["phase"] == "Promoting"
    target = kube.objects[("Deployment", "llm")]
    assert target["spec"]["template"]["metadata"]["annotations"][WEIGHTS_DIGEST_ANNOTATION] == NEW
    assert target["spec"]["replicas"] == 4
    tick()
    status = tick()
    assert status["phase"] == "Succeeded"
    assert ("Deployment", "llm-canary") not in kube.objects
    assert "stepState" not in status  # cleared by a null in the merge patch
    assert [e.reason for e in posted][-3:] == ["Promoting", "TargetReady", "Succeeded"]
    writes = len(kube.writes)
    tick(60)
    assert len(kube.writes) == writes  # terminal and settled: reads only


def test_a_fleet_config_too_big_for_a_configmap_is_refused(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kopf

    monkeypatch.setattr(handlers.policy, "MAX_FLEET_CONFIG_BYTES", 2000)
    for i in range(3, 30):  # the replica list is what fills a config now, not the tenants
        kube.put("Pod", pod(f"llm-{i}", f"10.0.1.{i}"))
    kube.put(
        "kvcachepolicies",
        {
            "metadata": {"name": "kv"},
            "spec": {
                "selector": {"matchLabels": {"app": "llm"}},
                "tenants": [f"tenant-{i}" for i in range(100)],
            },
        },
    )
    with pytest.raises(kopf.PermanentError, match="over the 2000 a ConfigMap holds"):
        handlers.reconcile_policy(kube, "ns", "kv")  # type: ignore[arg-type]
    assert ("ConfigMap", "kv-fleet") not in kube.objects
    (cond,) = kube.objects[("kvcachepolicies", "kv")]["status"]["conditions"]
    assert cond["reason"] == "ConfigTooLarge"


def test_a_namespace_being_deleted_is_left_alone(kube: FakeKube) -> None:
    from kvfleet_operator.kube import NamespaceTerminating

    kube.put(
        "kvcachepolicies",
        {"metadata": {"name": "kv"}, "spec": {"selector": {"matchLabels": {"app": "llm"}}}},
    )

    def refuse(manifest: Manifest) -> None:
        raise NamespaceTerminating(403, "namespace ns is being terminated")

    kube.apply = refuse  # type: ignore[method-assign, assignment]
    assert handlers.reconcile_policy(kube, "ns", "kv") is False  # type: ignore[arg-type]


def test_a_rollout_waits_while_another_rollouts_canary_holds_the_target(kube: FakeKube) -> None:
    import kopf

    kube.put("Deployment", deployment(2))
    canary = deployment(1)
    canary["metadata"]["name"] = "llm-canary"
    canary["metadata"]["ownerReferences"] = [
        {"kind": "ModelRollout", "name": "other", "uid": "uid-other", "controller": True}
    ]
    kube.put("Deployment", canary)
    kube.put(
        "modelrollouts",
        {
            "metadata": {"name": "mine", "namespace": "ns"},
            "spec": {"targetRef": {"name": "llm"}, "weightsDigest": NEW},
        },
    )
    with pytest.raises(kopf.TemporaryError, match="belongs to ModelRollout other"):
        handlers.reconcile_rollout(
            kube,  # type: ignore[arg-type]
            "ns",
            "mine",
            post_event=lambda _body, _event: None,
        )
    assert (
        kube.objects[("Deployment", "llm-canary")]["metadata"]["ownerReferences"][0]["name"]
        == "other"
    )


@pytest.mark.parametrize(
    ("spec", "reason", "says"),
    [
        (
            {"targetRef": {"name": "llm"}, "weightsDigest": NEW, "steps": [{"percent": 10}]},
            "InvalidSpec",
            "the last step must be percent: 100",
        ),
        (
            {"targetRef": {"name": "llm", "container": "nope"}, "weightsDigest": NEW},
            "InvalidTarget",
            "target llm: ",
        ),
    ],
)
def test_invalid_rollout_writes_its_condition_once(
    kube: FakeKube, spec: Manifest, reason: str, says: str
) -> None:
    """The condition says why, the phase and the workload stay untouched, and a second
    evaluation (a tick before the schedule stops) writes nothing."""
    import kopf

    kube.put("Deployment", deployment(2))
    kube.put("modelrollouts", {"metadata": {"name": "roll", "namespace": "ns"}, "spec": spec})
    for _ in range(2):
        with pytest.raises(kopf.PermanentError, match=says):
            handlers.reconcile_rollout(
                kube,  # type: ignore[arg-type]
                "ns",
                "roll",
                post_event=lambda _body, _event: None,
            )
    assert kube.writes == ["status modelrollouts/roll"]
    status = kube.objects[("modelrollouts", "roll")]["status"]
    (cond,) = status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "False", reason)
    assert says in cond["message"]
    assert status["phase"] == "Pending" and status["observedGeneration"] == 1
    assert ("Deployment", "llm-canary") not in kube.objects


def test_a_refusal_is_one_status_whatever_the_kind_and_is_written_once() -> None:
    """The one refusal helper: Ready=False with the reason, the rest of the status kept; the same
    refusal again is the same status (so `_write_status` writes nothing), its time unmoved."""
    from kvfleet_operator.api import KVCachePolicyStatus, ModelRolloutStatus

    rollout = ModelRolloutStatus.model_validate({"phase": "Progressing", "currentStep": 2})
    first = handlers.refused_status(rollout, 3, "InvalidTarget", "no container", "T1")
    again = handlers.refused_status(first, 3, "InvalidTarget", "no container", "T2")
    assert again == first
    assert (first.phase.value, first.current_step, first.observed_generation) == (
        "Progressing", 2, 3)
    (ready,) = first.conditions
    assert (ready.type, ready.status.value, ready.reason, ready.last_transition_time) == (
        "Ready", "False", "InvalidTarget", "T1")
    policy = handlers.refused_status(KVCachePolicyStatus(), 1, "InvalidSpec", "x" * 3000, "T1")
    assert len(policy.conditions[0].message) == 2000
