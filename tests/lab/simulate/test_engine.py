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
from kvfleet_lab.simulate._cache import TIER_NVME, scaled_config, sketch_width
from kvfleet_lab.simulate._engine import (
    TIER_DRAM,
    TIER_MISS,
    prefix_tokens_of,
    replica_name,
    tenant_name,
    version_digest,
)
from kvfleet_runtime.affinity import home_sets
from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey, CacheManager, CacheTuning, block_hashes

REF = fleet_profile()
PREFIX_BYTES = 1500 * REF.kv_bytes_per_token
MISS_S = 1600 * REF.recompute_s_per_token
HIT_S = PREFIX_BYTES / REF.dram_bytes_per_s + 100 * REF.recompute_s_per_token
ADMIT = CacheTuning(num_t0_blocks=1).admit_min_sightings
"""The shipped admission: a prefix is stored from this sighting on."""


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


def test_the_shipped_admission_stores_a_prefix_then_every_request_hits() -> None:
    result = simulate(config())
    assert len(result.arrival_s) >= 5
    n = len(result.tier)
    assert result.tier.tolist() == [TIER_MISS] * ADMIT + [TIER_DRAM] * (n - ADMIT)
    # The replica's cache holds exactly that one prefix at the end.
    assert result.resident_bytes.tolist() == [PREFIX_BYTES]


def test_an_explicit_admission_threshold_overrides_the_shipped_one() -> None:
    for admit in (1, 3):
        result = simulate(config(fleet=Fleet(num_replicas=1, admit_after=admit)))
        n = len(result.tier)
        assert result.tier.tolist() == [TIER_MISS] * admit + [TIER_DRAM] * (n - admit)


def test_ttft_of_a_lone_miss_is_recompute_and_of_a_hit_is_fetch_plus_suffix() -> None:
    result = simulate(config())
    # Requests are ~100 s apart: nothing queues.
    assert result.ttft_s[:ADMIT] == pytest.approx([MISS_S] * ADMIT)
    assert result.ttft_s[ADMIT:] == pytest.approx([HIT_S] * (len(result.tier) - ADMIT))
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


@pytest.mark.parametrize(("templates", "entries", "seed"), [(2, 1, 1), (4, 1, 2), (6, 3, 3)])
def test_a_replica_hits_exactly_what_the_shipped_manager_holds(
    templates: int, entries: int, seed: int
) -> None:
    """The simulator's cache is `CacheManager`: the same requests replayed, in order, through a
    manager of the same configuration hit the same requests."""
    wl = Workload(rps=0.02, num_tenants=1, templates_per_tenant=templates, reuse_fraction=0.8)
    result = simulate(
        config(
            workload=wl,
            fleet=Fleet(num_replicas=1, cache_bytes=entries * PREFIX_BYTES),
            duration_s=3000,
            seed=seed,
        )
    )
    # A miss reaches the cache when its prefill ends, so no request may arrive during another's:
    # then the simulator's order of replays is the order of arrival.
    assert np.diff(result.arrival_s).min() > MISS_S
    now = [0.0]
    manager = CacheManager(
        scaled_config(entries, 1500, sketch_width=sketch_width(1)),
        bytes_per_block=PREFIX_BYTES,
        clock=lambda: now[0],
    )
    key = CacheKey(tenant_name(0), REF.model, version_digest(0), REF.kv_dtype, "r", "a")
    expected = []
    for arrival_s, pid in zip(result.arrival_s.tolist(), result.prefix_id.tolist(), strict=True):
        now[0] = arrival_s
        chain = block_hashes(key, prefix_tokens_of(pid))
        expected.append(TIER_DRAM if manager.replay(key, chain, 1500) else TIER_MISS)
    assert result.tier.tolist() == expected
    assert TIER_DRAM in expected and expected.count(TIER_MISS) > templates


def test_scaled_config_is_the_shipped_one_with_block_counts_in_prefix_tokens() -> None:
    shipped = CacheTuning(num_t0_blocks=0, num_t1_blocks=7)
    cfg = scaled_config(7, 1500, sketch_width=4096)
    assert (cfg.num_t0_blocks, cfg.num_t1_blocks) == (0, 7)  # host DRAM is the manager's T1
    assert cfg.admit_min_sightings == shipped.admit_min_sightings
    assert cfg.pin_max_bytes == shipped.pin_max_bytes  # bytes: a block is a prefix's bytes
    # 64 blocks of 16 tokens = 1,024 tokens: one 1,500-token prefix; 1,024 blocks: 11 prefixes.
    assert shipped.thrash_min_blocks * BLOCK_SIZE == 1024 and cfg.thrash_min_blocks == 1
    assert shipped.store_min_blocks * BLOCK_SIZE == 16_384 and cfg.store_min_blocks == 11
    assert cfg.hash_memo_entries == 0 and cfg.sketch_width == 4096
    assert scaled_config(7, 1500, sketch_width=4096, admit_min_sightings=5).hot_min_sightings == 5


def test_sketch_width_is_wide_against_the_keys_and_never_beyond_the_shipped_width() -> None:
    assert sketch_width(1) == 4096
    assert sketch_width(10_000) == 131_072  # 8 counters per key, rounded up to a power of two
    assert sketch_width(10**9) == CacheTuning(num_t0_blocks=1).sketch_width


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
    assert after[:ADMIT] == [TIER_MISS] * ADMIT and set(after[ADMIT:]) == {TIER_DRAM}
    assert [e.kind for e in result.rollout_events][:1] == ["step"]


def test_nvme_tier_catches_dram_evictions() -> None:
    wl = Workload(rps=0.2, num_tenants=1, templates_per_tenant=4)
    dram_only = Fleet(num_replicas=1, cache_bytes=PREFIX_BYTES, admit_after=1)
    with_nvme = Fleet(num_replicas=1, cache_bytes=PREFIX_BYTES, admit_after=1, nvme_bytes=8 * GiB)
    off = simulate(config(workload=wl, fleet=dram_only, duration_s=300))
    on = simulate(config(workload=wl, fleet=with_nvme, duration_s=300))
    assert np.array_equal(off.prefix_id, on.prefix_id)  # the same requests
    nvme = on.tier == TIER_NVME
    assert TIER_NVME not in off.tier.tolist() and nvme.sum() >= 10
    # NVMe only ever holds what DRAM stored first: a prefix's first request always misses, and
    # the hits NVMe adds turn misses into hits.
    first = {int(p): i for i, p in reversed(list(enumerate(on.prefix_id.tolist())))}
    assert all(on.tier[i] == TIER_MISS for i in first.values())
    assert (on.tier != TIER_MISS).sum() > (off.tier != TIER_MISS).sum()
    # A fetch alone on the link takes prefix bytes / NVMe bandwidth; two at once share it.
    alone_s = PREFIX_BYTES / REF.nvme_bytes_per_s
    assert on.fetch_s[nvme].min() == pytest.approx(alone_s)
    assert (on.fetch_s[nvme] <= 2 * alone_s * (1 + 1e-9)).all()


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
