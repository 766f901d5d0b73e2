"""`HomeSetPlans`: each policy's last plan, bounded, least recently reconciled dropped first; a
re-plan from the last plan equals a plan from scratch."""

from __future__ import annotations

from kvfleet_operator.handlers import HomeSetPlans
from kvfleet_operator.planning import plan_home_sets

TENANTS = tuple(f"t{i}" for i in range(20))
REPLICAS = tuple(f"r{i}" for i in range(8))


def test_a_replan_from_the_last_plan_equals_one_from_scratch() -> None:
    plans = HomeSetPlans()
    plans.plan("ns/kv", TENANTS, REPLICAS, 3)
    fewer = REPLICAS[:3] + REPLICAS[4:]
    assert plans.plan("ns/kv", TENANTS, fewer, 3) == plan_home_sets(TENANTS, fewer, 3)


def test_plans_are_bounded_and_forgotten() -> None:
    plans = HomeSetPlans(max_plans=2)
    for name in ("a", "b"):
        plans.plan(f"ns/{name}", TENANTS, REPLICAS, 2)
    plans.plan("ns/a", TENANTS, REPLICAS, 2)  # a is now the most recently reconciled
    plans.plan("ns/c", TENANTS, REPLICAS, 2)  # b goes
    assert len(plans) == 2
    plans.forget("ns", "b")  # already gone: nothing happens
    plans.forget("ns", "a")
    assert len(plans) == 1
