"""The tier decision: which cache tiers a fleet turns on, and why (docs/design.md §1, R1, R6).

A tier in `Auto` mode is on when the break-even plan says *build* for the fleet's model and
hardware: fetching the prefix's KV from that medium is faster than recomputing it, i.e. the medium's
bandwidth beats the break-even bandwidth. The bandwidth is the medium's profile unless a measured
one is known (the spec's `measuredBandwidthGBps`, else a shadow-mode measurement the replicas
report), and a measurement always wins over a profile. A batch fleet also builds tiers that only
help capacity. The reason is recorded for every tier, e.g.
"break-even 9.26 GB/s vs measured 6.1 GB/s: off".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet_operator.api import FleetKind, KVCachePolicySpec, TierMode, TierSpec
from kvfleet_runtime.breakeven import (
    GB,
    GPUS,
    MODELS,
    BreakEvenPlan,
    GpuProfile,
    KVDtype,
    Verdict,
    judge_tier,
    lookup_profile,
    medium_for,
    plan,
)
from kvfleet_runtime.config.fleet import TierToggles

__all__ = [
    "TIERS",
    "NvmeMeasurement",
    "TierDecision",
    "TierPlan",
    "aggregate_nvme",
    "decide_tiers",
    "format_gbps",
]

# (spec field, FleetConfig toggle, default medium)
TIERS = (
    ("device", "t0_device", "hbm"),
    ("host", "t1_host", "dram-pcie5"),
    ("peer", "t2_peer", "rdma-200g"),
    ("nvme", "nvme", "nvme-gen4"),
)


@dataclass(frozen=True, slots=True)
class TierDecision:
    tier: str
    medium: str
    enabled: bool
    reason: str
    profile_bytes_per_s: float | None = None
    measured_bytes_per_s: float | None = None
    measurement: str = ""


@dataclass(frozen=True, slots=True)
class NvmeMeasurement:
    """The fleet's shadow-mode T3 reads, aggregated (R6)."""

    bytes_per_s: float
    """Per-read bandwidth at the p95 concurrency level: what one request's fetch achieved when
    the fleet was as busy as it is 5% of the time (the figure a fetch's latency depends on)."""
    p95_concurrency: int
    num_reads: int
    num_replicas: int

    @property
    def source(self) -> str:
        return (
            f"shadow: {self.num_replicas} replica(s), {self.num_reads} reads, per-read "
            f"bandwidth at p95 concurrency {self.p95_concurrency}"
        )


def aggregate_nvme(
    reports: Sequence[Mapping[str, Any]], min_reads: int = 1
) -> NvmeMeasurement | None:
    """Aggregate the replicas' `nvme.read_bandwidth` load-report sections ({level: {num_reads,
    num_bytes, seconds}}) into the fleet's figure at p95 concurrency: the lowest level at or
    below which 95% of the fleet's reads ran. None with fewer than `min_reads` reads. Sections
    that do not parse are skipped (a replica of another version must not block the decision)."""
    reads: dict[int, int] = {}
    num_bytes: dict[int, int] = {}
    seconds: dict[int, float] = {}
    replicas = 0
    for report in reports:
        try:
            levels = {
                int(level): (int(v["num_reads"]), int(v["num_bytes"]), float(v["seconds"]))
                for level, v in dict(report).items()
            }
        except (KeyError, TypeError, ValueError):
            continue
        if not levels:
            continue
        replicas += 1
        for level, (n, b, sec) in levels.items():
            if level < 1 or n < 0 or b < 0 or not sec >= 0:
                continue
            reads[level] = reads.get(level, 0) + n
            num_bytes[level] = num_bytes.get(level, 0) + b
            seconds[level] = seconds.get(level, 0.0) + sec
    total = sum(reads.values())
    if total < max(min_reads, 1):
        return None
    cumulative = 0
    p95 = max(reads)
    for level in sorted(reads):
        cumulative += reads[level]
        if cumulative >= 0.95 * total:
            p95 = level
            break
    if seconds.get(p95, 0.0) <= 0:
        return None
    return NvmeMeasurement(num_bytes[p95] / seconds[p95], p95, total, replicas)


