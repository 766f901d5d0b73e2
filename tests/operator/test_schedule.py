"""The timers' schedule: a rollout is evaluated when its last evaluation asked to be, a finished
one only on change, an invalid one never again until it changes."""

from __future__ import annotations

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
