"""A long-running operator keeps nothing of the objects it no longer has: 1,000 objects (500
KVCachePolicies and 500 ModelRollouts) created on the real API server, each reconciled (so each
is in the operator's schedule and back-offs), then deleted: the operator's per-object maps
(schedule, locks, back-offs) grew with the objects and are back at their size, empty, after the
deletions.

The sizes are the operator's own, logged by its deletion handler (main.py `_forget`) after each
object it forgets."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from kvfleet_operator.handlers import MAX_HOME_SET_PLANS
from tests.cluster.fixtures import Cluster, Identity
from tests.operator.conftest import OLD, apply, replica_deployment, start_operator, wait_for

# Each object costs the API server about ten writes (kopf's finalizer and bookkeeping, the
# reconcile, the deletion): a few minutes on two busy cores.
pytestmark = [pytest.mark.k8s, pytest.mark.timeout(1500)]

NUM_EACH = 500
_SIZES = re.compile(
    r"(policy|rollout) \S+ deleted: forgotten; now tracking schedule (\d+), locks (\d+), "
    r"nvme_backoff (\d+), stats_backoff (\d+), home_set_plans (\d+)"
)


def _objects(kind: str, make: Any) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List",
                       "items": [make(f"{kind}-{i:04d}") for i in range(NUM_EACH)]})


def _policy(name: str) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "KVCachePolicy",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": "llm"}}, "tenants": ["a"]}}


def _rollout(name: str) -> dict[str, Any]:
    # The target already runs this digest: the rollout succeeds at once (one evaluation each;
    # what is measured here is the bookkeeping, not the state machine).
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "ModelRollout",
            "metadata": {"name": name},
            "spec": {"targetRef": {"name": "llm"}, "weightsDigest": OLD,
                     "steps": [{"percent": 100}]}}


def _num_reconciled(cluster: Cluster, ns: str, plural: str) -> int:
    items = json.loads(cluster.kubectl("get", "-n", ns, plural, "-o", "json").stdout)["items"]
    return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration"))


def test_deleting_objects_forgets_them(
    installed: Cluster, operator_identity: Identity, k8s_namespace: str, tmp_path: Path
) -> None:
    ns = k8s_namespace
    # One replica pod (kwok's: an IP, Ready, nothing behind it): every policy's NVMe read and
    # every rollout's first /cache/stats read find it silent, so the back-offs hold an entry per
    # object too.
    apply(installed, ns, replica_deployment("llm", 1))
    started = time.monotonic()
    for kind, make in (("kv", _policy), ("roll", _rollout)):  # before the operator: it resumes
        installed.kubectl("create", "-n", ns, "-f", "-", stdin=_objects(kind, make),
                          timeout_s=600)
    created_s = time.monotonic() - started
    # Timers far apart: 1,000 objects ticking every second would measure the box, not the maps.
    # Each first read waits its 2 s budget on the silent pod: enough workers that many of them
    # wait together.
    op = start_operator(operator_identity, tmp_path / "op.log", priority=800,
                        policy_interval_s=600, rollout_interval_s=600, extra_args=("-n", ns),
                        env={"KVFLEET_OPERATOR_WORKERS": "64"})
    try:
        started = time.monotonic()
        for plural in ("kvcachepolicies", "modelrollouts"):
            wait_for(lambda p=plural: _num_reconciled(installed, ns, p) == NUM_EACH,
                     f"all {NUM_EACH} {plural} reconciled", 600)
        reconciled_s = time.monotonic() - started
        for plural in ("kvcachepolicies", "modelrollouts"):
            installed.kubectl("delete", "-n", ns, plural, "--all", "--wait=false",
                              timeout_s=600)

        def forgotten() -> list[tuple[str, ...]]:
            found = _SIZES.findall(op.log())
            return found if len(found) == 2 * NUM_EACH else []

        sizes = wait_for(forgotten, "every deleted object forgotten", 300)
        forgotten_s = time.monotonic() - started - reconciled_s
        # Once all is quiet, one more policy in and out: what its deletion leaves is the size.
        apply(installed, ns, _policy("last"))
        wait_for(lambda: _num_reconciled(installed, ns, "kvcachepolicies") == 1, "last policy")
        installed.kubectl("delete", "-n", ns, "kvcachepolicy", "last")
        last = wait_for(lambda: [m for m in _SIZES.findall(op.log())[2 * NUM_EACH:]],
                        "the last policy forgotten")
    finally:
        op.stop()
    print(f"{2 * NUM_EACH} objects created in {created_s:.0f} s, reconciled in "
          f"{reconciled_s:.0f} s, forgotten in {forgotten_s:.0f} s")
    # Every object was in the schedule (the first deletion leaves the other 999), every one in
    # its back-off (a policy's NVMe reads, a rollout's /cache/stats)...
    assert max(int(s[1]) for s in sizes) == 2 * NUM_EACH - 1, sizes[:3]
    assert max(int(s[3]) for s in sizes) >= NUM_EACH - 1, sizes[:3]
    assert max(int(s[4]) for s in sizes) >= NUM_EACH - 1, sizes[:3]
    assert max(int(s[5]) for s in sizes) >= min(NUM_EACH, MAX_HOME_SET_PLANS) - 1, sizes[:3]
    assert {s[0] for s in sizes} == {"policy", "rollout"}
    # ... and after the deletions every map is as it was before the first object: empty.
    assert last == [("policy", "0", "0", "0", "0", "0")], last
