"""The scenarios behind `kvfleet simulate`: each runs the simulation and sets what it measured
beside the design's closed-form figures."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kvfleet_lab.simulate._cache import admission_sightings
from kvfleet_lab.simulate._closed_form import (
    FleetFigures,
    fleet_figures,
    shared_fetch_bytes_per_s,
)
from kvfleet_lab.simulate._config import (
    Fleet,
    GiB,
    Rollout,
    Routing,
    RoutingPolicy,
    SimConfig,
    TiB,
    Workload,
)
from kvfleet_lab.simulate._engine import (
    RolloutEvent,
    SimResult,
    replica_name,
    simulate,
    tenant_name,
)
from kvfleet_lab.simulate._link import SharedLink
from kvfleet_lab.simulate._metrics import Metrics, Window, measure, time_series
from kvfleet_lab.simulate._profile import FleetProfile, fleet_profile
from kvfleet_runtime.affinity import home_sets
from kvfleet_runtime.breakeven import MODELS, KVDtype
from kvfleet_runtime.breakeven.plan import REFERENCE_MLA

PLANNED_HIT_RATE = 0.6
"""The design's value case: 60% of prefix tokens hit. The savings workload makes 60% of requests
reuse a template (the rest carry one-shot prefixes), so the hit rate is an outcome, not an input."""
STAGED_STEPS = (0.02, 0.10, 0.50, 1.0)  # canary (one replica of 44) -> 10% -> 50% -> 100%
DEFAULT_WARM_UTILIZATION = 0.7
DEFAULT_TTFT_SLO_S = 5.0
# A host whose DRAM is mostly spoken for: a replica's first-home slice (~104 GiB) overflows it.
SMALL_DRAM_BYTES = 64 * GiB


def format_gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:,.0f} GiB" if num_bytes < TiB else f"{num_bytes / TiB:,.0f} TiB"


def _figures(profile: FleetProfile, workload: Workload, fleet: Fleet, k: int) -> FleetFigures:
    return fleet_figures(
        profile,
        num_tenants=workload.num_tenants,
        templates_per_tenant=workload.templates_per_tenant,
        prefix_tokens=workload.prefix_tokens,
        num_replicas=fleet.num_replicas,
        k=k,
        cache_bytes=fleet.cache_bytes,
        rps=workload.rps,
        hit_rate=PLANNED_HIT_RATE,
    )


@dataclass(frozen=True, slots=True)
class HomeSlice:
    """Tenants per replica and their working set, from the real rendezvous home sets."""

    mean_tenants: float
    min_tenants: int
    max_tenants: int
    mean_bytes: float
    max_bytes: float
    first_home_mean_bytes: float
    """What a replica actually serves while no home is over the occupancy threshold."""


def home_slice(workload: Workload, fleet: Fleet, k: int, profile: FleetProfile) -> HomeSlice:
    names = [replica_name(i) for i in range(fleet.num_replicas)]
    sets = home_sets([tenant_name(t) for t in range(workload.num_tenants)], names, k)
    per_replica = Counter(r for homes in sets.values() for r in homes)
    counts = [per_replica.get(r, 0) for r in names]
    tenant_bytes = (
        workload.templates_per_tenant * workload.prefix_tokens * profile.kv_bytes_per_token
    )
    return HomeSlice(
        mean_tenants=float(np.mean(counts)),
        min_tenants=min(counts),
        max_tenants=max(counts),
        mean_bytes=float(np.mean(counts)) * tenant_bytes,
        max_bytes=max(counts) * tenant_bytes,
        first_home_mean_bytes=workload.num_tenants / fleet.num_replicas * tenant_bytes,
    )


@dataclass(frozen=True, slots=True)
class PolicyRun:
    policy: str
    metrics: Metrics
    resident_bytes_mean: float
    routed_template_bytes_mean: float


def _run_policy(config: SimConfig, measure_from_s: float) -> PolicyRun:
    result = simulate(config)
    return PolicyRun(
        policy=config.routing.policy.value,
        metrics=measure(result, measure_from_s, config.duration_s),
        resident_bytes_mean=float(result.resident_bytes.mean()),
        routed_template_bytes_mean=float(result.routed_template_bytes.mean()),
    )


def _run_policies(
    profile: FleetProfile, workload: Workload, fleet: Fleet, k: int, duration_s: float,
    seed: int, measure_from_s: float, policies: tuple[Routing, ...],
) -> tuple[PolicyRun, ...]:
    """The same workload and fleet under each routing policy, one run apiece."""
    return tuple(
        _run_policy(
            SimConfig(profile, workload, fleet, RoutingPolicy(policy, k), duration_s, seed),
            measure_from_s,
        )
        for policy in policies
    )


@dataclass(frozen=True, slots=True)
class CoverageReport:
    figures: FleetFigures
    home_slice: HomeSlice
    runs: tuple[PolicyRun, ...]
    duration_s: float
    measure_from_s: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def coverage(
    profile: FleetProfile,
    seed: int,
    *,
    workload: Workload | None = None,
    fleet: Fleet | None = None,
    k: int = 3,
    duration_s: float = 1800.0,
    measure_from_s: float = 900.0,
    policies: tuple[Routing, ...] = (Routing.RANDOM, Routing.LEAST_LOADED, Routing.AFFINITY),
) -> CoverageReport:
    """Every request reuses a template and is stored on first sight, so the template hit rate is
    the share of the working set the routing lets one replica's cache cover."""
    workload = workload or Workload(reuse_fraction=1.0)
    fleet = fleet or Fleet(admit_after=1)
    runs = _run_policies(
        profile, workload, fleet, k, duration_s, seed, measure_from_s, policies
    )
    return CoverageReport(
        figures=_figures(profile, workload, fleet, k),
        home_slice=home_slice(workload, fleet, k, profile),
        runs=runs,
        duration_s=duration_s,
        measure_from_s=measure_from_s,
        seed=seed,
    )


