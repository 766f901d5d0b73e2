"""The simulation on tiny fleets, with exact expectations where the arithmetic allows them."""

from __future__ import annotations

import numpy as np
import pytest

from kvfleet_lab.simulate import (
    Fleet,
    GiB,
    Rollout,
    Routing,
    RoutingPolicy,
    SimConfig,
    Workload,
    fleet_profile,
    simulate,
)
from kvfleet_lab.simulate._engine import TIER_DRAM, TIER_MISS, replica_name, tenant_name
from kvfleet_runtime.routing import home_sets

REF = fleet_profile()
PREFIX_BYTES = 1500 * REF.kv_bytes_per_token
MISS_S = 1600 * REF.recompute_s_per_token
HIT_S = PREFIX_BYTES / REF.dram_bytes_per_s + 100 * REF.recompute_s_per_token


def config(
    *,
    workload: Workload | None = None,
    fleet: Fleet | None = None,
    routing: Routing = Routing.AFFINITY,
    duration_s: float = 2000.0,
    seed: int = 3,
    rollout: Rollout | None = None,
    warm_start: bool = False,
) -> SimConfig:
    return SimConfig(
        REF,
        workload or Workload(rps=0.01, num_tenants=1, templates_per_tenant=1),
        fleet or Fleet(num_replicas=1),
        RoutingPolicy(routing),
        duration_s,
        seed,
        warm_start=warm_start,
        rollout=rollout,
    )


def test_admission_stores_on_second_sighting_then_every_request_hits() -> None:
    result = simulate(config())
    assert len(result.arrival_s) >= 5
    assert result.tier.tolist() == [TIER_MISS, TIER_MISS] + [TIER_DRAM] * (len(result.tier) - 2)


def test_ttft_of_a_lone_miss_is_recompute_and_of_a_hit_is_fetch_plus_suffix() -> None:
    result = simulate(config())
    # Requests are ~100 s apart: nothing queues.
    assert result.ttft_s[:2] == pytest.approx([MISS_S, MISS_S])
    assert result.ttft_s[2:] == pytest.approx([HIT_S] * (len(result.tier) - 2))
    assert pytest.approx(56.6, abs=0.1) == MISS_S * 1e3  # 1,600 tokens x 35.4 us
    assert PREFIX_BYTES / REF.dram_bytes_per_s * 1e3 == pytest.approx(7.68, abs=0.01)


def test_same_seed_same_run_other_seed_other_run() -> None:
    cfg = config(
        workload=Workload(rps=20, num_tenants=50, reuse_fraction=0.6),
        fleet=Fleet(num_replicas=4, cache_bytes=20 * PREFIX_BYTES),
        duration_s=120,
    )
    a, b = simulate(cfg), simulate(cfg)
    assert np.array_equal(a.arrival_s, b.arrival_s)
    assert np.array_equal(a.ttft_s, b.ttft_s)
    assert np.array_equal(a.tier, b.tier)
    other = simulate(config(workload=cfg.workload, fleet=cfg.fleet, duration_s=120, seed=4))
    assert not np.array_equal(a.arrival_s[:10], other.arrival_s[:10])


def test_lru_of_one_entry_hits_only_on_a_repeat() -> None:
    result = simulate(
        config(
            workload=Workload(rps=0.05, num_tenants=1, templates_per_tenant=2),
            fleet=Fleet(num_replicas=1, cache_bytes=PREFIX_BYTES, admit_after=1),
            seed=6,
        )
    )
    # A prefix is stored when its prefill ends, so no request may arrive during another's.
    assert np.diff(result.arrival_s).min() > MISS_S
    prefix = result.prefix_id.tolist()
    expected = [TIER_MISS] + [
        TIER_DRAM if prefix[i] == prefix[i - 1] else TIER_MISS for i in range(1, len(prefix))
    ]
    assert result.tier.tolist() == expected
    assert TIER_DRAM in expected and expected.count(TIER_MISS) > 1


