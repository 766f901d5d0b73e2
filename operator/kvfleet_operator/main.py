"""The kopf operator: decorators only. Each handler is a docstring and one call into `handlers`.

Run it as `kvfleet-operator run` (`cli.py`), or `kopf run -m kvfleet_operator.main`.

Two operator replicas never act at once: kopf peering (a ClusterKopfPeering named "kvfleet") lets
only the highest-priority live operator handle anything; the others pause until it disappears.
Every replica gets a distinct random priority unless one is given, so exactly one is active.

Timers tick at a fixed interval; whether a tick acts is `schedule.Schedule`'s call: a rollout is
due when the delay its last evaluation asked for has passed (the planner's `requeue_after_s`), a
policy on every tick; an object whose last evaluation raised `PermanentError` is not due again
until it changes (the change handlers always run, and re-arm the schedule).

A long-running operator keeps nothing per object it no longer has: a lock exists only while a
handler of its object holds or waits for it, and the deletion of an object (its watch event,
seen once kopf has stopped the object's timers and let it go) forgets its schedule entry and the
replicas it was backing off from (`Tracked.forget`). An object deleted while no operator ran was
never in a fresh operator's maps: they start empty.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvfleet_operator import handlers
from kvfleet_operator.constants import GROUP, KOPF_ANNOTATION_PREFIX, POLICY_PLURAL, ROLLOUT_PLURAL
from kvfleet_operator.kube import Kube
from kvfleet_operator.metrics import CacheStatsReader, NvmeReportReader
from kvfleet_operator.schedule import Schedule, run_scheduled

__all__ = ["Tracked"]

POLICY_INTERVAL_S = float(os.environ.get("KVFLEET_OPERATOR_POLICY_INTERVAL_S", "10"))
# The rollout timer's resolution: how often it asks whether a rollout is due (the planner says
# when: the gate's checkIntervalSeconds, the rest of a hold or window; never once finished).
ROLLOUT_INTERVAL_S = float(os.environ.get("KVFLEET_OPERATOR_ROLLOUT_INTERVAL_S", "1"))
_POLICY = (GROUP, POLICY_PLURAL)
log = logging.getLogger(__name__)
_ROLLOUT = (GROUP, ROLLOUT_PLURAL)


class _Locks:
    """One lock per object: a timer tick and an update handler of the same object never overlap
    (kopf runs them concurrently; sync handlers run in threads). An object's lock is kept only
    while someone holds or waits for it, so the map is as large as the handlers in flight."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def holding(self, key: Hashable) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (None, 0))
            lock = lock or threading.Lock()
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)


@dataclass
class Tracked:
    """What the operator keeps per object between handler calls; `forget` drops all of it."""

    schedule: Schedule = field(default_factory=Schedule)
    locks: _Locks = field(default_factory=_Locks)
    # Which replicas' load reports / `/cache/stats` did not answer, and until when to skip them.
    nvme_reports: NvmeReportReader = field(default_factory=NvmeReportReader)
    cache_stats: CacheStatsReader = field(default_factory=CacheStatsReader)
    # Each policy's last home-set plan (a re-plan starts from it).
    home_set_plans: handlers.HomeSetPlans = field(default_factory=handlers.HomeSetPlans)

    def forget(self, key: tuple[str, str, str]) -> None:
        with self.locks.holding(key):  # after a handler in flight re-armed the schedule
            self.schedule.forget(key)
            self.nvme_reports.backoff.forget(key)
            self.cache_stats.backoff.forget(key)
            if key[0] == "policy":
                self.home_set_plans.forget(key[1], key[2])

    def sizes(self) -> dict[str, int]:
        return {
            "schedule": len(self.schedule),
            "locks": len(self.locks),
            "nvme_backoff": len(self.nvme_reports.backoff),
            "stats_backoff": len(self.cache_stats.backoff),
            "home_set_plans": len(self.home_set_plans),
        }


def _ns(namespace: str | None) -> str:
    assert namespace is not None, "KVCachePolicy and ModelRollout are namespaced"
    return namespace


def _kube(memo: Any) -> Kube:
    kube: Kube = memo["kube"]
    return kube


def _tracked(memo: Any) -> Tracked:
    tracked: Tracked = memo["tracked"]
    return tracked


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
    memo["tracked"] = Tracked()
    if not settings.peering.standalone and settings.peering.clusterwide:
        memo["kube"].ensure_cluster_peering(settings.peering.name)


def _scheduled(
    memo: Any, key: tuple[str, str, str], tick: bool, reconcile: Callable[[], float | None]
) -> None:
    tracked = _tracked(memo)
    with tracked.locks.holding(key):  # the due check too: a change handler may be re-arming it
        if not tick or tracked.schedule.is_due(key):
            run_scheduled(tracked.schedule, key, reconcile)


def _policy(memo: Any, namespace: str | None, name: str, tick: bool = False) -> None:
    key = ("policy", _ns(namespace), name)
    read_nvme = functools.partial(_tracked(memo).nvme_reports, owner=key)

    def once() -> float:
        handlers.reconcile_policy(_kube(memo), key[1], name, read_nvme=read_nvme,
                                  plans=_tracked(memo).home_set_plans)
        return 0.0  # a valid policy is due on every tick: pods come and go

    _scheduled(memo, key, tick, once)


def _rollout(memo: Any, namespace: str | None, name: str, tick: bool = False) -> None:
    key = ("rollout", _ns(namespace), name)
    read_stats = functools.partial(_tracked(memo).cache_stats, owner=key)
    _scheduled(
        memo,
        key,
        tick,
        lambda: handlers.reconcile_rollout(_kube(memo), key[1], name, read_stats=read_stats),
    )


def _deleted(event: Any, **_: Any) -> bool:
    return bool(event.get("type") == "DELETED")


def _forget(memo: Any, kind: str, namespace: str | None, name: str) -> None:
    tracked = _tracked(memo)
    tracked.forget((kind, _ns(namespace), name))
    log.debug("%s %s/%s deleted: forgotten; now tracking %s", kind, namespace, name,
              ", ".join(f"{k} {v}" for k, v in tracked.sizes().items()))


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


@kopf.on.event(*_POLICY, when=_deleted)
def policy_deleted(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """A deleted KVCachePolicy: forget what the operator kept for it (its ConfigMap goes with it:
    it is owned by the policy)."""
    _forget(memo, "policy", namespace, name)


@kopf.on.event(*_ROLLOUT, when=_deleted)
def rollout_deleted(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """A deleted ModelRollout: forget what the operator kept for it (its canary, owned by it,
    goes with it)."""
    _forget(memo, "rollout", namespace, name)
