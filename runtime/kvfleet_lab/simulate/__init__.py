"""`kvfleet simulate`: a discrete-event simulation of a cache-aware fleet at the design's scale.

Requests arrive (Poisson), are routed (random, least loaded, or rendezvous affinity with an
occupancy threshold and spill), find their prefix in a replica's host-DRAM cache (LRU, optional
NVMe tier) or recompute it, queue for prefill, and their TTFT is measured. Bandwidths and
per-token recompute time come from the break-even profiles (`kvfleet_runtime.breakeven`).
Pure: a run is a function of its config and seed; no wall clock, no I/O, no torch.
"""

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
from kvfleet_lab.simulate._engine import RolloutEvent, SimResult, simulate
from kvfleet_lab.simulate._link import SharedLink
from kvfleet_lab.simulate._metrics import Metrics, Window, measure, time_series
from kvfleet_lab.simulate._profile import FleetProfile, fleet_profile
from kvfleet_lab.simulate._scenarios import (
    DEFAULT_TTFT_SLO_S,
    DEFAULT_WARM_UTILIZATION,
    DESIGN_REPLICA_TOKENS_PER_S,
    PLANNED_HIT_RATE,
    STAGED_STEPS,
    CoverageReport,
    HomeSlice,
    PolicyRun,
    RolloutReport,
    RolloutRun,
    SavingsReport,
    SharedFetch,
    Variant,
    WhatIfReport,
    WhatIfRun,
    coverage,
    default_variants,
    home_slice,
    rollout,
    savings,
    shared_fetch,
    sized_prefill_share,
    sized_surge_factor,
    what_if,
)

__all__ = [
    "DEFAULT_TTFT_SLO_S",
    "DEFAULT_WARM_UTILIZATION",
    "DESIGN_REPLICA_TOKENS_PER_S",
    "PLANNED_HIT_RATE",
    "STAGED_STEPS",
    "CoverageReport",
    "Fleet",
    "FleetFigures",
    "FleetProfile",
    "GiB",
    "HomeSlice",
    "Metrics",
    "PolicyRun",
    "Rollout",
    "RolloutEvent",
    "RolloutReport",
    "RolloutRun",
    "Routing",
    "RoutingPolicy",
    "SavingsReport",
    "SharedFetch",
    "SharedLink",
    "SimConfig",
    "SimResult",
    "TiB",
    "Variant",
    "WhatIfReport",
    "WhatIfRun",
    "Window",
    "Workload",
    "coverage",
    "default_variants",
    "fleet_figures",
    "fleet_profile",
    "home_slice",
    "measure",
    "rollout",
    "savings",
    "shared_fetch",
    "shared_fetch_bytes_per_s",
    "simulate",
    "sized_prefill_share",
    "sized_surge_factor",
    "time_series",
    "what_if",
]
