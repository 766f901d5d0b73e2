"""Home sets over ready replica pods and the fleet config the operator publishes."""

from __future__ import annotations

import statistics

from kvfleet_operator.api import KVCachePolicySpec
from kvfleet_operator.planning import (
    ReplicaPod,
    build_fleet_config,
    decide_tiers,
    plan_home_sets,
    ready_replicas,
)
from kvfleet_runtime.affinity import rendezvous_top_k
from kvfleet_runtime.config.fleet import dump_fleet_config, parse_fleet_config

SPEC = KVCachePolicySpec.model_validate(
    {
        "selector": {"matchLabels": {"app": "llm"}},
        "tenants": ["acme", "globex", "initech"],
        "platformPrefixes": ["sys-preamble-v1"],
        "affinity": {"k": 2},
    }
)


def test_only_running_ready_pods_get_tenants() -> None:
    pods = [
        ReplicaPod("r2", "10.0.0.2", ready=True),
        ReplicaPod("r0", "10.0.0.1", ready=True),
        ReplicaPod("r1", "10.0.0.3", ready=False),
        ReplicaPod("r3", "10.0.0.4", ready=True, deleting=True),
        ReplicaPod("r4", "", ready=True),
    ]
    assert [p.name for p in ready_replicas(pods)] == ["r0", "r2"]


def test_home_sets_are_the_routers_rendezvous_sets() -> None:
    replicas = [f"llm-{i}" for i in range(7)]
    plan = plan_home_sets(["acme", "globex", "acme"], replicas, 3)
    assert list(plan.home_sets) == ["acme", "globex"]
    for tenant, homes in plan.home_sets.items():
        assert list(homes) == rendezvous_top_k(tenant, replicas, 3)
    assert sum(plan.tenants_per_replica.values()) == 6


def test_design_fleet_spreads_about_136_tenants_per_replica() -> None:
    tenants = [f"tenant-{i:04d}" for i in range(2000)]
    replicas = [f"replica-{i:02d}" for i in range(44)]
    plan = plan_home_sets(tenants, replicas, 3)
    loads = [plan.tenants_per_replica[r] for r in replicas]
    assert sum(loads) == 6000
    assert 130 <= statistics.mean(loads) <= 140
    assert max(loads) < 2 * statistics.mean(loads)


def test_one_replica_leaving_moves_only_its_tenants() -> None:
    tenants = [f"t{i}" for i in range(500)]
    replicas = [f"r{i}" for i in range(20)]
    before = plan_home_sets(tenants, replicas, 3).home_sets
    after = plan_home_sets(tenants, replicas[:-1], 3).home_sets
    moved = [t for t in tenants if before[t] != after[t]]
    assert all("r19" in before[t] for t in moved)


def test_no_replicas_no_home_sets() -> None:
    plan = plan_home_sets(["acme"], [], 3)
    assert plan.home_sets == {}
    assert plan.summary("cm", "").num_replicas == 0


def test_fleet_config_is_canonical_and_parses_back() -> None:
    pods = [
        ReplicaPod("llm-b", "10.0.0.2", ready=True, weights_digest="sha256:" + "1" * 64),
        ReplicaPod("llm-a", "10.0.0.1", ready=True),
        ReplicaPod("llm-c", "10.0.0.3", ready=False),
    ]
    tiers = decide_tiers(SPEC)
    homes = plan_home_sets(SPEC.tenants, [p.name for p in ready_replicas(pods)], SPEC.affinity.k)
    config = build_fleet_config("ns/kv", 4, SPEC, tiers, pods)
    text = dump_fleet_config(config)
    assert parse_fleet_config(text) == config
    assert [r.name for r in config.replicas] == ["llm-a", "llm-b"]
    assert config.replicas[0].url == "http://10.0.0.1:8000"
    assert config.replicas[1].weights_digest == "sha256:" + "1" * 64
    assert config.tiers.nvme is False and config.tiers.t1_host is True
    assert config.affinity.k == 2 and config.platform_prefixes == ("sys-preamble-v1",)
    # No home sets in the text: each reader's own rendezvous over `replicas` gives the plan's.
    assert config.home_sets == {} and '"home_sets": {}' in text
    names = sorted(r.name for r in config.replicas)
    assert {t: tuple(rendezvous_top_k(t, names, config.affinity.k)) for t in SPEC.tenants} == (
        homes.home_sets
    )
    assert config.model_id == "reference-70b" and config.policy == "ns/kv"
    again = build_fleet_config("ns/kv", 4, SPEC, tiers, list(reversed(pods)))
    assert dump_fleet_config(again) == text
    summary = homes.summary("kv-fleet", text)
    assert (summary.num_tenants, summary.num_replicas, summary.k) == (3, 2, 2)
    assert summary.min_tenants_per_replica + summary.max_tenants_per_replica == 6


def test_replan_from_previous_equals_a_fresh_plan() -> None:
    tenants = [f"t{i}" for i in range(300)]
    replicas = [f"r{i:02d}" for i in range(12)]
    plan = plan_home_sets(tenants, replicas, 3)
    steps = [
        replicas[:-1],  # one leaves
        [*replicas[:-1], "r99"],  # one joins
        ["r00", "r05"],  # fewer than k
        ["r00", "r05", "r07", "r08", "r11"],  # back above k
        replicas,
    ]
    for names in steps:
        plan = plan_home_sets(tenants, names, 3, previous=plan)
        fresh = plan_home_sets(tenants, names, 3)
        assert plan.home_sets == fresh.home_sets
        assert plan.tenants_per_replica == fresh.tenants_per_replica
    # New tenants, dropped tenants and another k are planned too.
    again = plan_home_sets([*tenants[100:], "new"], replicas, 3, previous=plan)
    assert again.home_sets == plan_home_sets([*tenants[100:], "new"], replicas, 3).home_sets
    other_k = plan_home_sets(tenants, replicas, 2, previous=plan)
    assert other_k.home_sets == plan_home_sets(tenants, replicas, 2).home_sets
    # Nothing changed: the same plan, nothing rehashed.
    assert plan_home_sets(tenants, replicas, 3, previous=plan) is plan
