"""The rollout state machine, transition by transition, on a simulated pair of Deployments."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_operator.api import ModelRolloutSpec, ModelRolloutStatus, RolloutPhase, StepResult
from kvfleet_operator.planning import (
    DeleteCanary,
    EnsureCanary,
    Observations,
    ScaleTarget,
    SetTargetVersion,
    Workload,
    advance,
    canary_replicas_for,
    desired_actions,
)
from tests.operator.world import NEW, OLD, T0, Deploy, World, rollout_spec, stored, with_spec


def recover(world: World) -> None:
    world.canary_hit = world.target_hit


def test_happy_path_promotes_step_by_step_then_hands_off() -> None:
    w = World(rollout_spec())
    trace = []
    w.step()
    trace.append(w.counts())
    for _ in range(4):
        w.step(5)  # canary ready: window opens, stable scaled down
        trace.append(w.counts())
        recover(w)
        w.step(60)  # hit rate recovered: next step starts
        trace.append(w.counts())
        w.canary_hit = 0.0  # the next step's new pods are cold again
    w.step(5)  # target ready with the new weights: handoff gate
    trace.append(w.counts())
    w.target_hit, w.canary_hit = 0.6, 0.6
    w.step(60)
    trace.append(w.counts())
    assert trace == [
        ("Progressing", 1, "Scaling", 1, 10),
        ("Progressing", 1, "Gating", 1, 9),
        ("Progressing", 2, "Scaling", 1, 9),  # 10% of 10 is 1 replica
        ("Progressing", 2, "Gating", 1, 9),
        ("Progressing", 3, "Scaling", 5, 9),
        ("Progressing", 3, "Gating", 5, 5),
        ("Progressing", 4, "Scaling", 10, 5),
        ("Progressing", 4, "Gating", 10, 0),
        ("Promoting", 4, "Scaling", 10, 10),
        ("Promoting", 4, "Gating", 10, 10),
        ("Succeeded", 4, None, 0, 10),
    ]
    assert w.target is not None and w.target.digest == NEW
    assert [s.result for s in w.status.steps] == [StepResult.PASSED] * 4
    reasons = [e.reason for t in w.log for e in t.events]
    assert reasons == [
        "StepStarted",
        *["CanaryReady", "StepPassed", "StepStarted"] * 3,
        "CanaryReady",
        "StepPassed",
        "Promoting",
        "TargetReady",
        "Succeeded",
    ]
    assert [c.status.value for c in w.status.conditions if c.type == "Ready"] == ["True"]
    # Terminal: nothing moves any more, and the canary stays gone.
    again = w.step(3600)
    assert again.events == () and again.actions == (DeleteCanary(),)


def test_stable_capacity_leaves_only_after_the_canary_is_ready() -> None:
    w = World(rollout_spec(), canary_ready_limit=0)
    w.step()
    w.step(30)
    w.step(30)
    assert w.counts() == ("Progressing", 1, "Scaling", 1, 10)


@pytest.mark.parametrize(
    ("total", "expected"),
    [(10, [1, 1, 5, 10]), (44, [1, 5, 22, 44]), (1, [1, 1, 1, 1]), (3, [1, 1, 2, 3])],
)
def test_step_sizes_round_up_and_stay_within_the_fleet(total: int, expected: list[int]) -> None:
    spec = rollout_spec()
    assert [canary_replicas_for(spec, i, total) for i in range(4)] == expected


def test_gate_timeout_rolls_back_and_records_why() -> None:
    w = World(rollout_spec())
    w.step()
    w.step(5)  # gating
    w.canary_hit = 0.2  # never reaches 0.9 x 0.6 = 0.54
    w.step(1799)
    assert w.counts() == ("Progressing", 1, "Gating", 1, 9)
    result = w.step(1)
    assert w.status.phase is RolloutPhase.ROLLING_BACK
    assert w.status.reason == "HitRateNotRecovered"
    assert "canary hit rate 0.200 < 0.540 (90% of stable 0.600) after 1800 s" in w.status.message
    assert result.actions == (SetTargetVersion(OLD, "kvfleet:1"), ScaleTarget(10))
    assert [e.type for e in result.events] == ["Warning"]
    assert w.status.steps[-1].result is StepResult.TIMED_OUT
    w.step(5)  # target is back at 10 ready replicas: canary removed
    assert w.counts() == ("RolledBack", 1, None, 0, 10)
    assert w.status.reason == "HitRateNotRecovered"
    assert w.target is not None and (w.target.digest, w.target.replicas) == (OLD, 10)
    assert w.log[-1].events[0].reason == "RolledBack"
    degraded = {c.type: c.status.value for c in w.status.conditions}
    assert degraded == {"Ready": "False", "Progressing": "False", "Degraded": "True"}


def test_gate_times_out_without_any_metric_data() -> None:
    w = World(rollout_spec(), target_hit=None, canary_hit=None)
    w.step()
    w.step(5)
    w.step(1800)
    assert w.status.reason == "HitRateNotRecovered"
    assert "no hit-rate data" in w.status.message


def test_canary_that_never_becomes_ready_rolls_back() -> None:
    w = World(rollout_spec(), canary_ready_limit=0)
    w.step()
    w.step(599)
    assert w.status.phase is RolloutPhase.PROGRESSING
    w.step(1)
    assert (w.status.phase, w.status.reason) == (RolloutPhase.ROLLING_BACK, "CanaryNotReady")
    assert w.status.steps[-1].result is StepResult.NOT_READY


def test_last_step_gates_against_the_last_stable_hit_rate_seen() -> None:
    w = World(rollout_spec(steps=[{"percent": 100}]))
    w.step()
    w.step(5)
    assert w.counts() == ("Progressing", 1, "Gating", 10, 0)
    w.target_hit = None  # no stable pods left to measure
    w.canary_hit = 0.55
    w.step(30)
    assert w.status.phase is RolloutPhase.PROMOTING
    assert w.status.steps[0].baseline_hit_rate == 0.6


def test_hold_keeps_a_step_even_when_the_rate_has_recovered() -> None:
    w = World(rollout_spec(gate={"holdSeconds": 120}))
    w.step()
    w.step(5)
    recover(w)
    w.step(60)
    assert w.counts() == ("Progressing", 1, "Gating", 1, 9)
    w.step(60)
    assert w.counts() == ("Progressing", 2, "Scaling", 1, 9)


def test_abort_mid_step_rolls_back() -> None:
    w = World(rollout_spec())
    w.step()
    w.step(5)
    recover(w)
    w.step(30)
    w.step(5)  # step 2 gating
    with_spec(w, abort=True)
    first = w.step(1)
    assert (w.status.phase, w.status.reason) == (RolloutPhase.ROLLING_BACK, "Aborted")
    second = w.step(5)
    assert (w.status.phase, w.status.reason) == (RolloutPhase.ROLLED_BACK, "Aborted")
    assert [e.reason for e in first.events + second.events] == ["Aborted", "RolledBack"]
    assert w.status.steps[-1].result is StepResult.ABORTED
    assert w.canary is None and w.target is not None and w.target.replicas == 10


def test_abort_before_start_touches_nothing() -> None:
    w = World(rollout_spec(abort=True))
    result = w.step()
    assert (w.status.phase, w.status.reason) == (RolloutPhase.ROLLED_BACK, "Aborted")
    assert result.actions == (DeleteCanary(),)
    assert w.target is not None and w.target.replicas == 10


def test_abort_while_promoting_restores_the_previous_template() -> None:
    w = World(rollout_spec(steps=[{"percent": 100}]))
    w.step()
    w.step(5)
    recover(w)
    w.step(30)
    assert w.status.phase is RolloutPhase.PROMOTING
    assert w.target is not None and w.target.digest == NEW
    with_spec(w, abort=True)
    w.step(1)
    w.step(5)
    assert w.status.phase is RolloutPhase.ROLLED_BACK
    assert (w.target.digest, w.target.replicas) == (OLD, 10)


def test_pause_freezes_the_clock_and_resume_continues_the_same_step() -> None:
    w = World(rollout_spec())
    w.step()
    w.step(5)
    w.canary_hit = 0.1
    w.step(1000)
    with_spec(w, paused=True)
    w.step(1)
    assert w.counts() == ("Paused", 1, "Gating", 1, 9)
    assert w.status.resume_phase is RolloutPhase.PROGRESSING
    recover(w)
    w.step(5000)  # far beyond the window, and recovered: neither rollback nor promotion
    assert w.counts() == ("Paused", 1, "Gating", 1, 9)
    w.canary_hit = 0.1
    with_spec(w, paused=False)
    w.step(1)
    assert w.counts() == ("Progressing", 1, "Gating", 1, 9)
    w.step(700)  # 1001 + 700 s of window used: still open
    assert w.status.phase is RolloutPhase.PROGRESSING
    w.step(100)
    assert w.status.reason == "HitRateNotRecovered"
    assert [e.reason for t in w.log for e in t.events][-3:] == [
        "Paused",
        "Resumed",
        "HitRateNotRecovered",
    ]


def test_pause_before_start_waits_for_the_first_step() -> None:
    w = World(rollout_spec(paused=True))
    w.step()  # the first step is entered, then the pause takes effect
    w.step(1)
    assert w.counts() == ("Paused", 1, "Scaling", 1, 10)


@pytest.mark.parametrize("cut", range(1, 12))
def test_operator_restart_at_any_point_neither_skips_nor_repeats(cut: int) -> None:
    """Kill the operator after `cut` evaluations, between applying the actions and writing the
    status (the worst place): the next operator starts from the last *written* status."""
    reference = World(rollout_spec())
    crashed = World(rollout_spec())
    script = [0, 5, 60, 5, 60, 5, 60, 5, 60, 5, 60, 60]

    def drive(w: World, i: int, write: bool = True) -> None:
        if i in (2, 4, 6, 8):
            recover(w)
        if i in (3, 5, 7):
            w.canary_hit = 0.0
        if i == 10:
            w.target_hit, w.canary_hit = 0.6, 0.6
        w.step(script[i], apply=True) if write else w.step(script[i], apply=False)

    for i in range(len(script)):
        drive(reference, i)
    for i in range(cut):
        drive(crashed, i)
    # The evaluation at `cut` applies its actions, then the operator dies before its status write.
    lost = advance(crashed.spec, crashed.status, crashed.observations(), crashed.now, 1)
    crashed.apply(lost.actions)
    # A new operator: same last written status, the world as the dead one left it.
    for i in range(cut, len(script)):
        drive(crashed, i)
    assert crashed.counts() == reference.counts() == ("Succeeded", 4, None, 0, 10)
    steps = [s.index for s in crashed.status.steps]
    assert steps == [0, 1, 2, 3]
    assert [s.result for s in crashed.status.steps] == [StepResult.PASSED] * 4


def test_re_evaluating_the_same_status_changes_nothing() -> None:
    w = World(rollout_spec())
    w.step()
    w.step(5)
    before = w.status
    first = advance(w.spec, before, w.observations(), w.now, 1)
    second = advance(w.spec, stored(first.status), w.observations(), w.now, 1)
    assert first.actions == second.actions == (EnsureCanary(1), ScaleTarget(9))
    assert second.events == ()
    assert stored(second.status) == stored(first.status)


def test_fixed_surge_adds_canary_replicas_for_the_window() -> None:
    w = World(rollout_spec(surge={"mode": "Fixed", "replicas": 2}))
    w.step()
    assert w.counts() == ("Progressing", 1, "Scaling", 3, 10)
    w.step(5)
    assert w.counts() == ("Progressing", 1, "Gating", 3, 9)
    assert w.status.steps[0].surge_replicas == 2


@pytest.mark.parametrize(
    ("step", "expected_surge"),
    [({"percent": 10}, 1), ({"percent": 50}, 2), ({"percent": 100}, 3)],
)
def test_computed_surge_replaces_the_prefill_the_cold_share_loses(
    step: dict[str, int], expected_surge: int
) -> None:
    # docs/design.md §1: 74,700 prefill tok/s saved across 44 replicas, 28,000 tok/s per replica:
    # the whole fleet going cold needs ~2.7 replicas more.
    spec = rollout_spec(
        steps=[step, {"percent": 100}] if step["percent"] != 100 else [step],
        surge={"mode": "Computed", "replicaPrefillTokensPerSecond": 28000},
    )
    w = World(spec, target=Deploy(44, OLD), saved_tokens_per_s=74700)
    w.step()
    assert w.status.steps[0].surge_replicas == expected_surge


def test_computed_surge_is_capped() -> None:
    spec = rollout_spec(
        steps=[{"percent": 100}],
        surge={"mode": "Computed", "replicaPrefillTokensPerSecond": 1000, "maxReplicas": 4},
    )
    w = World(spec, target=Deploy(44, OLD), saved_tokens_per_s=74700)
    w.step()
    assert w.status.steps[0].surge_replicas == 4


def test_a_target_already_at_the_digest_succeeds_without_touching_it() -> None:
    w = World(rollout_spec(), target=Deploy(10, NEW))
    result = w.step()
    assert (w.status.phase, w.status.reason) == (RolloutPhase.SUCCEEDED, "AlreadyRolledOut")
    assert result.actions == (DeleteCanary(),)


def test_missing_target_waits_before_the_start_and_fails_after() -> None:
    w = World(rollout_spec(), target=None)
    result = w.step()
    assert (w.status.phase, w.status.reason) == (RolloutPhase.PENDING, "TargetNotFound")
    assert result.actions == () and result.requeue_after_s == 10.0
    w.target = Deploy(10, OLD)
    w.step(10)
    w.target = None
    w.step(10)
    assert (w.status.phase, w.status.reason) == (RolloutPhase.FAILED, "TargetNotFound")


def test_target_with_no_replicas_fails() -> None:
    w = World(rollout_spec(), target=Deploy(0, OLD))
    w.step()
    assert (w.status.phase, w.status.reason) == (RolloutPhase.FAILED, "NothingToCanary")


def test_handoff_window_expiry_still_succeeds_with_a_warning() -> None:
    w = World(rollout_spec(steps=[{"percent": 100}]))
    w.step()
    w.step(5)
    recover(w)
    w.step(30)
    w.step(5)  # target ready
    w.target_hit, w.canary_hit = 0.0, 0.6
    result = w.step(1800)
    assert w.status.phase is RolloutPhase.SUCCEEDED
    assert result.events[0].type == "Warning"


def test_promotion_target_never_ready_rolls_back() -> None:
    w = World(rollout_spec(steps=[{"percent": 100}]))
    w.step()
    w.step(5)
    recover(w)
    w.step(30)
    assert w.target is not None
    w.target.ready = 0
    w.step(600)
    assert (w.status.phase, w.status.reason) == (RolloutPhase.ROLLING_BACK, "TargetNotReady")


def test_requeue_never_overshoots_the_window() -> None:
    w = World(rollout_spec(gate={"windowSeconds": 20, "checkIntervalSeconds": 15}))
    w.step()
    w.step(5)
    w.canary_hit = 0.0
    result = w.step(10)
    assert result.requeue_after_s == 10.0


def test_desired_actions_of_a_paused_status_are_those_of_the_phase_it_paused() -> None:
    w = World(rollout_spec())
    w.step()
    w.step(5)
    running = desired_actions(w.spec, w.status)
    with_spec(w, paused=True)
    w.step(1)
    assert desired_actions(w.spec, w.status) == running


def test_status_round_trips_through_the_wire_format() -> None:
    w = World(rollout_spec())
    w.step()
    w.step(5)
    assert stored(w.status) == w.status
    assert "currentStep" in w.status.model_dump(by_alias=True)


_PHASE_EDGES = {
    ("Pending", "Progressing"),
    ("Pending", "Succeeded"),
    ("Pending", "RolledBack"),
    ("Pending", "Failed"),
    ("Progressing", "Progressing"),
    ("Progressing", "Paused"),
    ("Progressing", "Promoting"),
    ("Progressing", "RollingBack"),
    ("Progressing", "Failed"),
    ("Paused", "Progressing"),
    ("Paused", "Promoting"),
    ("Paused", "RollingBack"),
    ("Paused", "Failed"),
    ("Promoting", "Paused"),
    ("Promoting", "Succeeded"),
    ("Promoting", "RollingBack"),
    ("Promoting", "Failed"),
    ("RollingBack", "RolledBack"),
    ("RollingBack", "Failed"),
}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0, 1, 5, 60, 600, 2000]),
            st.sampled_from([None, 0.0, 0.3, 0.6]),
            st.sampled_from(["run", "pause", "resume", "abort", "unready", "ready"]),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_invariants_under_any_sequence(
    script: list[tuple[int, float | None, str]],
) -> None:
    w = World(rollout_spec(surge={"mode": "Fixed", "replicas": 1}))
    last_step = 0
    for after_s, hit, op in script:
        if op == "pause" and not w.spec.paused and not w.spec.abort:
            with_spec(w, paused=True)
        elif op == "resume" and w.spec.paused:
            with_spec(w, paused=False)
        elif op == "abort":
            with_spec(w, abort=True)
        elif op == "unready":
            w.canary_ready_limit = 0
        elif op == "ready":
            w.canary_ready_limit = None
        w.canary_hit = hit
        before = w.status.phase.value
        result = w.step(after_s)
        for entry in w.status.history[-len(result.events) :] if result.events else []:
            assert (entry.from_phase, entry.to_phase) in _PHASE_EDGES | {(before, before)}
        assert w.status.current_step in (last_step, last_step + 1)
        last_step = w.status.current_step
        for action in result.actions:
            if isinstance(action, ScaleTarget):
                assert 0 <= action.replicas <= 10
            if isinstance(action, EnsureCanary):
                assert 1 <= action.replicas <= 11
        if w.status.phase is RolloutPhase.ROLLED_BACK:
            assert w.target is not None and (w.target.digest, w.target.replicas) == (OLD, 10)
    assert w.status.current_step <= 4


def test_observations_of_a_deployment_still_rolling_are_not_ready() -> None:
    workload = Workload(5, 5, 5, NEW, "img", settled=False)
    assert not workload.is_ready(5, NEW)
    assert Workload(5, 5, 5, NEW, "img").is_ready(5, NEW)
    assert not Workload(5, 5, 5, OLD, "img").is_ready(5, NEW)


def test_advance_is_pure() -> None:
    spec: ModelRolloutSpec = rollout_spec()
    status = ModelRolloutStatus()
    obs = Observations(Workload(10, 10, 10, OLD, "i"), None, 0.6, None)
    now = T0 + timedelta(seconds=1)
    assert advance(spec, status, obs, now, 1) == advance(spec, status, obs, now, 1)
    assert status == ModelRolloutStatus()


def test_hit_rates_are_shown_as_percents_for_kubectl() -> None:
    """The HitRate and Baseline columns read these strings: 0.9562975051780587 printed raw was
    unreadable in `kubectl get mro`."""
    w = World(rollout_spec(), target_hit=0.9562975051780587, canary_hit=None)
    w.step()
    assert (w.status.hit_rate_percent, w.status.baseline_percent) == ("", "95.6%")
    w.canary_hit = 0.3
    w.step(5)
    w.step(5)
    assert (w.status.hit_rate_percent, w.status.baseline_percent) == ("30.0%", "95.6%")
    assert stored(w.status).hit_rate_percent == "30.0%"
