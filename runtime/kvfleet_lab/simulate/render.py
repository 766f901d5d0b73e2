"""`kvfleet simulate`'s scenarios and their tables: what the command runs and prints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from kvfleet_lab.simulate import (
    PLANNED_HIT_RATE,
    CoverageReport,
    Fleet,
    FleetProfile,
    RolloutReport,
    SavingsReport,
    WhatIfReport,
    Workload,
    coverage,
    rollout,
    savings,
    what_if,
)
from kvfleet_runtime.breakeven import GB
from kvfleet_runtime.units import format_bytes_binary

__all__ = ["SCENARIOS", "Report", "render", "run_scenarios"]

SCENARIOS = ("coverage", "savings", "rollout", "what-if", "all")
Report = CoverageReport | SavingsReport | RolloutReport | WhatIfReport


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f} ms"


def _s(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds < 100 else f"{seconds:,.0f} s"


def run_scenarios(
    name: str,
    profile: FleetProfile,
    seed: int,
    num_replicas: int,
    rps: float,
    num_tenants: int,
    duration_s: float | None,
    ttft_slo_s: float,
    warm_utilization: float,
) -> dict[str, Report]:
    # Half of each run warms the caches; the other half is measured.
    total_s = duration_s or 1800.0

    fleet = Fleet(num_replicas=num_replicas)
    reports: dict[str, Report] = {}
    if name in {"coverage", "all"}:
        reports["coverage"] = coverage(
            profile,
            seed,
            workload=Workload(rps=rps, num_tenants=num_tenants, reuse_fraction=1.0),
            fleet=Fleet(num_replicas=num_replicas, admit_after=1),
            duration_s=total_s,
            measure_from_s=total_s / 2,
        )
    if name in {"savings", "all"}:
        reports["savings"] = savings(
            profile,
            seed,
            workload=Workload(rps=rps, num_tenants=num_tenants, reuse_fraction=PLANNED_HIT_RATE),
            fleet=fleet,
            duration_s=total_s,
            measure_from_s=total_s / 2,
        )
    if name in {"rollout", "all"}:
        reports["rollout"] = rollout(
            profile,
            seed,
            workload=Workload(rps=rps, num_tenants=num_tenants, reuse_fraction=PLANNED_HIT_RATE),
            num_replicas=num_replicas,
            warm_utilization=warm_utilization,
            ttft_slo_s=ttft_slo_s,
            duration_s=duration_s or 3600.0,
        )
    if name in {"what-if", "all"}:
        reports["what-if"] = what_if(
            profile,
            seed,
            workload=Workload(rps=rps, num_tenants=num_tenants, reuse_fraction=PLANNED_HIT_RATE),
            num_replicas=num_replicas,
            duration_s=total_s,
            measure_from_s=total_s / 2,
        )
    return reports


def _figure_table(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("simulated", justify="right")
    table.add_column("closed form", justify="right")
    table.add_column("design", justify="right")
    return table


def render_coverage(report: CoverageReport, console: Console) -> None:
    f, h = report.figures, report.home_slice
    runs = {run.policy: run for run in report.runs}
    console.print(
        f"[bold]coverage[/] · working set {format_bytes_binary(f.working_set_bytes)} "
        f"({format_bytes_binary(f.prefix_bytes)} per template) · seed {report.seed} · "
        f"measured over {report.measure_from_s:g}-{report.duration_s:g} s"
    )
    table = _figure_table("Working set and coverage per replica")
    table.add_row("working set", "-", format_bytes_binary(f.working_set_bytes), "4.47 TiB")
    if "random" in runs:
        table.add_row(
            "coverage, random routing",
            _pct(runs["random"].metrics.template_hit_rate),
            _pct(f.host_coverage),
            "~11%",
        )
    if "least-loaded" in runs:
        table.add_row(
            "coverage, least-loaded routing",
            _pct(runs["least-loaded"].metrics.template_hit_rate),
            _pct(f.host_coverage),
            "~11%",
        )
    table.add_row(
        "tenants with a replica among their k homes",
        f"{h.mean_tenants:.1f} (min {h.min_tenants}, max {h.max_tenants})",
        f"{f.tenants_per_replica:.1f}",
        "~136",
    )
    table.add_row(
        "working set of those tenants",
        f"{format_bytes_binary(h.mean_bytes)} (max {format_bytes_binary(h.max_bytes)})",
        format_bytes_binary(f.home_slice_bytes) + (" fits" if f.home_slice_fits else " > cache"),
        "~312 GiB, fits",
    )
    if "affinity" in runs:
        table.add_row(
            "coverage, rendezvous k=3 affinity",
            _pct(runs["affinity"].metrics.template_hit_rate),
            "100.0%" if f.home_slice_fits else _pct(f.host_coverage),
            "~100%",
        )
    console.print(table)
    _policy_table(report.runs, console)


def _policy_table(runs: tuple[Any, ...], console: Console) -> None:
    table = Table(title="Per routing policy", title_justify="left")
    for column in (
        "policy",
        "hit rate",
        "saved",
        "replicas saved",
        "TTFT p50",
        "TTFT p99",
        "spill",
        "DRAM resident",
        "fetch",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for run in runs:
        m = run.metrics
        table.add_row(
            run.policy,
            _pct(m.hit_rate),
            f"{m.saved_tokens_per_s:,.0f} tok/s",
            f"{m.replicas_saved:.2f}",
            _ms(m.ttft_p50_s),
            _ms(m.ttft_p99_s),
            _pct(m.spill_rate),
            format_bytes_binary(run.resident_bytes_mean),
            _ms(m.mean_fetch_s),
        )
    console.print(table)


def render_savings(report: SavingsReport, console: Console) -> None:
    f = report.figures
    runs = {run.policy: run for run in report.runs}
    console.print(
        f"[bold]savings[/] · {PLANNED_HIT_RATE:.0%} of requests reuse a template, the rest carry "
        f"one-shot prefixes; stored on second sighting · seed {report.seed}"
    )
    table = _figure_table("Prefill saved")
    design_replicas = 74_700 / report.design_replica_tokens_per_s
    if "affinity" in runs:
        m = runs["affinity"].metrics
        table.add_row("hit rate (affinity)", _pct(m.hit_rate), _pct(PLANNED_HIT_RATE), "60%")
        table.add_row(
            "prefill saved",
            f"{m.saved_tokens_per_s:,.0f} tok/s",
            f"{f.saved_tokens_per_s:,.0f} tok/s",
            "74,700 tok/s",
        )
        table.add_row(
            "one replica's prefill",
            f"{f.replica_tokens_per_s:,.0f} tok/s (profile)",
            f"{f.replica_tokens_per_s:,.0f} tok/s",
            f"{report.design_replica_tokens_per_s:,.0f} tok/s",
        )
        table.add_row(
            "replicas of compute saved",
            f"{m.replicas_saved:.2f}",
            f"{f.replicas_saved:.2f}",
            f"{design_replicas:.2f} (~2.7)",
        )
    if "random" in runs:
        m = runs["random"].metrics
        table.add_row(
            "hit rate, random routing",
            _pct(m.hit_rate),
            f"<= {_pct(PLANNED_HIT_RATE * f.host_coverage)}",
            "~11% of 60%",
        )
    console.print(table)
    if "random" in runs:
        console.print(
            "[dim]random routing stays under its bound: a replica sees a given template once "
            f"every ~{report.random_sighting_interval_s / 60:,.0f} min, "
            "so admission on the second sighting rarely stores it[/]"
        )
    _policy_table(report.runs, console)


def render_rollout(report: RolloutReport, console: Console) -> None:
    console.print(
        f"[bold]rollout[/] at {report.rollout_at_s:g} s · fleet sized for its warm cache: "
        f"busiest replica at {report.warm_utilization:.0%} prefill utilization, prefill share "
        f"{report.prefill_share:.1%} of GPU time = {report.fleet_prefill_tokens_per_s:,.0f} tok/s "
        f"fleet-wide · TTFT p99 objective {report.ttft_slo_s:g} s · seed {report.seed}"
    )
    table = Table(title="Weights rollout: the cache cold-starts", title_justify="left")
    for column in (
        "plan",
        "warm p99",
        "peak p99",
        "time over SLO",
        "requests over SLO",
        "capacity dip",
        "done at",
        "surge",
    ):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for run in report.runs:
        table.add_row(
            run.name,
            _s(run.baseline.ttft_p99_s),
            _s(run.peak_ttft_p99_s),
            f"{run.breach_s / 60:.1f} min",
            _pct(run.requests_over_slo),
            f"+{run.peak_extra_replicas:.2f} replicas",
            "-" if run.completed_s is None else f"{run.completed_s:,.0f} s",
            f"{run.surge_replica_s / 3600:.1f} replica-h",
        )
    console.print(table)
    console.print(
        f"[dim]capacity dip: peak prefill run above the warm level, in replica-equivalents "
        f"(closed form: the cache was absorbing {report.figures.replicas_saved:.2f}) · "
        f"surge: extra prefill capacity x time for switching replicas[/]"
    )
    for run in report.runs:
        steps = ", ".join(
            f"{e.kind} {e.num_new}@{e.time_s:,.0f}s" for e in run.events if e.kind != "gate"
        )
        console.print(f"[dim]{run.name}: {run.description}; steps: {steps}[/]")


def render_what_if(report: WhatIfReport, console: Console) -> None:
    sizes = Table(title="What-ifs: the fleet and its working set", title_justify="left")
    for column in (
        "variant",
        "replicas",
        "cache",
        "KV/token",
        "working set",
        "max home slice",
        "break-even",
    ):
        sizes.add_column(column, justify="left" if column == "variant" else "right")
    outcome = Table(
        title=f"What-ifs: measured ({PLANNED_HIT_RATE:.0%} template reuse, seed {report.seed})",
        title_justify="left",
    )
    for column in (
        "variant",
        "hit rate",
        "replicas saved",
        "TTFT p50",
        "TTFT p99",
        "fetch",
        "fetch BW",
        "from NVMe",
    ):
        outcome.add_column(column, justify="left" if column == "variant" else "right")
    for run in report.runs:
        m = run.metrics
        sizes.add_row(
            run.name,
            f"{run.num_replicas} x TP{run.profile.tp_degree}",
            format_bytes_binary(run.cache_bytes) + (" + NVMe" if run.nvme else ""),
            format_bytes_binary(run.profile.kv_bytes_per_token),
            format_bytes_binary(run.figures.working_set_bytes),
            format_bytes_binary(run.home_slice_max_bytes)
            + (" fits" if run.home_slice_max_bytes <= run.cache_bytes else " > DRAM"),
            f"{run.profile.break_even_bytes_per_s / GB:.2f} GB/s",
        )
        outcome.add_row(
            run.name,
            _pct(m.hit_rate),
            f"{m.replicas_saved:.2f}",
            _ms(m.ttft_p50_s),
            _ms(m.ttft_p99_s),
            _ms(m.mean_fetch_s),
            "-" if m.fetch_bytes_per_s is None else f"{m.fetch_bytes_per_s / GB:.1f} GB/s",
            "-"
            if m.nvme_fetch_bytes_per_s is None
            else f"{_pct(m.nvme_hit_rate)} at {m.nvme_fetch_bytes_per_s / GB:.1f} GB/s",
        )
    console.print(sizes)
    console.print(outcome)
    sf = report.shared_fetch
    console.print(
        f"R6 on the shared link: {sf.num_concurrent} concurrent fetches of "
        f"{format_bytes_binary(sf.prefix_bytes)} from NVMe at "
        f"{sf.medium_bytes_per_s / GB:g} GB/s each take {sf.each_s * 1e3:,.0f} ms: "
        f"[bold]{sf.effective_bytes_per_s / GB:.3f} GB/s[/] effective (closed form "
        f"{sf.closed_form_bytes_per_s / GB:.3f} GB/s) against a break-even of "
        f"{sf.break_even_bytes_per_s / GB:.2f} GB/s"
    )


_RENDER: dict[type, Callable[[Any, Console], None]] = {
    CoverageReport: render_coverage,
    SavingsReport: render_savings,
    RolloutReport: render_rollout,
    WhatIfReport: render_what_if,
}


def render(report: Report, console: Console) -> None:
    """Print one scenario's tables."""
    _RENDER[type(report)](report, console)
