"""`kvfleet bench startup`: a replica's start-up to first served token and peak RSS, next to
transformers' `from_pretrained` of the same checkpoint (the code lives in kvfleet_lab)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_lab.cli.benchmarks import bench
from kvfleet_runtime.cli._app import fail

__all__ = ["startup"]


@bench.command("startup")
def startup(
    model_dir: Annotated[Path | None, typer.Option(
        help="Checkpoint to measure; default: a generated ~1.7 GB bf16 Llama-shaped one.")
    ] = None,
    reps: Annotated[int, typer.Option(help="Runs of each side (median).")] = 1,
    threads: Annotated[int, typer.Option(help="torch intra-op threads on both sides.")] = 2,
    scale: Annotated[float, typer.Option(
        help="Fraction of the generated model's layers (a quicker, smaller run).")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Start-up and peak RSS of `kvfleet replica` vs transformers' from_pretrained, side by side."""
    from kvfleet_lab.model.startup import run_startup_bench

    if reps < 1 or threads < 1 or not 0 < scale <= 1:
        fail("--reps and --threads must be >= 1 and --scale in (0, 1]")
    try:
        report = run_startup_bench(model_dir=model_dir, reps=reps, threads=threads, scale=scale)
    except (ValueError, OSError, RuntimeError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    gib = 1 << 30
    table = Table(title=f"kvfleet bench startup — {report.num_params / 1e9:.2f}B params, "
                        f"{report.dtype}, {report.checkpoint_bytes / gib:.2f} GiB checkpoint")
    table.add_column("measure")
    table.add_column("kvfleet replica", justify="right")
    table.add_column("transformers", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target", justify="right")
    table.add_row("spawn to first token", f"{report.kvfleet_startup_s:.2f} s",
                  f"{report.transformers_startup_s:.2f} s", f"{report.startup_ratio:.2f}x",
                  "<= 1.5x")
    table.add_row("peak RSS", f"{report.kvfleet_peak_rss_bytes / gib:.2f} GiB",
                  f"{report.transformers_peak_rss_bytes / gib:.2f} GiB",
                  f"{report.rss_ratio:.2f}x", "")
    table.add_row("peak RSS / checkpoint bytes", f"{report.rss_per_checkpoint:.2f}x",
                  f"{report.transformers_peak_rss_bytes / report.checkpoint_bytes:.2f}x", "",
                  "<= 1.3x")
    table.add_row("  imports alone (no model)", f"{report.kvfleet_import_rss_bytes / gib:.2f} GiB",
                  f"{report.transformers_import_rss_bytes / gib:.2f} GiB", "", "")
    table.add_row("  (peak - imports) / checkpoint", f"{report.loading_rss_per_checkpoint:.2f}x",
                  f"{report.transformers_loading_rss_per_checkpoint:.2f}x", "", "")
    out = Console(highlight=False)
    out.print(table)
    out.print(f"median of {report.reps} run(s) each; same first greedy token: "
              f"{'yes' if report.same_first_token else 'NO'}")
