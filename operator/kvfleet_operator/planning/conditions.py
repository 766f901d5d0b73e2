"""Kubernetes-style conditions: lastTransitionTime moves only when the status value changes."""

from __future__ import annotations

from kvfleet_operator.api import Condition, ConditionStatus

__all__ = ["set_condition"]


def set_condition(
    conditions: list[Condition],
    type_: str,
    value: bool,
    reason: str,
    message: str,
    now: str,
    generation: int,
) -> list[Condition]:
    status = ConditionStatus.TRUE if value else ConditionStatus.FALSE
    before = next((c for c in conditions if c.type == type_), None)
    moved = before is None or before.status is not status
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=now if before is None or moved else before.last_transition_time,
        observed_generation=generation,
    )
    return [c for c in conditions if c.type != type_] + [new]
