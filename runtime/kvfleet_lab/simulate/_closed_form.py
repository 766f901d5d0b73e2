"""The design's fleet figures (docs/design.md §1, R2, R6) as closed-form arithmetic, printed
beside what the simulation measures."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_lab.simulate._profile import FleetProfile


@dataclass(frozen=True, slots=True)
class FleetFigures:
    kv_bytes_per_token: int
    prefix_bytes: int
    working_set_bytes: int
    host_coverage: float
    """Share of the working set one replica's cache holds: its hit-rate bound under random
    routing."""
    tenants_per_replica: float
    """k x tenants / replicas: tenants that have a replica among their k homes."""
    home_slice_bytes: float
    home_slice_fits: bool
    saved_tokens_per_s: float
    replica_tokens_per_s: float
    replicas_saved: float


def fleet_figures(
    profile: FleetProfile,
    *,
    num_tenants: int,
    templates_per_tenant: int,
    prefix_tokens: int,
    num_replicas: int,
    k: int,
    cache_bytes: int,
    rps: float,
    hit_rate: float,
) -> FleetFigures:
    prefix_bytes = prefix_tokens * profile.kv_bytes_per_token
    working_set = num_tenants * templates_per_tenant * prefix_bytes
    tenants_per_replica = min(k, num_replicas) * num_tenants / num_replicas
    home_slice = tenants_per_replica * templates_per_tenant * prefix_bytes
    saved = rps * hit_rate * prefix_tokens
    return FleetFigures(
        kv_bytes_per_token=profile.kv_bytes_per_token,
        prefix_bytes=prefix_bytes,
        working_set_bytes=working_set,
        host_coverage=min(1.0, cache_bytes / working_set),
        tenants_per_replica=tenants_per_replica,
        home_slice_bytes=home_slice,
        home_slice_fits=home_slice <= cache_bytes,
        saved_tokens_per_s=saved,
        replica_tokens_per_s=profile.prefill_tokens_per_s,
        replicas_saved=saved / profile.prefill_tokens_per_s,
    )


def shared_fetch_bytes_per_s(bandwidth_bytes_per_s: float, num_concurrent: int) -> float:
    """R6: a medium shared by n concurrent fetches gives each 1/n of its bandwidth."""
    return bandwidth_bytes_per_s / num_concurrent
