"""What main keeps per object: a lock only while a handler holds or waits for it, the schedule
and the back-offs until the object's deletion handler forgets them."""

from __future__ import annotations

import threading
import time

from kvfleet_operator import main
from kvfleet_operator.metrics import NvmeReportReader

KEY = ("policy", "ns", "kv")


def test_a_lock_is_kept_only_while_it_is_held_or_waited_for() -> None:
    locks = main._Locks()
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        with locks.holding(KEY):
            entered.set()
            release.wait(30)
            order.append("first")

    def second() -> None:
        with locks.holding(KEY):
            order.append("second")

    a = threading.Thread(target=first)
    a.start()
    entered.wait(30)
    b = threading.Thread(target=second)
    b.start()
    deadline = time.monotonic() + 30
    while locks._locks[KEY][1] < 2:  # b is waiting on the same lock
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert len(locks) == 1
    release.set()
    a.join(30)
    b.join(30)
    assert order == ["first", "second"]  # one object's handlers never overlap
    assert len(locks) == 0


def test_the_deletion_handler_forgets_every_map() -> None:
    tracked = main.Tracked(nvme_reports=NvmeReportReader(clock=lambda: 0.0))
    memo = {"tracked": tracked}
    other = ("policy", "ns", "other")
    for key in (KEY, other):
        tracked.schedule.after(key, 10.0)
        tracked.nvme_reports.backoff.record(["http://10.0.0.1:8000/x"],
                                            [("http://10.0.0.1:8000/x", TimeoutError())], key)
        tracked.cache_stats.backoff.record(["http://10.0.0.1:8000/y"],
                                           [("http://10.0.0.1:8000/y", TimeoutError())], key)
        tracked.home_set_plans.plan(f"{key[1]}/{key[2]}", ("acme",), ("r0", "r1"), 1)
    assert tracked.sizes() == {"schedule": 2, "locks": 0, "nvme_backoff": 2, "stats_backoff": 2,
                               "home_set_plans": 2}
    main.policy_deleted(namespace="ns", name="kv", memo=memo)
    assert tracked.sizes() == {"schedule": 1, "locks": 0, "nvme_backoff": 1, "stats_backoff": 1,
                               "home_set_plans": 1}
    assert tracked.schedule.is_due(other) is False and len(tracked.schedule) == 1
    main.rollout_deleted(namespace="ns", name="other", memo=memo)  # another kind: not it
    assert tracked.sizes()["schedule"] == 1
    main.policy_deleted(namespace="ns", name="other", memo=memo)
    assert tracked.sizes() == {"schedule": 0, "locks": 0, "nvme_backoff": 0, "stats_backoff": 0,
                               "home_set_plans": 0}