@dataclass(frozen=True, slots=True)
class SavingsReport:
    figures: FleetFigures
    design_replica_tokens_per_s: float
    random_sighting_interval_s: float
    """Under random routing, how often one replica sees a given template."""
    admit_min_sightings: int
    """The sighting a replica's cache stores a prefix on (the shipped admission by default)."""
    runs: tuple[PolicyRun, ...]
    duration_s: float
    measure_from_s: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DESIGN_REPLICA_TOKENS_PER_S = 28_000.0  # docs/design.md §1's figure, printed beside the profile's


def savings(
    profile: FleetProfile,
    seed: int,
    *,
    workload: Workload | None = None,
    fleet: Fleet | None = None,
    k: int = 3,
    duration_s: float = 1800.0,
    measure_from_s: float = 900.0,
    policies: tuple[Routing, ...] = (Routing.AFFINITY, Routing.RANDOM),
) -> SavingsReport:
    """60% of requests reuse a template, the rest carry one-shot prefixes; the shipped admission
    decides what is stored. The prefill saved comes out of the run."""
    workload = workload or Workload(reuse_fraction=PLANNED_HIT_RATE)
    fleet = fleet or Fleet()
    runs = _run_policies(
        profile, workload, fleet, k, duration_s, seed, measure_from_s, policies
    )
    num_templates = workload.num_tenants * workload.templates_per_tenant
    return SavingsReport(
        figures=_figures(profile, workload, fleet, k),
        design_replica_tokens_per_s=DESIGN_REPLICA_TOKENS_PER_S,
        random_sighting_interval_s=num_templates
        * fleet.num_replicas
        / (workload.rps * workload.reuse_fraction),
        admit_min_sightings=admission_sightings(fleet.admit_after),
        runs=runs,
        duration_s=duration_s,
        measure_from_s=measure_from_s,
        seed=seed,
    )


