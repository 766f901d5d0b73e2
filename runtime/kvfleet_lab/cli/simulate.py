"""`kvfleet simulate`: the fleet-scale figures by simulation (`kvfleet_lab.simulate`).

A thin shell: options are checked here, the scenarios run and print in the lab.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvfleet_lab.cli._commands import commands
from kvfleet_runtime.breakeven import GPUS, MODELS, KVDtype
from kvfleet_runtime.cli._app import fail

__all__ = ["simulate"]


@commands.command()
def simulate(
    scenario: Annotated[str, typer.Argument(
        help="One of: coverage, savings, rollout, what-if, all.")] = "all",
    seed: Annotated[int, typer.Option(help="Seed of the arrival process.")] = 1,
    model: Annotated[
        str, typer.Option(help=f"Model profile: {', '.join(MODELS)}.")
    ] = "reference-70b",
    kv_dtype: Annotated[str, typer.Option(help="KV dtype: fp32, bf16, fp16, fp8.")] = "fp16",
    gpu: Annotated[str, typer.Option(help=f"GPU profile: {', '.join(GPUS)}.")] = "h100",
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree of a replica.")] = 4,
    replicas: Annotated[int, typer.Option(help="Replicas in the fleet.")] = 44,
    rps: Annotated[float, typer.Option(help="Fleet request rate (Poisson).")] = 83.0,
    tenants: Annotated[int, typer.Option(help="Tenants, each with its templates.")] = 2000,
    duration_s: Annotated[
        float | None,
        typer.Option(help="Simulated seconds per run, at least 600: the first half warms the "
                     "caches (default: 1800; rollout 3600)."),
    ] = None,
    ttft_slo_s: Annotated[
        float | None,
        typer.Option(help="TTFT p99 objective the rollout is judged against (default: 5 s)."),
    ] = None,
    warm_utilization: Annotated[
        float | None,
        typer.Option(help="Prefill utilization of the busiest replica with a warm cache "
                     "(default: 0.7)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    out: Annotated[
        Path | None, typer.Option(help="Write report.json and PNG plots into this folder.")
    ] = None,
) -> None:
    """Fleet-scale figures by simulation: coverage, prefill saved, rollouts, what-ifs."""
    from kvfleet_lab.simulate import DEFAULT_TTFT_SLO_S, DEFAULT_WARM_UTILIZATION, fleet_profile
    from kvfleet_lab.simulate.render import SCENARIOS, render, run_scenarios

    ttft_slo_s = DEFAULT_TTFT_SLO_S if ttft_slo_s is None else ttft_slo_s
    warm_utilization = DEFAULT_WARM_UTILIZATION if warm_utilization is None else warm_utilization
    name = scenario.strip().lower()
    if name not in SCENARIOS:
        fail(f"unknown scenario {scenario!r}; choose one of: {', '.join(SCENARIOS)}")
    for label, value in (("--rps", rps), ("--ttft-slo-s", ttft_slo_s)):
        if not math.isfinite(value) or value <= 0:
            fail(f"{label} must be a positive finite number, got {value}")
    if duration_s is not None and (not math.isfinite(duration_s) or duration_s < 600):
        fail(f"--duration-s must be at least 600 s (half of it warms the caches), got {duration_s}")
    if not 0 < warm_utilization <= 1:
        fail(f"--warm-utilization must be in (0, 1], got {warm_utilization}")
    if replicas < 1 or tenants < 1:
        fail(f"--replicas and --tenants must be positive, got {replicas} and {tenants}")
    try:
        profile = fleet_profile(model, KVDtype.parse(kv_dtype), gpu, tp)
        reports = run_scenarios(
            name, profile, seed, replicas, rps, tenants, duration_s, ttft_slo_s, warm_utilization
        )
    except ValueError as exc:
        fail(str(exc))
    data = {key: report.to_dict() for key, report in reports.items()}
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        console = Console(highlight=False)
        for report in reports.values():
            render(report, console)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            fail(f"cannot write into {out}: {exc.strerror or exc}")
        from kvfleet_lab.simulate.plots import write_plots

        written = write_plots(reports, out)
        if not as_json:
            Console(highlight=False).print(
                f"wrote {out / 'report.json'}" + "".join(f", {p}" for p in written)
            )
