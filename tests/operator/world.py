"""A tiny simulated cluster for the rollout state machine: two Deployments that obey the actions
the planner asks for, a clock, and scripted hit rates. No Kubernetes; exact expectations."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from kvfleet_operator.api import ModelRolloutSpec, ModelRolloutStatus
from kvfleet_operator.planning import (
    Action,
    DeleteCanary,
    EnsureCanary,
    Observations,
    ScaleTarget,
    SetTargetVersion,
    Transition,
    Workload,
    advance,
)

OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64
T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def rollout_spec(**overrides: object) -> ModelRolloutSpec:
    data: dict[str, object] = {
        "targetRef": {"name": "llm"},
        "weightsDigest": NEW,
        "gate": {"holdSeconds": 0, "windowSeconds": 1800, "readyTimeoutSeconds": 600},
    }
    data.update(overrides)
    return ModelRolloutSpec.model_validate(data)


@dataclass
class Deploy:
    replicas: int
    digest: str
    image: str = "kvfleet:1"
    ready: int | None = None  # None: as many as replicas (pods become ready at once)

    def observe(self) -> Workload:
        ready = self.replicas if self.ready is None else min(self.ready, self.replicas)
        return Workload(self.replicas, ready, ready, self.digest, self.image)


@dataclass
class World:
    spec: ModelRolloutSpec
    target: Deploy | None = field(default_factory=lambda: Deploy(10, OLD))
    canary: Deploy | None = None
    target_hit: float | None = 0.6
    canary_hit: float | None = 0.0
    saved_tokens_per_s: float | None = None
    canary_ready_limit: int | None = None  # pods of the canary that ever become ready
    now: datetime = T0
    status: ModelRolloutStatus = field(default_factory=ModelRolloutStatus)
    generation: int = 1
    log: list[Transition] = field(default_factory=list)

    def observations(self) -> Observations:
        return Observations(
            target=None if self.target is None else self.target.observe(),
            canary=None if self.canary is None else self.canary.observe(),
            target_hit_rate=self.target_hit,
            canary_hit_rate=self.canary_hit,
            target_saved_prefill_tokens_per_s=self.saved_tokens_per_s,
        )

    def apply(self, actions: tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, EnsureCanary):
                if self.canary is None:
                    self.canary = Deploy(0, self.spec.weights_digest, self.spec.image or "")
                self.canary.replicas = action.replicas
                self.canary.ready = self.canary_ready_limit
            elif isinstance(action, DeleteCanary):
                self.canary = None
            elif isinstance(action, ScaleTarget):
                assert self.target is not None
                self.target.replicas = action.replicas
            elif isinstance(action, SetTargetVersion):
                assert self.target is not None
                self.target.digest = action.weights_digest
                if action.image:
                    self.target.image = action.image

    def step(self, after_s: float = 0.0, apply: bool = True) -> Transition:
        """Advance the clock, evaluate once, apply the actions, write the status back through JSON
        (as the API server stores it)."""
        self.now += timedelta(seconds=after_s)
        result = advance(self.spec, self.status, self.observations(), self.now, self.generation)
        self.log.append(result)
        if apply:
            self.apply(result.actions)
            self.status = stored(result.status)
        return result

    def counts(self) -> tuple[str, int, str | None, int, int]:
        """(phase, step, step state, canary replicas, target replicas)."""
        state = self.status.step_state.value if self.status.step_state else None
        canary = 0 if self.canary is None else self.canary.replicas
        target = 0 if self.target is None else self.target.replicas
        return (self.status.phase.value, self.status.current_step, state, canary, target)


def stored(status: ModelRolloutStatus) -> ModelRolloutStatus:
    """A status after a round trip through the API server (camelCase JSON, Nones dropped)."""
    wire = json.loads(status.model_dump_json(by_alias=True, exclude_none=True))
    return ModelRolloutStatus.model_validate(wire)


def with_spec(world: World, **overrides: object) -> None:
    merged = world.spec.model_dump(by_alias=True, exclude_none=True) | overrides
    world.spec = ModelRolloutSpec.model_validate(merged)
    world.generation += 1


__all__ = ["NEW", "OLD", "T0", "Deploy", "World", "replace", "rollout_spec", "stored", "with_spec"]