@dataclass(frozen=True, slots=True)
class TierPlan:
    toggles: TierToggles
    decisions: tuple[TierDecision, ...]
    break_even_bytes_per_s: float
    recompute_s_per_token: float

    @property
    def summary(self) -> str:
        """The enabled tiers, e.g. "device,host,peer" ("none" when all are off)."""
        return ",".join(d.tier for d in self.decisions if d.enabled) or "none"


@dataclass(frozen=True, slots=True)
class _Context:
    plan: BreakEvenPlan
    gpu: GpuProfile


def format_gbps(bytes_per_s: float) -> str:
    value = bytes_per_s / GB
    return f"{value:,.0f} GB/s" if value >= 100 else f"{value:.3g} GB/s"


def _decide(
    name: str,
    tier: TierSpec,
    default_medium: str,
    fleet: FleetKind,
    measured_bytes_per_s: float | None,
    measurement: str,
    ctx: _Context,
) -> TierDecision:
    medium_name = tier.medium or default_medium
    if tier.mode is TierMode.ENABLED:
        return TierDecision(name, medium_name, True, "Enabled by spec")
    if tier.mode is TierMode.DISABLED:
        return TierDecision(name, medium_name, False, "Disabled by spec")
    medium = medium_for(medium_name, ctx.gpu, measured_bytes_per_s)
    threshold = ctx.plan.break_even_bytes_per_s
    verdict = judge_tier(
        medium,
        ctx.plan.prefix_kv_bytes,
        ctx.plan.recompute_prefix_s,
        ctx.plan.tp_degree,
        threshold,
        ctx.plan.batch_slack,
    )
    source = "measured" if measured_bytes_per_s is not None else f"{medium_name} profile"
    on = verdict.verdict is Verdict.BUILD or (
        verdict.verdict is Verdict.BATCH_ONLY and fleet is FleetKind.BATCH
    )
    detail = ""
    if verdict.verdict is Verdict.BATCH_ONLY:
        detail = " (capacity only: batch fleet)" if on else " (capacity only: not for interactive)"
    reason = (
        f"break-even {format_gbps(threshold)} vs {source} "
        f"{format_gbps(medium.bandwidth_bytes_per_s)}: {'on' if on else 'off'}{detail}"
    )
    profile = medium_for(medium_name, ctx.gpu).bandwidth_bytes_per_s
    return TierDecision(
        name, medium_name, on, reason, profile, measured_bytes_per_s,
        measurement if measured_bytes_per_s is not None else "",
    )


def decide_tiers(
    spec: KVCachePolicySpec,
    measured_bytes_per_s: Mapping[str, float] | None = None,
    measurement: Mapping[str, str] | None = None,
) -> TierPlan:
    """Decide every tier of a policy. `measured_bytes_per_s` maps a tier name ("nvme") to a
    bandwidth measured in the fleet (shadow mode), `measurement` to where it comes from; the
    spec's own measurement takes precedence.
    Raises ValueError for a model/hardware combination the arithmetic refuses (e.g. a TP degree
    that does not divide the KV heads)."""
    model = lookup_profile("model", MODELS, spec.model.profile)
    gpu = lookup_profile("GPU", GPUS, spec.model.gpu)
    kv_dtype = KVDtype.parse(spec.model.kv_dtype)
    base = plan(
        model,
        kv_dtype,
        gpu,
        spec.model.tp_degree,
        spec.model.prefix_tokens,
        media=(),
        with_levers=False,
    )
    ctx = _Context(base, gpu)
    observed = dict(measured_bytes_per_s or {})
    decisions = []
    toggles: dict[str, bool] = {}
    for name, toggle, default_medium in TIERS:
        tier: TierSpec = getattr(spec.tiers, name)
        measured: float | None
        if tier.measured_bandwidth_g_bps is not None:
            measured, source = tier.measured_bandwidth_g_bps * GB, "spec"
        else:
            measured, source = observed.get(name), (measurement or {}).get(name, "fleet")
        decision = _decide(name, tier, default_medium, spec.fleet, measured, source, ctx)
        decisions.append(decision)
        toggles[toggle] = decision.enabled
    return TierPlan(
        toggles=TierToggles(**toggles, nvme_shadow=spec.tiers.nvme.shadow),
        decisions=tuple(decisions),
        break_even_bytes_per_s=base.break_even_bytes_per_s,
        recompute_s_per_token=base.recompute_s_per_token,
    )
