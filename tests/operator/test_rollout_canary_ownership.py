"""Regression test for a bug the e2e path found (tests/e2e, scenario B run after scenario A): a
finished ModelRollout deleted `<target>-canary` on every tick, even when that Deployment belonged
to the next ModelRollout of the same target. The new rollout re-created its canary, the old one
deleted it again (about once a second on the real cluster), the canary never served and the new
rollout was rolled back. Fixed in 82c44c6 (a rollout touches only the canary it owns); this pins
the terminal-rollout side of it, test_handlers.py the waiting side."""

from __future__ import annotations

from datetime import UTC, datetime

from kvfleet_operator import handlers
from tests.operator.test_handlers import NEW, FakeKube, deployment

ROLLOUT = "kvfleet.dev/v1alpha1"


def _rollout(name: str, phase: str | None) -> dict[str, object]:
    obj: dict[str, object] = {
        "apiVersion": ROLLOUT,
        "kind": "ModelRollout",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"targetRef": {"name": "llm"}, "weightsDigest": NEW},
    }
    if phase is not None:
        obj["status"] = {"phase": phase}
    return obj


def test_a_finished_rollout_never_deletes_the_canary_of_the_next_rollout() -> None:
    kube = FakeKube()
    kube.put("Deployment", deployment(2))
    kube.put("modelrollouts", _rollout("v2", "Succeeded"))
    canary = deployment(1)
    canary["metadata"]["name"] = "llm-canary"
    canary["metadata"]["ownerReferences"] = [
        {
            "apiVersion": ROLLOUT,
            "kind": "ModelRollout",
            "name": "v3",
            "uid": "uid-v3",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    kube.put("Deployment", canary)  # v3's canary, being scaled up for its first step

    handlers.reconcile_rollout(
        kube,  # type: ignore[arg-type]
        "ns",
        "v2",
        now=lambda: datetime(2026, 1, 1, tzinfo=UTC),
        post_event=lambda _body, _event: None,
    )

    assert "delete llm-canary" not in kube.writes, kube.writes
    assert ("Deployment", "llm-canary") in kube.objects
