"""The kopf operator: decorators only. Each handler is a docstring and one call into `handlers`.

Run it as `kvfleet-operator run` (see `run`), or `kopf run -m kvfleet_operator.main`.

Two operator replicas never act at once: kopf peering (a ClusterKopfPeering named "kvfleet") lets
only the highest-priority live operator handle anything; the others pause until it disappears.
Every replica gets a distinct random priority unless one is given, so exactly one is active.

Timers tick at a fixed interval; whether a tick acts is `schedule.Schedule`'s call: a rollout is
due when the delay its last evaluation asked for has passed (the planner's `requeue_after_s`), a
policy on every tick; an object whose last evaluation raised `PermanentError` is not due again
until it changes (the change handlers always run, and re-arm the schedule).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import kopf

from kvfleet_operator import handlers
from kvfleet_operator.constants import GROUP, KOPF_ANNOTATION_PREFIX, POLICY_PLURAL, ROLLOUT_PLURAL
from kvfleet_operator.kube import Kube
from kvfleet_operator.metrics import NvmeReportReader
from kvfleet_operator.schedule import Schedule, run_scheduled

__all__ = ["run"]

POLICY_INTERVAL_S = float(os.environ.get("KVFLEET_OPERATOR_POLICY_INTERVAL_S", "10"))
# The rollout timer's resolution: how often it asks whether a rollout is due (the planner says
# when: the gate's checkIntervalSeconds, the rest of a hold or window; never once finished).
ROLLOUT_INTERVAL_S = float(os.environ.get("KVFLEET_OPERATOR_ROLLOUT_INTERVAL_S", "1"))
PEERING_NAME = "kvfleet"
_POLICY = (GROUP, POLICY_PLURAL)
_ROLLOUT = (GROUP, ROLLOUT_PLURAL)


class _Locks:
    """One lock per object: a timer tick and an update handler of the same object never overlap
    (kopf runs them concurrently; sync handlers run in threads)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}

    def of(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())


def _ns(namespace: str | None) -> str:
    assert namespace is not None, "KVCachePolicy and ModelRollout are namespaced"
    return namespace


def _kube(memo: Any) -> Kube:
    kube: Kube = memo["kube"]
    return kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's bookkeeping goes to annotations (our status schema is ours); peering on."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=KOPF_ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = 20
    settings.execution.max_workers = int(os.environ.get("KVFLEET_OPERATOR_WORKERS", "8"))
    memo["kube"] = Kube.from_environment()
    memo["locks"] = _Locks()
    memo["schedule"] = Schedule()
    # One per operator: which replicas' load reports did not answer, and until when to skip them.
    memo["nvme_reports"] = NvmeReportReader()
    if not settings.peering.standalone and settings.peering.clusterwide:
        memo["kube"].ensure_cluster_peering(settings.peering.name)


def _policy(memo: Any, namespace: str | None, name: str, tick: bool = False) -> None:
    key = ("policy", _ns(namespace), name)

    def once() -> float:
        handlers.reconcile_policy(_kube(memo), key[1], name, read_nvme=memo["nvme_reports"])
        return 0.0  # a valid policy is due on every tick: pods come and go

    with memo["locks"].of(*key):  # the due check too: a change handler may be re-arming it
        if not tick or memo["schedule"].is_due(key):
            run_scheduled(memo["schedule"], key, once)


def _rollout(memo: Any, namespace: str | None, name: str, tick: bool = False) -> None:
    key = ("rollout", _ns(namespace), name)
    with memo["locks"].of(*key):
        if not tick or memo["schedule"].is_due(key):
            run_scheduled(
                memo["schedule"],
                key,
                lambda: handlers.reconcile_rollout(_kube(memo), key[1], name),
            )


@kopf.on.resume(*_POLICY)
@kopf.on.create(*_POLICY)
@kopf.on.update(*_POLICY)
def policy_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Reconcile a KVCachePolicy as soon as it appears or its spec changes."""
    _policy(memo, namespace, name)


@kopf.timer(*_POLICY, interval=POLICY_INTERVAL_S, initial_delay=POLICY_INTERVAL_S)
def policy_tick(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Re-plan home sets as replica pods come and go (level-triggered: a no-op when unchanged)."""
    _policy(memo, namespace, name, tick=True)


@kopf.on.resume(*_ROLLOUT)
@kopf.on.create(*_ROLLOUT)
@kopf.on.update(*_ROLLOUT)
def rollout_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Evaluate a ModelRollout now: it was created, resumed after a restart, paused or aborted."""
    _rollout(memo, namespace, name)


@kopf.timer(*_ROLLOUT, interval=ROLLOUT_INTERVAL_S)
def rollout_tick(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Evaluate the rollout's gate when the last evaluation asked to: pods get ready, hit rates
    recover by themselves."""
    _rollout(memo, namespace, name, tick=True)


def run() -> None:
    """The `kvfleet-operator` console script."""
    from kvfleet_operator.cli import main

    raise SystemExit(main())
