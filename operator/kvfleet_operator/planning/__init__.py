"""Pure planners: no I/O, no clock reads, no Kubernetes client. Handlers call these."""

from kvfleet_operator.planning.fleet import (
    HomeSetPlan,
    ReplicaPod,
    build_fleet_config,
    config_hash,
    plan_home_sets,
    ready_replicas,
)
from kvfleet_operator.planning.rollout import (
    Action,
    DeleteCanary,
    EnsureCanary,
    Event,
    Observations,
    ScaleTarget,
    SetTargetVersion,
    Transition,
    Workload,
    advance,
    canary_replicas_for,
    desired_actions,
)
from kvfleet_operator.planning.tiers import (
    NvmeMeasurement,
    TierDecision,
    TierPlan,
    aggregate_nvme,
    decide_tiers,
)

__all__ = [
    "Action",
    "DeleteCanary",
    "EnsureCanary",
    "Event",
    "HomeSetPlan",
    "NvmeMeasurement",
    "Observations",
    "ReplicaPod",
    "ScaleTarget",
    "SetTargetVersion",
    "TierDecision",
    "TierPlan",
    "Transition",
    "Workload",
    "advance",
    "aggregate_nvme",
    "build_fleet_config",
    "canary_replicas_for",
    "config_hash",
    "decide_tiers",
    "desired_actions",
    "plan_home_sets",
    "ready_replicas",
]