@dataclass(frozen=True, slots=True)
class RolloutRun:
    name: str
    description: str
    baseline: Metrics
    during: Metrics
    """From the rollout's start to the end of the run."""
    windows: tuple[Window, ...]
    events: tuple[RolloutEvent, ...]
    peak_ttft_p99_s: float
    breach_s: float
    """Time the windowed TTFT p99 spent above the SLO."""
    requests_over_slo: float
    """Share of the requests from the rollout on whose TTFT exceeded the SLO."""
    peak_extra_replicas: float
    """Peak prefill run, in replica-equivalents, above the pre-rollout level: the capacity dip."""
    completed_s: float | None
    """When the last step's gate passed (None: not within the run, or rolled back)."""
    surge_replica_s: float


@dataclass(frozen=True, slots=True)
class RolloutReport:
    figures: FleetFigures
    prefill_share: float
    fleet_prefill_tokens_per_s: float
    warm_utilization: float
    surge_factor: float
    ttft_slo_s: float
    rollout_at_s: float
    window_s: float
    runs: tuple[RolloutRun, ...]
    duration_s: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sized_prefill_share(
    profile: FleetProfile,
    workload: Workload,
    num_replicas: int,
    warm_utilization: float,
    k: int = 3,
) -> float:
    """The prefill share of a fleet provisioned for its warm cache: at the planned hit rate, the
    busiest replica (the one that is first home to the most tenants) runs its prefill at
    `warm_utilization`. Such a fleet is what a rollout puts to the test."""
    names = [replica_name(i) for i in range(num_replicas)]
    sets = home_sets([tenant_name(t) for t in range(workload.num_tenants)], names, k)
    first_homes = Counter(homes[0] for homes in sets.values())
    busiest_share = max(first_homes.values()) / workload.num_tenants
    warm_tokens = workload.suffix_tokens + (1 - PLANNED_HIT_RATE) * workload.prefix_tokens
    demand_replicas = workload.rps * busiest_share * warm_tokens * profile.recompute_s_per_token
    return min(1.0, demand_replicas / warm_utilization)


def sized_surge_factor(workload: Workload) -> float:
    """Prefill capacity a switching replica needs to stay at its warm utilization while its cache
    is cold: cold demand / warm demand at the planned hit rate (2.29 for the design's case)."""
    cold = workload.suffix_tokens + workload.prefix_tokens
    warm = workload.suffix_tokens + (1 - PLANNED_HIT_RATE) * workload.prefix_tokens
    return cold / warm


def rollout(
    profile: FleetProfile,
    seed: int,
    *,
    workload: Workload | None = None,
    num_replicas: int = 44,
    k: int = 3,
    warm_utilization: float = DEFAULT_WARM_UTILIZATION,
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S,
    surge_factor: float | None = None,
    rollout_at_s: float = 300.0,
    duration_s: float = 3600.0,
    window_s: float = 30.0,
) -> RolloutReport:
    """A weights rollout on a fleet sized for its warm cache: all at once, staged, staged with
    surge capacity."""
    if not 0 < warm_utilization <= 1:
        raise ValueError(f"warm utilization must be in (0, 1], got {warm_utilization!r}")
    if not rollout_at_s < duration_s:
        raise ValueError(
            f"the rollout at {rollout_at_s} s must start before the end, {duration_s} s"
        )
    workload = workload or Workload(reuse_fraction=PLANNED_HIT_RATE)
    share = sized_prefill_share(profile, workload, num_replicas, warm_utilization, k)
    if surge_factor is None:
        surge_factor = sized_surge_factor(workload)
    fleet = Fleet(num_replicas=num_replicas, prefill_share=share)
    plans = (
        ("all at once", "every replica switches at once, no extra capacity", Rollout(rollout_at_s)),
        (
            "staged",
            "canary -> 10% -> 50% -> 100%, each step gated on hit-rate recovery",
            Rollout(rollout_at_s, STAGED_STEPS),
        ),
        (
            "staged + surge",
            f"staged, and {surge_factor:.2f}x prefill capacity for switching replicas "
            "until their step's gate passes",
            Rollout(rollout_at_s, STAGED_STEPS, surge_factor=surge_factor),
        ),
    )
    runs = []
    for name, description, spec in plans:
        config = SimConfig(
            profile,
            workload,
            fleet,
            RoutingPolicy(Routing.AFFINITY, k),
            duration_s,
            seed,
            warm_start=True,
            rollout=spec,
        )
        runs.append(_rollout_run(name, description, simulate(config), ttft_slo_s, window_s))
    return RolloutReport(
        figures=_figures(profile, workload, fleet, k),
        prefill_share=share,
        fleet_prefill_tokens_per_s=num_replicas * share * profile.prefill_tokens_per_s,
        warm_utilization=warm_utilization,
        surge_factor=surge_factor,
        ttft_slo_s=ttft_slo_s,
        rollout_at_s=rollout_at_s,
        window_s=window_s,
        runs=tuple(runs),
        duration_s=duration_s,
        seed=seed,
    )


