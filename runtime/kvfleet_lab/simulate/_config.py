"""What one simulation run is given: workload, fleet, routing policy, an optional rollout."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvfleet_lab.simulate._profile import FleetProfile

GiB = 1024**3
TiB = 1024**4


class Routing(Enum):
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"
    AFFINITY = "affinity"

    @classmethod
    def parse(cls, name: str) -> Routing:
        try:
            return cls(name.strip().lower())
        except ValueError:
            choices = ", ".join(r.value for r in cls)
            raise ValueError(f"unknown routing policy {name!r}; choose one of: {choices}") from None


@dataclass(frozen=True, slots=True)
class Workload:
    """Poisson arrivals. A request carries a prefix (one of its tenant's templates with
    probability `reuse_fraction`, else a one-shot prefix of the same length seen only once)
    followed by `suffix_tokens` that are always prefilled (the user's turn)."""

    rps: float = 83.0
    num_tenants: int = 2000
    templates_per_tenant: int = 5
    prefix_tokens: int = 1500
    suffix_tokens: int = 100
    reuse_fraction: float = 1.0
    decode_s: float = 10.0
    """How long a request keeps its KV in HBM after its first token (its decode)."""
    tenant_zipf_s: float = 0.0
    """Tenant popularity ~ 1 / rank^s; 0 is uniform, which the design's figures assume."""

    def __post_init__(self) -> None:
        _positive("rps", self.rps)
        _positive("num_tenants", self.num_tenants)
        _positive("templates_per_tenant", self.templates_per_tenant)
        _positive("prefix_tokens", self.prefix_tokens)
        _non_negative("suffix_tokens", self.suffix_tokens)
        _non_negative("decode_s", self.decode_s)
        _non_negative("tenant_zipf_s", self.tenant_zipf_s)
        if not 0.0 <= self.reuse_fraction <= 1.0:
            raise ValueError(f"reuse_fraction must be in [0, 1], got {self.reuse_fraction!r}")


@dataclass(frozen=True, slots=True)
class Fleet:
    num_replicas: int = 44
    cache_bytes: int = 500 * GiB
    """T1 host DRAM cache of each replica (docs/design.md §1: a 500 GiB host)."""
    hbm_kv_bytes: int = 172 * GiB
    """HBM a replica has for in-flight requests' KV (~172 GiB); occupancy's denominator."""
    prefill_share: float = 1.0
    """Fraction of a replica's GPU time its scheduler gives to prefill; decode has the rest. A
    prefill runs at full speed, then the GPU owes decode the time in proportion, so the share
    limits prefill throughput without stretching a lone prefill."""
    admit_after: int | None = None
    """Store a prefix from its n-th sighting at the replica; None: the shipped cache's own
    admission (`CacheTuning.admit_min_sightings`)."""
    nvme_bytes: int = 0
    """T3 local NVMe behind DRAM (DRAM evictions are demoted there); 0 switches the tier off."""

    def __post_init__(self) -> None:
        _positive("num_replicas", self.num_replicas)
        _positive("cache_bytes", self.cache_bytes)
        _positive("hbm_kv_bytes", self.hbm_kv_bytes)
        if self.admit_after is not None:
            _positive("admit_after", self.admit_after)
        _non_negative("nvme_bytes", self.nvme_bytes)
        if not 0.0 < self.prefill_share <= 1.0:
            raise ValueError(f"prefill_share must be in (0, 1], got {self.prefill_share!r}")


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    policy: Routing = Routing.AFFINITY
    k: int = 3
    occupancy_threshold: float = 0.85

    def __post_init__(self) -> None:
        _positive("k", self.k)
        if not 0.0 < self.occupancy_threshold <= 1.0:
            raise ValueError(
                f"occupancy_threshold must be in (0, 1], got {self.occupancy_threshold!r}"
            )


@dataclass(frozen=True, slots=True)
class Rollout:
    """A weights change. Replicas switch in index order; each step's cumulative fraction of the
    fleet (at least one replica: the first step is the canary) switches at once and the next
    step waits until the new version's hit rate has recovered."""

    at_s: float
    steps: tuple[float, ...] = (1.0,)
    surge_factor: float = 1.0
    """Prefill capacity of a switching replica while its step is open, relative to normal (2.0:
    one surge pod per switching replica shares its prefill)."""
    min_dwell_s: float = 120.0
    gate_hit_ratio: float = 0.9
    """A step closes when the new version's hit rate is >= this x the pre-rollout hit rate."""
    gate_window_s: float = 60.0
    rollback_after_s: float = 1800.0

    def __post_init__(self) -> None:
        _non_negative("at_s", self.at_s)
        if not self.steps or any(not 0 < f <= 1 for f in self.steps):
            raise ValueError(f"rollout steps must be fractions in (0, 1], got {self.steps!r}")
        if list(self.steps) != sorted(self.steps) or self.steps[-1] != 1.0:
            raise ValueError(f"rollout steps must rise to 1.0, got {self.steps!r}")
        if self.surge_factor < 1.0:
            raise ValueError(f"surge_factor must be >= 1, got {self.surge_factor!r}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: FleetProfile
    workload: Workload
    fleet: Fleet
    routing: RoutingPolicy
    duration_s: float
    seed: int
    warm_start: bool = False
    """Start with every template resident at its tenant's first home (affinity's steady state)."""
    rollout: Rollout | None = None
    control_interval_s: float = 10.0

    def __post_init__(self) -> None:
        _positive("duration_s", self.duration_s)
        _positive("control_interval_s", self.control_interval_s)
        if self.warm_start and self.routing.policy is not Routing.AFFINITY:
            raise ValueError("warm_start needs affinity routing: other policies have no home")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
