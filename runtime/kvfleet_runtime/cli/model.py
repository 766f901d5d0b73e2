"""`kvfleet model inspect DIR`: what a checkpoint is, and whether this replica would serve it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvfleet_runtime.cli._app import fail
from kvfleet_runtime.cli.replica import model_app

__all__ = ["inspect"]


@model_app.command("inspect")
def inspect(
    model_dir: Annotated[Path, typer.Argument(help="Checkpoint folder (Hugging Face layout).")],
    dtype: Annotated[str | None, typer.Option(
        help="Serving dtype to report for: bf16, fp16 or fp32 (default: the checkpoint's).")
    ] = None,
    digest: Annotated[bool, typer.Option(help="Hash the weights (reads every byte).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Architecture, parameters, KV bytes per token, dtype, digest; supported or refused (why).

    Exits 1 when the replica would refuse the checkpoint."""
    from kvfleet_runtime.model import inspect_checkpoint

    if not model_dir.is_dir():
        fail(f"{model_dir} is not a folder")
    try:
        report = inspect_checkpoint(model_dir, dtype=dtype, digest=digest)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        out = Console(highlight=False, soft_wrap=True)
        rows = [
            ("architecture", report.architecture),
            ("parameters", f"{report.num_params:,} ({report.num_params / 1e9:.3g}B)"),
            ("checkpoint dtype", report.checkpoint_dtype),
            ("serving dtype", report.serving_dtype or "-"),
            ("KV bytes per token", f"{report.kv_bytes_per_token:,} B"
             if report.kv_bytes_per_token is not None else "-"),
            ("weights", f"{report.checkpoint_bytes:,} B in {report.num_files} file(s)"),
            ("weights digest", report.weights_digest or "(not computed)"),
            ("supported", "yes" if report.supported else f"no, refused: {report.reason}"),
        ]
        for name, value in rows:
            out.print(f"  {name:<20}{value}", markup=False)
    if not report.supported:
        raise typer.Exit(code=1)
