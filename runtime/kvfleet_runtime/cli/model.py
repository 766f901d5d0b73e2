"""`kvfleet model`: `generate` writes a test checkpoint, `inspect DIR` says what a checkpoint is and
whether this replica would serve it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvfleet_runtime.cli._app import app, fail

__all__ = ["generate", "inspect", "model_app"]

model_app = typer.Typer(name="model", help="Reference model checkpoints.", no_args_is_help=True)
app.add_typer(model_app)


@model_app.command("generate")
def generate(
    out: Annotated[Path, typer.Option("--out", help="Folder to write config.json and "
                                      "model.safetensors into.")],
    preset: Annotated[str, typer.Option(help="tiny (tests) or small (bench, demo).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Same preset and seed: the same bytes.")] = 0,
    attn_impl: Annotated[str, typer.Option(help="eager or sdpa.")] = "eager",
) -> None:
    """Write a deterministic random Llama-style checkpoint (Hugging Face layout)."""
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint

    try:
        args = ModelArgs.from_preset(preset)
        args.attn_impl = attn_impl
        args.__post_init__()
        digest = generate_checkpoint(out, args, seed=seed)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    Console(highlight=False).print(f"{out}  {digest}")


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