def _rollout_run(
    name: str, description: str, result: SimResult, ttft_slo_s: float, window_s: float
) -> RolloutRun:
    spec = result.config.rollout
    assert spec is not None
    at_s, end_s = spec.at_s, result.config.duration_s
    windows = time_series(result, window_s)
    baseline = measure(result, max(0.0, at_s - 300.0), at_s)
    after = [w for w in windows if w.start_s >= at_s]
    sel = result.arrival_s >= at_s
    gates = [e for e in result.rollout_events if e.kind == "gate"]
    # Done when the gate of the last step passed (a rollback leaves it None).
    completed = gates[-1].time_s if len(gates) == len(spec.steps) else None
    return RolloutRun(
        name=name,
        description=description,
        baseline=baseline,
        during=measure(result, at_s, end_s),
        windows=tuple(windows),
        events=tuple(result.rollout_events),
        peak_ttft_p99_s=max((w.ttft_p99_s for w in after), default=0.0),
        breach_s=sum(window_s for w in after if w.ttft_p99_s > ttft_slo_s),
        requests_over_slo=float((result.ttft_s[sel] > ttft_slo_s).mean()) if sel.any() else 0.0,
        peak_extra_replicas=max((w.computed_replicas for w in after), default=0.0)
        - baseline.computed_replicas,
        completed_s=completed,
        surge_replica_s=result.surge_replica_s,
    )


@dataclass(frozen=True, slots=True)
class WhatIfRun:
    name: str
    description: str
    profile: FleetProfile
    num_replicas: int
    routing: str
    cache_bytes: int
    nvme: bool
    figures: FleetFigures
    home_slice_max_bytes: float
    metrics: Metrics


@dataclass(frozen=True, slots=True)
class SharedFetch:
    """R6 replayed on the simulator's shared link: n fetches start together on one medium."""

    medium_bytes_per_s: float
    num_concurrent: int
    prefix_bytes: int
    each_s: float
    effective_bytes_per_s: float
    closed_form_bytes_per_s: float
    break_even_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class WhatIfReport:
    runs: tuple[WhatIfRun, ...]
    shared_fetch: SharedFetch
    duration_s: float
    measure_from_s: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    description: str
    profile: FleetProfile
    num_replicas: int = 44
    routing: Routing = Routing.AFFINITY
    cache_bytes: int = Fleet().cache_bytes
    nvme_bytes: int = 0


