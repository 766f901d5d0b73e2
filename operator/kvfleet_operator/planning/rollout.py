"""The rollout state machine: a pure function `advance(spec, status, observations, now)`.

A weights rollout cold-starts every cache it touches (docs/design.md §4), so it is driven as a
capacity event on two Deployments: the target (stable, the user's) and `<target>-canary` (created
by the operator from the target's pod template with the new weights digest and image).

    Pending -> Progressing(step 1: Scaling -> Gating) -> ... (step n) -> Promoting -> Succeeded
                     |  ^                                                   |
           paused    v  | resumed                 abort / gate timeout /    v
                   Paused                         canary not ready ----> RollingBack -> RolledBack

Each step i moves c_i replicas to the canary (plus surge s_i while its cache is cold):
  Scaling   canary = c_i + s_i, stable stays at N - c_{i-1} until the canary's pods are ready;
  Gating    stable scaled to N - c_i; the window opens; the step passes when the canary's hit rate
            is >= recoveryPercent of the stable's (its last value while it had pods), not before
            holdSeconds; it rolls back when windowSeconds pass first.
Promoting writes the new version into the target's template and scales it back to N while the
canary (N replicas, warm) keeps serving; once the target's pods are ready and their hit rate has
recovered against the canary's (or the window ran out: the version is already proven) the canary
is deleted. RollingBack restores the previous digest, image and replica count, then deletes the
canary.

Restart safety: the actions are a function of the *new status alone* (`desired_actions`), every
action is a level ("the canary has 5 replicas"), and the numbers of a step (c_i, s_i) are recorded
when it starts. An operator killed at any point re-derives the same actions from the last written
status: a step is neither skipped (the index only moves on evidence read in the same call) nor
repeated (a written step index is never decreased).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from kvfleet_operator.api import (
    TERMINAL_PHASES,
    Condition,
    HistoryEntry,
    ModelRolloutSpec,
    ModelRolloutStatus,
    PreviousVersion,
    RolloutPhase,
    StepResult,
    StepState,
    StepStatus,
    SurgeMode,
)
from kvfleet_operator.planning.conditions import set_condition

__all__ = [
    "Action",
    "DeleteCanary",
    "EnsureCanary",
    "Event",
    "Observations",
    "ScaleTarget",
    "SetTargetVersion",
    "Transition",
    "Workload",
    "advance",
    "canary_replicas_for",
    "desired_actions",
    "format_percent",
    "format_time",
    "parse_time",
]

MAX_HISTORY = 50


@dataclass(frozen=True, slots=True)
class Workload:
    """What the planner needs to know of a Deployment."""

    replicas: int
    ready_replicas: int
    updated_replicas: int
    weights_digest: str
    image: str
    settled: bool = True  # observedGeneration >= generation: status describes the current spec

    def is_ready(self, replicas: int, weights_digest: str | None = None) -> bool:
        if weights_digest is not None and self.weights_digest != weights_digest:
            return False
        return (
            self.settled
            and self.replicas == replicas
            and self.ready_replicas >= replicas
            and self.updated_replicas >= replicas
        )


@dataclass(frozen=True, slots=True)
class Observations:
    target: Workload | None
    canary: Workload | None
    target_hit_rate: float | None = None
    canary_hit_rate: float | None = None
    target_saved_prefill_tokens_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class EnsureCanary:
    """The canary Deployment exists, runs the new version, and has `replicas` replicas."""

    replicas: int


@dataclass(frozen=True, slots=True)
class DeleteCanary:
    pass


@dataclass(frozen=True, slots=True)
class ScaleTarget:
    replicas: int


@dataclass(frozen=True, slots=True)
class SetTargetVersion:
    """The target's pod template carries this digest (and image, when not empty)."""

    weights_digest: str
    image: str


Action = EnsureCanary | DeleteCanary | ScaleTarget | SetTargetVersion


