"""The timers' schedule: a rollout is evaluated when its last evaluation asked to be, a finished
one only on change, an invalid one never again until it changes."""

from __future__ import annotations

import contextlib

import kopf
import pytest

from kvfleet_operator.schedule import Schedule, run_scheduled

KEY = ("rollout", "ns", "roll")


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_an_object_is_due_only_once_a_change_handler_armed_it(clock: Clock) -> None:
    schedule = Schedule(clock)
    clock.now_s += 1e9
    assert not schedule.is_due(KEY)
    run_scheduled(schedule, KEY, lambda: 0.0)
    assert schedule.is_due(KEY)


def test_the_requeue_delay_decides_the_next_tick(clock: Clock) -> None:
    schedule = Schedule(clock)
    assert run_scheduled(schedule, KEY, lambda: 15.0) == 15.0
    clock.now_s += 14.9
    assert not schedule.is_due(KEY)
    schedule.after(("rollout", "ns", "other"), 0.0)
    assert schedule.is_due(("rollout", "ns", "other"))  # keys are independent
    clock.now_s += 0.1
    assert schedule.is_due(KEY)


def test_none_means_only_on_change(clock: Clock) -> None:
    schedule = Schedule(clock)
    run_scheduled(schedule, KEY, lambda: None)
    clock.now_s += 1e9
    assert not schedule.is_due(KEY)
    run_scheduled(schedule, KEY, lambda: 1.0)  # the change handler re-arms it
    clock.now_s += 1
    assert schedule.is_due(KEY)


def test_a_permanent_error_stops_the_ticks_until_a_change(clock: Clock) -> None:
    schedule = Schedule(clock)
    calls = []

    def invalid() -> float | None:
        calls.append(1)
        raise kopf.PermanentError("invalid ModelRollout ns/roll")

    schedule.after(KEY, 0.0)  # armed by its create handler, say, which did not raise
    ticks = 0
    for _ in range(10):  # ten timer ticks, one second apart
        if schedule.is_due(KEY):
            ticks += 1
            with pytest.raises(kopf.PermanentError):
                run_scheduled(schedule, KEY, invalid)
        clock.now_s += 1
    assert ticks == 1 and len(calls) == 1


def test_a_temporary_error_leaves_it_due(clock: Clock) -> None:
    """kopf waits the error's own delay before the next tick; the schedule adds none."""
    schedule = Schedule(clock)
    run_scheduled(schedule, KEY, lambda: 30.0)
    clock.now_s += 30

    def transient() -> float | None:
        raise kopf.TemporaryError("503", delay=5)

    with pytest.raises(kopf.TemporaryError):
        run_scheduled(schedule, KEY, transient)
    assert schedule.is_due(KEY)


def test_a_negative_delay_is_refused(clock: Clock) -> None:
    with pytest.raises(ValueError, match="-1"):
        Schedule(clock).after(KEY, -1.0)


def test_the_rollout_timer_acts_when_the_planner_asked(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """main's glue: the change handler evaluates at once and arms the schedule with the planner's
    requeue delay; timer ticks (every second) evaluate only once it has passed; after a
    PermanentError no tick evaluates, and the next change does."""
    from kvfleet_operator import handlers, main

    answers: list[float | Exception | None] = [15.0, 1.0, kopf.PermanentError("invalid"), None]
    calls: list[str] = []

    def reconcile(kube: object, namespace: str, name: str, **_: object) -> float | None:
        calls.append(f"{namespace}/{name}")
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(handlers, "reconcile_rollout", reconcile)
    memo = {"kube": None, "tracked": main.Tracked(schedule=Schedule(clock))}

    def ticks(seconds: int) -> int:
        before = len(calls)
        for _ in range(seconds):
            clock.now_s += 1
            with contextlib.suppress(kopf.PermanentError):
                main.rollout_tick(namespace="ns", name="roll", memo=memo)
        return len(calls) - before

    assert ticks(5) == 0  # never seen by a change handler: not due
    main.rollout_changed(namespace="ns", name="roll", memo=memo)  # -> 15 s
    assert calls == ["ns/roll"]
    assert ticks(14) == 0
    assert ticks(1) == 1  # -> 1 s
    assert ticks(1) == 1  # -> PermanentError
    assert ticks(60) == 0
    main.rollout_changed(namespace="ns", name="roll", memo=memo)  # a change -> None
    assert ticks(60) == 0 and len(calls) == 4