def test_one_shot_prefixes_never_hit() -> None:
    result = simulate(
        config(workload=Workload(rps=0.05, num_tenants=1, templates_per_tenant=1, reuse_fraction=0))
    )
    assert (result.tier == TIER_MISS).all()
    assert not result.is_template.any()


def test_affinity_sends_every_request_to_its_first_home_while_there_is_room() -> None:
    wl = Workload(rps=30, num_tenants=40)
    result = simulate(config(workload=wl, fleet=Fleet(num_replicas=6), duration_s=60))
    names = [replica_name(i) for i in range(6)]
    homes = home_sets([tenant_name(t) for t in range(40)], names, 3)
    first = [names.index(homes[tenant_name(t)][0]) for t in range(40)]
    assert result.replica.tolist() == [first[t] for t in result.tenant.tolist()]
    assert not result.spilled.any()


def test_full_homes_spill_to_the_least_loaded_replica() -> None:
    # Room for ~3 requests' KV per replica: a burst fills all three homes.
    tiny_hbm = 3 * 1600 * REF.kv_bytes_per_token
    result = simulate(
        config(
            workload=Workload(rps=50, num_tenants=2, decode_s=5.0),
            fleet=Fleet(num_replicas=8, hbm_kv_bytes=tiny_hbm),
            duration_s=30,
        )
    )
    assert 0 < result.spilled.mean() < 1
    names = [replica_name(i) for i in range(8)]
    homes = home_sets([tenant_name(t) for t in range(2)], names, 3)
    spilled_to = {
        names[r]
        for r, t in zip(result.replica[result.spilled], result.tenant[result.spilled], strict=True)
        if names[r] not in homes[tenant_name(int(t))]
    }
    assert spilled_to  # spills leave the home set


def test_random_routing_spreads_and_rendezvous_concentrates() -> None:
    wl = Workload(rps=40, num_tenants=5)
    spread = simulate(
        config(workload=wl, fleet=Fleet(num_replicas=8), routing=Routing.RANDOM, duration_s=60)
    )
    sticky = simulate(config(workload=wl, fleet=Fleet(num_replicas=8), duration_s=60))
    assert len(set(spread.replica.tolist())) == 8
    assert len(set(sticky.replica.tolist())) <= 5


def test_a_new_weights_version_misses_everything_it_had() -> None:
    wl = Workload(rps=0.05, num_tenants=1, templates_per_tenant=1)
    result = simulate(
        config(workload=wl, rollout=Rollout(at_s=1000.0), warm_start=True, duration_s=2000)
    )
    before = result.arrival_s < 1000
    switched = result.new_version
    assert (result.tier[before & ~switched] == TIER_DRAM).all()
    after = result.tier[switched].tolist()
    assert after[:2] == [TIER_MISS, TIER_MISS] and set(after[2:]) <= {TIER_DRAM}
    assert [e.kind for e in result.rollout_events][:1] == ["step"]


def test_nvme_tier_catches_dram_evictions() -> None:
    wl = Workload(rps=0.2, num_tenants=1, templates_per_tenant=4)
    fleet = Fleet(num_replicas=1, cache_bytes=PREFIX_BYTES, admit_after=1, nvme_bytes=8 * GiB)
    result = simulate(config(workload=wl, fleet=fleet, duration_s=300))
    assert 3 in result.tier.tolist()  # served from NVMe
    nvme = result.tier == 3
    assert result.fetch_s[nvme] == pytest.approx(PREFIX_BYTES / REF.nvme_bytes_per_s, rel=0.3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rps": 0}, "rps must be positive"),
        ({"reuse_fraction": 1.5}, "reuse_fraction must be in [0, 1]"),
    ],
)
def test_bad_workload_names_the_value(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Workload(**kwargs)  # type: ignore[arg-type]


def test_rollout_steps_must_rise_to_one() -> None:
    with pytest.raises(ValueError, match=r"rise to 1\.0"):
        Rollout(at_s=0, steps=(0.5, 0.1, 1.0))
