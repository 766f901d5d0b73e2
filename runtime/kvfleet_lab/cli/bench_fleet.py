"""`kvfleet bench fleet`: the fleet tier's figures side by side (`kvfleet_lab.fleet.bench`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_lab.cli.benchmarks import TRACE_HELP, bench, default_trace, trace_path
from kvfleet_runtime.cli._app import fail

__all__ = ["fleet"]



@bench.command("fleet")
def fleet(
    trace: Annotated[str | None, typer.Option(help=TRACE_HELP, metavar="NAME|PATH")] = None,
    replicas: Annotated[int, typer.Option(help="Replicas in the hit-rate simulation.")] = 4,
    capacity_fraction: Annotated[
        float,
        typer.Option(help="Share of the trace's working set the fleet's caches hold together."),
    ] = 1.0,
    admit_min_sightings: Annotated[
        int,
        typer.Option(
            help="Admission in the simulated caches (1: store on first sight, as the bound does; "
            "2: the shipped default)."
        ),
    ] = 1,
    max_requests: Annotated[int | None, typer.Option(help="Replay only the first N.")] = None,
    t2_tokens: Annotated[int, typer.Option(help="Tokens in the T2 block run.")] = 2000,
    t2_layout: Annotated[
        str, typer.Option(help="LAYERS,KV_HEADS,HEAD_DIM of the T2 run (FP16).")
    ] = "8,8,128",
    reps: Annotated[int, typer.Option(help="T2 transfers timed (median).")] = 7,
    router_requests: Annotated[int, typer.Option(help="Requests timed per router path.")] = 500,
    skip: Annotated[
        list[str] | None, typer.Option(help="Skip a part: t2, router, hit-rates.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """T2 loopback bandwidth vs raw socket, T2 over NIXL vs a bare NIXL READ; router overhead
    p50/p99; fleet hit rate by routing."""
    from kvfleet_lab.fleet.bench import (
        FleetBenchReport,
        bench_hit_rates,
        bench_router_overhead,
        bench_t2_bandwidth,
    )

    skipped = set(skip or [])
    if not skipped <= {"t2", "router", "hit-rates"}:
        fail(f"--skip takes t2, router or hit-rates, got {sorted(skipped)}")
    try:
        layers, heads, head_dim = (int(x) for x in t2_layout.split(","))
    except ValueError:
        fail(f"--t2-layout expects LAYERS,KV_HEADS,HEAD_DIM, got {t2_layout!r}")
    path = trace_path(trace) if "hit-rates" not in skipped else default_trace()
    report = FleetBenchReport()
    try:
        if "t2" not in skipped:
            report.t2 = bench_t2_bandwidth(
                num_layers=layers,
                num_kv_heads=heads,
                head_dim=head_dim,
                num_tokens=t2_tokens,
                reps=reps,
            )
        if "router" not in skipped:
            report.router = bench_router_overhead(num_requests=router_requests)
        if "hit-rates" not in skipped:
            report.hit_rates = bench_hit_rates(
                path,
                num_replicas=replicas,
                capacity_fraction=capacity_fraction,
                max_requests=max_requests,
                admit_min_sightings=admit_min_sightings,
            )
    except (ValueError, OSError, RuntimeError) as exc:
        fail(str(exc))
    out = Console(highlight=False)
    if as_json:
        out.print(json.dumps(report.to_dict(), indent=2), markup=False)
        return
    if report.t2 is not None:
        t = report.t2
        table = Table(
            title=f"T2 loopback: one run of {t.num_bytes / 2**20:.1f} MiB, median of "
            f"{len(t.t2_times_s)} back-to-back pairs (median of pair ratios: "
            f"{t.paired_ratio_median:.2f})"
        )
        for col in ("path", "time", "GB/s", "ratio to raw"):
            table.add_column(col)
        table.add_row("raw socket", f"{t.raw_median_s * 1e3:.1f} ms", f"{t.raw_gb_s:.2f}", "1.00")
        table.add_row(
            "T2 (HTTP, XXH3-64 frames, verified)",
            f"{t.t2_median_s * 1e3:.1f} ms",
            f"{t.t2_gb_s:.2f}",
            f"{t.ratio:.2f}",
        )
        nixl = t.nixl
        if nixl is not None:
            for name, seconds in (("bare NIXL READ (UCX)", nixl.bare_median_s),
                                  ("T2 over NIXL (lease, checks, READ, release)",
                                   nixl.t2_median_s)):
                table.add_row(name, f"{seconds * 1e3:.1f} ms",
                              f"{t.num_bytes / seconds / 1e9:.2f}",
                              f"{t.raw_median_s / seconds:.2f}")
        out.print(table)
        if nixl is not None:
            out.print(f"T2 over NIXL / bare NIXL READ (t2_vs_bare_nixl): "
                      f"{nixl.t2_vs_bare_nixl:.2f} (median of pair ratios "
                      f"{nixl.paired_ratio_median:.2f}); serving process CPU s per GiB served: "
                      f"HTTP {t.server_cpu_s_per_gib:.3f}, NIXL {nixl.server_cpu_s_per_gib:.3f}")
        else:
            out.print("T2 over NIXL: not measured (NIXL is not installed here)")
    if report.router is not None:
        r = report.router
        table = Table(title=f"Router overhead ({r.num_requests} sequential requests)")
        for col in ("path", "p50", "p99"):
            table.add_column(col)
        table.add_row(
            "straight to replica",
            f"{r.direct_p50_s * 1e3:.2f} ms",
            f"{r.direct_p99_s * 1e3:.2f} ms",
        )
        table.add_row(
            "through kvfleet router",
            f"{r.routed_p50_s * 1e3:.2f} ms",
            f"{r.routed_p99_s * 1e3:.2f} ms",
        )
        table.add_row(
            "overhead", f"{r.overhead_p50_s * 1e3:.2f} ms", f"{r.overhead_p99_s * 1e3:.2f} ms"
        )
        out.print(table)
    if report.hit_rates is not None:
        h = report.hit_rates
        table = Table(
            title=(
                f"Fleet token hit rate: {h.num_requests} requests, {h.num_replicas} replicas x "
                f"{h.capacity_blocks} blocks ({h.unique_blocks} unique blocks in the trace); "
                f"simulated over real CacheManager instances"
            )
        )
        for col in (
            "routing",
            "token hit rate",
            "x bound",
            "spill rate",
            "mean queue delay",
            "requests per replica",
        ):
            table.add_column(col)
        table.add_row("single shared infinite cache (bound)", f"{h.bound:.3f}", "1.00", "", "", "")
        for res in h.results:
            table.add_row(
                res.policy,
                f"{res.token_hit_rate:.3f}",
                f"{res.token_hit_rate / h.bound:.2f}" if h.bound else "-",
                f"{res.spill_rate:.3f}",
                f"{res.mean_queue_delay_s * 1e3:.0f} ms",
                " ".join(str(n) for n in res.per_replica_requests),
            )
        out.print(table)
