"""Pure manifest builders and the observation helpers of the handlers."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvfleet_operator.constants import TRACK_LABEL, WEIGHTS_DIGEST_ANNOTATION
from kvfleet_operator.handlers import pod_to_replica, workload_of
from kvfleet_operator.manifests import (
    canary_deployment,
    fleet_configmap,
    template_version,
    with_version,
)

OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64


def target() -> dict[str, Any]:
    return {
        "metadata": {"name": "llm", "namespace": "ns", "labels": {"app": "llm"}, "generation": 3},
        "spec": {
            "replicas": 4,
            "selector": {"matchLabels": {"app": "llm"}},
            "strategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {
                    "labels": {"app": "llm"},
                    "annotations": {WEIGHTS_DIGEST_ANNOTATION: OLD},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "replica",
                            "image": "kvfleet:1",
                            "env": [
                                {"name": "KVFLEET_WEIGHTS_DIGEST", "value": OLD},
                                {"name": "OTHER", "value": "x"},
                            ],
                        },
                        {"name": "sidecar", "image": "proxy:1"},
                    ]
                },
            },
        },
        "status": {"observedGeneration": 3, "readyReplicas": 4, "updatedReplicas": 4},
    }


def test_canary_is_the_target_template_with_the_new_version() -> None:
    t = target()
    before = copy.deepcopy(t)
    canary = canary_deployment(
        t, "roll", "uid-1", None, "KVFLEET_WEIGHTS_DIGEST", NEW, "kvfleet:2", 2
    )
    assert t == before  # the target is never mutated
    assert canary["metadata"]["name"] == "llm-canary"
    assert canary["spec"]["replicas"] == 2
    assert canary["spec"]["selector"]["matchLabels"] == {"app": "llm", TRACK_LABEL: "canary"}
    template = canary["spec"]["template"]
    assert template["metadata"]["labels"] == {"app": "llm", TRACK_LABEL: "canary"}
    assert template_version(template, None, "KVFLEET_WEIGHTS_DIGEST") == (NEW, "kvfleet:2")
    env = template["spec"]["containers"][0]["env"]
    assert {"name": "OTHER", "value": "x"} in env
    assert [e["value"] for e in env if e["name"] == "KVFLEET_WEIGHTS_DIGEST"] == [NEW]
    assert template["spec"]["containers"][1]["image"] == "proxy:1"
    owner = canary["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "ModelRollout",
        "roll",
        "uid-1",
        True,
    )
    assert canary["spec"]["strategy"] == {"type": "RollingUpdate"}


def test_named_container_and_unknown_container() -> None:
    template = target()["spec"]["template"]
    new = with_version(template, "sidecar", "D", NEW, "proxy:2")
    assert new["spec"]["containers"][1]["image"] == "proxy:2"
    assert new["spec"]["containers"][0]["image"] == "kvfleet:1"
    with pytest.raises(ValueError, match="container 'nope' not in the pod template"):
        with_version(template, "nope", "D", NEW, "")


def test_empty_digest_restores_a_template_without_one() -> None:
    bare = {"metadata": {"labels": {"app": "llm"}}, "spec": {"containers": [{"name": "r"}]}}
    versioned = with_version(bare, None, "D", NEW, "")
    assert versioned != bare
    assert with_version(versioned, None, "D", "", "") == bare
    assert template_version(bare, None, "D") == ("", "")


def test_with_version_is_a_no_op_when_already_there() -> None:
    template = target()["spec"]["template"]
    once = with_version(template, None, "KVFLEET_WEIGHTS_DIGEST", NEW, "kvfleet:2")
    assert with_version(once, None, "KVFLEET_WEIGHTS_DIGEST", NEW, "kvfleet:2") == once


def _bytes(obj: object) -> str:
    """The template as the API server stores it: key order and list order count."""
    return json.dumps(obj)


def test_with_version_edits_the_env_var_where_it_stands() -> None:
    template = target()["spec"]["template"]
    new = with_version(template, None, "KVFLEET_WEIGHTS_DIGEST", NEW, "")
    assert new["spec"]["containers"][0]["env"] == [
        {"name": "KVFLEET_WEIGHTS_DIGEST", "value": NEW},
        {"name": "OTHER", "value": "x"},
    ]
    assert list(new["metadata"]["annotations"]) == [WEIGHTS_DIGEST_ANNOTATION]


@pytest.mark.parametrize("image", ["", "kvfleet:1"])
def test_setting_the_version_a_template_runs_changes_nothing(image: str) -> None:
    """A rollback restores the stable version: a template already there must not change (a
    changed pod template replaces every stable pod, cold caches)."""
    template = target()["spec"]["template"]
    again = with_version(template, None, "KVFLEET_WEIGHTS_DIGEST", OLD, image)
    assert _bytes(again) == _bytes(template)


def test_restoring_the_previous_version_gives_the_template_back_byte_for_byte() -> None:
    template = target()["spec"]["template"]
    template["spec"]["containers"][0]["env"].append({"name": "LAST", "value": "y"})
    new = with_version(template, None, "KVFLEET_WEIGHTS_DIGEST", NEW, "kvfleet:2")
    assert template_version(new, None, "KVFLEET_WEIGHTS_DIGEST") == (NEW, "kvfleet:2")
    back = with_version(new, None, "KVFLEET_WEIGHTS_DIGEST", OLD, "kvfleet:1")
    assert _bytes(back) == _bytes(template)


def test_digest_from_env_when_no_annotation() -> None:
    template = target()["spec"]["template"]
    del template["metadata"]["annotations"]
    assert template_version(template, None, "KVFLEET_WEIGHTS_DIGEST") == (OLD, "kvfleet:1")


def test_workload_of_a_deployment() -> None:
    t = target()
    w = workload_of(t, None, "KVFLEET_WEIGHTS_DIGEST")
    assert (w.replicas, w.ready_replicas, w.weights_digest, w.settled) == (4, 4, OLD, True)
    t["metadata"]["generation"] = 4
    assert workload_of(t, None, "KVFLEET_WEIGHTS_DIGEST").settled is False


@pytest.mark.parametrize(
    ("status", "deleting", "ready"),
    [
        ({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}, False, True),
        ({"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}, False, False),
        ({"phase": "Pending"}, False, False),
        ({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}, True, True),
    ],
)
def test_pod_readiness(status: dict[str, Any], deleting: bool, ready: bool) -> None:
    meta: dict[str, Any] = {"name": "p", "annotations": {WEIGHTS_DIGEST_ANNOTATION: NEW}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    pod = pod_to_replica({"metadata": meta, "status": {**status, "podIP": "10.1.1.1"}})
    assert (pod.ready, pod.deleting, pod.weights_digest, pod.ip) == (
        ready,
        deleting,
        NEW,
        "10.1.1.1",
    )


def test_fleet_configmap_carries_fleet_yaml_and_its_owner() -> None:
    cm = fleet_configmap("ns", "kv-fleet", "kv", "uid-9", "{}\n")
    assert cm["data"] == {"fleet.yaml": "{}\n"}
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "KVCachePolicy"