@dataclass(frozen=True, slots=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Transition:
    status: ModelRolloutStatus
    actions: tuple[Action, ...]
    events: tuple[Event, ...]
    requeue_after_s: float | None


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_percent(rate: float | None) -> str:
    """A hit rate (0-1) as people read it in a table: "95.6%"; "" when unknown."""
    return "" if rate is None else f"{rate * 100:.1f}%"


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def canary_replicas_for(spec: ModelRolloutSpec, index: int, total_replicas: int) -> int:
    """c_i: the replicas step `index` moves to the new version (at least 1, at most N)."""
    step = spec.steps[index]
    if step.replicas is not None:
        wanted = step.replicas
    else:
        assert step.percent is not None
        wanted = math.ceil(step.percent * total_replicas / 100)
    return max(1, min(total_replicas, wanted))


def _surge_for(spec: ModelRolloutSpec, canary: int, total: int, obs: Observations) -> int:
    surge = spec.surge
    if surge.mode is SurgeMode.NONE:
        return 0
    if surge.mode is SurgeMode.FIXED:
        assert surge.replicas is not None
        return min(surge.replicas, surge.max_replicas)
    assert surge.replica_prefill_tokens_per_second is not None
    saved = obs.target_saved_prefill_tokens_per_s
    if saved is None or saved <= 0 or total <= 0:
        return 0
    # The canary's share of traffic arrives cold: the prefill its cache would have saved lands on
    # the GPUs again until the cache refills.
    extra = saved * (canary / total) / surge.replica_prefill_tokens_per_second
    return min(math.ceil(extra - 1e-9), surge.max_replicas)


# ---------------------------------------------------------------------------------------------
# desired state of the world for a status


def desired_actions(spec: ModelRolloutSpec, status: ModelRolloutStatus) -> tuple[Action, ...]:
    """The workload a status asks for. A function of the status alone: re-running it after a
    restart asks for exactly the same thing."""
    phase = status.phase
    if phase is RolloutPhase.PAUSED:
        assert status.resume_phase is not None
        phase = status.resume_phase
    if phase in (RolloutPhase.SUCCEEDED, RolloutPhase.ROLLED_BACK):
        return (DeleteCanary(),)
    previous = status.previous
    if phase in (RolloutPhase.PENDING, RolloutPhase.FAILED) or previous is None:
        return ()
    total = previous.replicas
    if phase is RolloutPhase.PROGRESSING:
        step = status.steps[-1]
        canary = step.canary_replicas + step.surge_replicas
        if status.step_state is StepState.SCALING:
            # Stable capacity leaves only once the canary's pods are ready to take its share.
            stable = status.steps[-2].stable_replicas if len(status.steps) > 1 else total
        else:
            stable = step.stable_replicas
        return (EnsureCanary(canary), ScaleTarget(stable))
    if phase is RolloutPhase.PROMOTING:
        return (
            SetTargetVersion(spec.weights_digest, spec.image or ""),
            ScaleTarget(total),
            EnsureCanary(total),
        )
    if phase is RolloutPhase.ROLLING_BACK:
        # The canary keeps serving until the restored target is ready.
        return (SetTargetVersion(previous.weights_digest, previous.image), ScaleTarget(total))
    raise AssertionError(f"unhandled phase {phase}")


# ---------------------------------------------------------------------------------------------
# transitions


@dataclass(slots=True)
class _Builder:
    """Accumulates one call's changes; only `advance` uses it."""

    spec: ModelRolloutSpec
    status: ModelRolloutStatus
    now: datetime
    events: list[Event]

    def move(
        self,
        phase: RolloutPhase,
        reason: str,
        message: str,
        event_type: Literal["Normal", "Warning"] = "Normal",
        event_reason: str | None = None,
        **changes: object,
    ) -> None:
        entry = HistoryEntry(
            time=format_time(self.now),
            from_phase=self.status.phase.value,
            to_phase=phase.value,
            step=int(str(changes.get("current_step", self.status.current_step))),
            reason=reason,
            message=message,
        )
        history = [*self.status.history, entry][-MAX_HISTORY:]
        self.status = self.status.model_copy(
            update={"phase": phase, "reason": reason, "message": message, "history": history}
            | changes
        )
        self.events.append(Event(event_type, event_reason or reason, message))

    def update(self, **changes: object) -> None:
        self.status = self.status.model_copy(update=changes)

    def update_step(self, **changes: object) -> None:
        steps = list(self.status.steps)
        steps[-1] = steps[-1].model_copy(update=changes)
        self.status = self.status.model_copy(update={"steps": steps})

    def elapsed_s(self, since: str) -> float:
        return (self.now - parse_time(since)).total_seconds()


def _start_step(b: _Builder, index: int, obs: Observations) -> None:
    assert b.status.previous is not None
    total = b.status.previous.replicas
    canary = canary_replicas_for(b.spec, index, total)
    surge = _surge_for(b.spec, canary, total, obs)
    step = StepStatus(
        index=index,
        canary_replicas=canary,
        stable_replicas=total - canary,
        surge_replicas=surge,
        started_at=format_time(b.now),
    )
    percent = b.spec.steps[index].percent
    share = f"{percent}%" if percent is not None else f"{canary} replica(s)"
    b.move(
        RolloutPhase.PROGRESSING,
        "StepStarted",
        f"step {index + 1}/{len(b.spec.steps)}: {share} -> canary {canary} (+{surge} surge), "
        f"stable {total - canary} once the canary is ready",
        current_step=index + 1,
        step_state=StepState.SCALING,
        steps=[*b.status.steps, step],
    )


def _begin_rollback(
    b: _Builder, reason: str, message: str, step_result: StepResult | None
) -> None:
    """Enter RollingBack (the step, if any, closed with `step_result`): the target gets its
    previous version back while the canary keeps serving."""
    if step_result is not None and b.status.steps:
        b.update_step(result=step_result, finished_at=format_time(b.now))
    b.move(
        RolloutPhase.ROLLING_BACK,
        reason,
        message,
        "Warning",
        step_state=None,
        paused_at="",
        resume_phase=None,
    )


def _baseline(b: _Builder, obs: Observations) -> float | None:
    """The stable version's hit rate: live while it has ready pods, else the last one seen."""
    target = obs.target
    live = obs.target_hit_rate
    if live is not None and target is not None and target.ready_replicas > 0:
        b.update(baseline_hit_rate=live)
        return live
    return b.status.baseline_hit_rate


def _fmt_rate(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.3f}"


def _evaluate_step(b: _Builder, obs: Observations) -> float | None:
    """One evaluation of the current step (Scaling: is the canary ready; Gating: has its hit
    rate recovered); returns the requeue delay."""
    spec, gate = b.spec, b.spec.gate
    step = b.status.steps[-1]
    canary_wanted = step.canary_replicas + step.surge_replicas
    if b.status.step_state is StepState.SCALING:
        if obs.canary is not None and obs.canary.is_ready(canary_wanted, spec.weights_digest):
            b.update(step_state=StepState.GATING)
            b.update_step(gate_started_at=format_time(b.now))
            b.events.append(
                Event(
                    "Normal",
                    "CanaryReady",
                    f"step {b.status.current_step}: {canary_wanted} canary replica(s) ready; "
                    f"stable scaled to {step.stable_replicas}; hit-rate window open",
                )
            )
            return float(gate.check_interval_seconds)
        waited = b.elapsed_s(step.started_at)
        if waited >= gate.ready_timeout_seconds:
            ready = 0 if obs.canary is None else obs.canary.ready_replicas
            _begin_rollback(
                b,
                "CanaryNotReady",
                f"step {b.status.current_step}: {ready}/{canary_wanted} canary replica(s) ready "
                f"after {waited:.0f} s (readyTimeoutSeconds {gate.ready_timeout_seconds})",
                StepResult.NOT_READY,
            )
            return 0.0
        return float(min(gate.check_interval_seconds, gate.ready_timeout_seconds - waited))

    baseline = _baseline(b, obs)
    observed = obs.canary_hit_rate
    wanted = None if baseline is None else baseline * gate.recovery_percent / 100
    b.update(canary_hit_rate=observed)
    b.update_step(observed_hit_rate=observed, baseline_hit_rate=baseline, target_hit_rate=wanted)
    elapsed = b.elapsed_s(step.gate_started_at)
    recovered = wanted is not None and observed is not None and observed >= wanted
    if recovered and elapsed >= gate.hold_seconds:
        b.update_step(result=StepResult.PASSED, finished_at=format_time(b.now))
        message = (
            f"step {b.status.current_step}: canary hit rate {_fmt_rate(observed)} >= "
            f"{_fmt_rate(wanted)} ({gate.recovery_percent}% of stable {_fmt_rate(baseline)}) "
            f"after {elapsed:.0f} s"
        )
        b.events.append(Event("Normal", "StepPassed", message))
        index = b.status.current_step  # 1-based current == 0-based next
        if index < len(spec.steps):
            _start_step(b, index, obs)
            return 0.0
        assert b.status.previous is not None
        b.move(
            RolloutPhase.PROMOTING,
            "Promoting",
            f"all {len(spec.steps)} steps passed; writing {spec.weights_digest[:19]} into "
            f"the target and scaling it to {b.status.previous.replicas} while the canary serves",
            step_state=StepState.SCALING,
            promotion_started_at=format_time(b.now),
        )
        return 0.0
    if elapsed >= gate.window_seconds:
        why = (
            "no hit-rate data from the metric source"
            if observed is None or wanted is None
            else f"canary hit rate {_fmt_rate(observed)} < {_fmt_rate(wanted)} "
            f"({gate.recovery_percent}% of stable {_fmt_rate(baseline)})"
        )
        _begin_rollback(
            b,
            "HitRateNotRecovered",
            f"step {b.status.current_step}: {why} after {elapsed:.0f} s "
            f"(windowSeconds {gate.window_seconds}); a cache-key field probably changed",
            StepResult.TIMED_OUT,
        )
        return 0.0
    remaining = gate.window_seconds - elapsed
    if recovered:
        remaining = min(remaining, gate.hold_seconds - elapsed)
    return float(max(1.0, min(gate.check_interval_seconds, remaining)))


def _evaluate_promotion(b: _Builder, obs: Observations) -> float | None:
    """Promoting: is the target ready with the new version (Scaling), has its hit rate
    recovered against the warm canary's (Gating: then Succeeded)."""
    spec, gate = b.spec, b.spec.gate
    assert b.status.previous is not None
    total = b.status.previous.replicas
    if b.status.step_state is StepState.SCALING:
        if obs.target is not None and obs.target.is_ready(total, spec.weights_digest):
            b.update(step_state=StepState.GATING, handoff_started_at=format_time(b.now))
            b.events.append(
                Event("Normal", "TargetReady", f"target runs the new weights on {total} replicas")
            )
            return float(gate.check_interval_seconds)
        waited = b.elapsed_s(b.status.promotion_started_at)
        if waited >= gate.ready_timeout_seconds:
            _begin_rollback(
                b,
                "TargetNotReady",
                f"promotion: target not ready with the new weights after {waited:.0f} s",
                None,
            )
            return 0.0
        return float(min(gate.check_interval_seconds, gate.ready_timeout_seconds - waited))
    # Handoff: the target's fresh pods against the warm canary's.
    elapsed = b.elapsed_s(b.status.handoff_started_at)
    baseline, observed = obs.canary_hit_rate, obs.target_hit_rate
    wanted = None if baseline is None else baseline * gate.recovery_percent / 100
    recovered = wanted is not None and observed is not None and observed >= wanted
    if (recovered and elapsed >= gate.hold_seconds) or elapsed >= gate.window_seconds:
        event_type: Literal["Normal", "Warning"] = "Normal" if recovered else "Warning"
        detail = (
            f"target hit rate {_fmt_rate(observed)} >= {_fmt_rate(wanted)}"
            if recovered
            else f"handoff window ({gate.window_seconds} s) over before the target's caches "
            f"recovered ({_fmt_rate(observed)} vs {_fmt_rate(wanted)}); the version itself "
            f"passed every step"
        )
        b.move(
            RolloutPhase.SUCCEEDED,
            "Succeeded",
            f"target runs {spec.weights_digest[:19]} on {total} replicas; canary removed; {detail}",
            event_type,
            step_state=None,
        )
        return None
    remaining = gate.window_seconds - elapsed
    if recovered:
        remaining = min(remaining, gate.hold_seconds - elapsed)
    return float(max(1.0, min(gate.check_interval_seconds, remaining)))


def _finish_rollback(b: _Builder, obs: Observations) -> float | None:
    """RolledBack once the target runs its previous version on all its replicas again."""
    previous = b.status.previous
    assert previous is not None
    if obs.target is not None and obs.target.is_ready(previous.replicas, previous.weights_digest):
        # The reason stays the cause (HitRateNotRecovered, Aborted, ...): that is what a
        # person reading `kubectl get mro -o wide` needs.
        b.move(
            RolloutPhase.ROLLED_BACK,
            b.status.reason,
            f"target restored to {previous.weights_digest[:19] or 'its previous weights'} on "
            f"{previous.replicas} replicas; canary removed; cause: {b.status.message}",
            "Warning",
            event_reason="RolledBack",
        )
        return None
    return float(b.spec.gate.check_interval_seconds)


def _pause_or_resume(b: _Builder) -> None:
    phase = b.status.phase
    if b.spec.paused and phase in (RolloutPhase.PROGRESSING, RolloutPhase.PROMOTING):
        b.move(
            RolloutPhase.PAUSED,
            "Paused",
            f"paused by spec.paused in {phase.value}; step clocks stop",
            paused_at=format_time(b.now),
            resume_phase=phase,
        )
    elif not b.spec.paused and phase is RolloutPhase.PAUSED:
        assert b.status.resume_phase is not None
        paused_s = b.elapsed_s(b.status.paused_at)
        shift = timedelta(seconds=paused_s)

        def later(text: str) -> str:
            return format_time(parse_time(text) + shift) if text else text

        steps = list(b.status.steps)
        if steps:
            steps[-1] = steps[-1].model_copy(
                update={
                    "started_at": later(steps[-1].started_at),
                    "gate_started_at": later(steps[-1].gate_started_at),
                }
            )
        b.update(
            steps=steps,
            promotion_started_at=later(b.status.promotion_started_at),
            handoff_started_at=later(b.status.handoff_started_at),
        )
        b.move(
            b.status.resume_phase,
            "Resumed",
            f"resumed after {paused_s:.0f} s paused",
            paused_at="",
            resume_phase=None,
        )


def _start(b: _Builder, obs: Observations) -> float | None:
    spec = b.spec
    target = obs.target
    assert target is not None
    if spec.abort:
        b.move(RolloutPhase.ROLLED_BACK, "Aborted", "aborted before it started", "Warning")
        return None
    same_image = spec.image is None or spec.image == target.image
    if target.weights_digest == spec.weights_digest and same_image:
        b.move(
            RolloutPhase.SUCCEEDED,
            "AlreadyRolledOut",
            f"target already runs {spec.weights_digest[:19]}; nothing to do",
        )
        return None
    if target.replicas < 1:
        b.move(
            RolloutPhase.FAILED,
            "NothingToCanary",
            "target has 0 replicas; scale it up or set its template directly",
            "Warning",
        )
        return None
    b.update(
        previous=PreviousVersion(
            weights_digest=target.weights_digest, image=target.image, replicas=target.replicas
        ),
        total_steps=len(spec.steps),
    )
    if obs.target_hit_rate is not None:
        b.update(baseline_hit_rate=obs.target_hit_rate)
    _start_step(b, 0, obs)
    return 0.0


def _phase_conditions(
    old: list[Condition], phase: RolloutPhase, reason: str, message: str, now: str, generation: int
) -> list[Condition]:
    """Ready, Progressing and Degraded as the phase says, each with the phase's reason."""
    wanted = {
        "Ready": phase is RolloutPhase.SUCCEEDED,
        "Progressing": phase
        in (
            RolloutPhase.PENDING,
            RolloutPhase.PROGRESSING,
            RolloutPhase.PROMOTING,
            RolloutPhase.ROLLING_BACK,
        ),
        "Degraded": phase
        in (RolloutPhase.ROLLING_BACK, RolloutPhase.ROLLED_BACK, RolloutPhase.FAILED),
    }
    conditions = old
    for kind, value in wanted.items():
        conditions = set_condition(
            conditions, kind, value, reason or phase.value, message, now, generation
        )
    return conditions


def advance(
    spec: ModelRolloutSpec,
    status: ModelRolloutStatus,
    obs: Observations,
    now: datetime,
    generation: int = 0,
) -> Transition:
    """One level-triggered evaluation: the next status, the workload it asks for, the events of
    every transition taken, and when to look again (None: only on change)."""
    b = _Builder(spec, status, now, [])
    requeue: float | None = None
    phase = status.phase
    if phase in TERMINAL_PHASES:
        requeue = None
    elif obs.target is None:
        if phase is RolloutPhase.PENDING:
            b.update(
                reason="TargetNotFound", message=f"Deployment {spec.target_ref.name} not found"
            )
            requeue = 10.0
        else:
            b.move(
                RolloutPhase.FAILED,
                "TargetNotFound",
                f"Deployment {spec.target_ref.name} disappeared during the rollout",
                "Warning",
            )
    elif (
        spec.abort and phase is not RolloutPhase.ROLLING_BACK and phase is not RolloutPhase.PENDING
    ):
        _begin_rollback(b, "Aborted", "aborted by spec.abort", StepResult.ABORTED)
        requeue = _finish_rollback(b, obs)
    elif phase is RolloutPhase.PENDING:
        # The first step is entered, not evaluated: its clocks start now.
        requeue = _start(b, obs)
    else:
        _pause_or_resume(b)
        phase = b.status.phase
        if phase is RolloutPhase.PROGRESSING:
            requeue = _evaluate_step(b, obs)
        elif phase is RolloutPhase.PROMOTING:
            requeue = _evaluate_promotion(b, obs)
        elif phase is RolloutPhase.ROLLING_BACK:
            requeue = _finish_rollback(b, obs)
    final = b.status
    conditions = _phase_conditions(
        final.conditions, final.phase, final.reason, final.message, format_time(now), generation
    )
    final = final.model_copy(
        update={
            "conditions": conditions,
            "observed_generation": generation,
            "hit_rate_percent": format_percent(final.canary_hit_rate),
            "baseline_percent": format_percent(final.baseline_hit_rate),
        }
    )
    if requeue == 0.0:
        requeue = 1.0
    return Transition(final, desired_actions(spec, final), tuple(b.events), requeue)