def default_variants(base: FleetProfile, num_replicas: int = 44) -> tuple[Variant, ...]:
    """The design's levers (FP8 KV, twice the TP on the same GPUs, an MLA latent) and the NVMe
    tier on and off behind a DRAM too small for the home slice; a lever the base already pulls
    (or cannot pull) is left out."""
    ref = MODELS[base.model]
    nvme = 8 * TiB  # a host's NVMe: holds every replica's share of the working set
    variants = [Variant("baseline", f"{base.name}, {num_replicas} replicas", base, num_replicas)]
    if base.kv_dtype != KVDtype.FP8.value:
        variants.append(
            Variant(
                "fp8-kv",
                "KV stored in FP8: half the bytes per token",
                fleet_profile(ref, KVDtype.FP8, base.gpu, base.tp_degree),
                num_replicas,
            )
        )
    doubled = base.tp_degree * 2
    if (ref.mla is not None or ref.num_kv_heads % doubled == 0) and num_replicas % 2 == 0:
        variants.append(
            Variant(
                f"tp{doubled}",
                f"TP{doubled} on the same GPUs: {num_replicas // 2} replicas, twice as fast",
                fleet_profile(ref, base.kv_dtype, base.gpu, doubled),
                num_replicas // 2,
            )
        )
    if ref.mla is None:
        mla_model = replace(ref, name=f"{ref.name}+mla", mla=REFERENCE_MLA)
        variants.append(
            Variant(
                "mla",
                "the same model with an MLA latent of 512+64 per layer instead of GQA K and V",
                fleet_profile(mla_model, base.kv_dtype, base.gpu, base.tp_degree),
                num_replicas,
            )
        )
    variants += [
        Variant(
            "small dram, nvme off",
            f"{format_gib(SMALL_DRAM_BYTES)} of DRAM per replica (the reference slice overflows)",
            base,
            num_replicas,
            cache_bytes=SMALL_DRAM_BYTES,
        ),
        Variant(
            "small dram, nvme on",
            f"the same, with {format_gib(nvme)} of NVMe behind DRAM on every replica",
            base,
            num_replicas,
            cache_bytes=SMALL_DRAM_BYTES,
            nvme_bytes=nvme,
        ),
    ]
    return tuple(variants)


def what_if(
    profile: FleetProfile,
    seed: int,
    *,
    variants: tuple[Variant, ...] | None = None,
    workload: Workload | None = None,
    num_replicas: int = 44,
    k: int = 3,
    duration_s: float = 1800.0,
    measure_from_s: float = 900.0,
    num_concurrent_fetches: int = 8,
) -> WhatIfReport:
    workload = workload or Workload(reuse_fraction=PLANNED_HIT_RATE)
    runs = []
    for v in variants or default_variants(profile, num_replicas):
        fleet = Fleet(
            num_replicas=v.num_replicas, cache_bytes=v.cache_bytes, nvme_bytes=v.nvme_bytes
        )
        config = SimConfig(
            v.profile, workload, fleet, RoutingPolicy(v.routing, k), duration_s, seed
        )
        result = simulate(config)
        runs.append(
            WhatIfRun(
                name=v.name,
                description=v.description,
                profile=v.profile,
                num_replicas=v.num_replicas,
                routing=v.routing.value,
                cache_bytes=v.cache_bytes,
                nvme=v.nvme_bytes > 0,
                figures=_figures(v.profile, workload, fleet, k),
                home_slice_max_bytes=home_slice(workload, fleet, k, v.profile).max_bytes,
                metrics=measure(result, measure_from_s, duration_s),
            )
        )
    return WhatIfReport(
        runs=tuple(runs),
        shared_fetch=shared_fetch(profile, workload.prefix_tokens, num_concurrent_fetches),
        duration_s=duration_s,
        measure_from_s=measure_from_s,
        seed=seed,
    )


def shared_fetch(profile: FleetProfile, prefix_tokens: int, num_concurrent: int) -> SharedFetch:
    if num_concurrent < 1:
        raise ValueError(f"concurrent fetches must be >= 1, got {num_concurrent!r}")
    prefix_bytes = prefix_tokens * profile.kv_bytes_per_token
    link = SharedLink(profile.nvme_bytes_per_s)
    for fetch_id in range(num_concurrent):
        link.start(0.0, fetch_id, prefix_bytes)
    done_s = link.next_done_s()
    assert done_s is not None
    finished = link.finish(done_s)
    assert len(finished) == num_concurrent
    return SharedFetch(
        medium_bytes_per_s=profile.nvme_bytes_per_s,
        num_concurrent=num_concurrent,
        prefix_bytes=prefix_bytes,
        each_s=done_s,
        effective_bytes_per_s=prefix_bytes / done_s,
        closed_form_bytes_per_s=shared_fetch_bytes_per_s(profile.nvme_bytes_per_s, num_concurrent),
        break_even_bytes_per_s=profile.break_even_bytes_per_s,
    )
