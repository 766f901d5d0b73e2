"""`kvfleet bench nvme --path DIR`: the T3 store's read and write bandwidth on a path at
concurrency 1/4/8 beside raw sequential I/O of the same bytes, and the verdict against the
reference model's break-even (the code lives in kvfleet_lab.nvme)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_lab.cli.benchmarks import bench
from kvfleet_runtime.cli._app import fail

__all__ = ["nvme"]


@bench.command("nvme")
def nvme(
    path: Annotated[Path | None, typer.Option(
        help="Directory on the medium to measure (the T3 mount); default: the temp directory.")
    ] = None,
    concurrency: Annotated[str, typer.Option(help="Comma-separated reads in flight.")] = "1,4,8",
    size_mib: Annotated[int, typer.Option(help="MiB written and read per level and rep.")] = 512,
    run_blocks: Annotated[int, typer.Option(
        help="Blocks per run (one I/O); a block is the reference model's 5 MiB.")] = 4,
    reps: Annotated[int, typer.Option(
        help="Passes per side and level, store and raw alternating (medians).")] = 5,
    buffered: Annotated[bool, typer.Option(
        "--buffered", help="Never O_DIRECT (default: O_DIRECT where the filesystem allows).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """T3 store vs raw sequential I/O of the same bytes; verdict vs the TP4 break-even."""
    from kvfleet_lab.nvme.bench import TARGET_RATIO, run_nvme_bench

    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        fail(f"--concurrency must be comma-separated integers, got {concurrency!r}")
    if not levels or any(c < 1 for c in levels) or size_mib < 1 or run_blocks < 1 or reps < 1:
        fail("--concurrency levels, --size-mib, --run-blocks and --reps must be >= 1")
    if path is None:
        path = Path(tempfile.gettempdir())
    try:
        path.mkdir(parents=True, exist_ok=True)  # a folder to measure in, made like --out
    except OSError as exc:
        fail(f"--path {path}: cannot create the folder: {exc.strerror or exc}")
    try:
        report = run_nvme_bench(path, concurrency=levels, size_bytes=size_mib << 20,
                                run_blocks=run_blocks, reps=reps,
                                direct=False if buffered else None)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    out = Console(highlight=False)
    mode = "O_DIRECT" if report.direct_io else "buffered"
    table = Table(title=f"kvfleet bench nvme — {report.path} ({mode}), "
                        f"{report.run_blocks} x {report.block_bytes >> 20} MiB blocks per I/O, "
                        f"{_per_level(report.bytes_per_level, size_mib)}, medians of {report.reps} "
                        "alternating passes over the same bytes")
    for name in ("concurrency", "store read", "raw read", "ratio", "store write", "raw write",
                 "ratio"):
        table.add_column(name, justify="right")
    for lv in report.levels:
        table.add_row(str(lv.concurrency), f"{lv.store_read_gb_s:.2f} GB/s",
                      f"{lv.raw_read_gb_s:.2f} GB/s", f"{lv.read_ratio:.2f}x",
                      f"{lv.store_write_gb_s:.2f} GB/s", f"{lv.raw_write_gb_s:.2f} GB/s",
                      f"{lv.write_ratio:.2f}x")
    out.print(table)
    out.print("read passes (GB/s, store | raw): " + "; ".join(
        f"c={lv.concurrency}: {' '.join(f'{x:.2f}' for x in lv.store_read_reps_gb_s)} | "
        f"{' '.join(f'{x:.2f}' for x in lv.raw_read_reps_gb_s)}" for lv in report.levels))
    ok = "meets" if report.min_read_ratio >= TARGET_RATIO else "MISSES"
    out.print(f"store reads >= {TARGET_RATIO}x raw at every level: {ok} "
              f"(lowest {report.min_read_ratio:.2f}x)")
    for v in report.verdicts:
        out.print(f"reference 70B, H100 TP4, {v.kv_dtype} KV: break-even {v.break_even_gb_s:.2f}"
                  f" GB/s; T3 here {v.measured_gb_s:.2f} GB/s at concurrency {v.at_concurrency}"
                  f" = {v.margin:.2f}x -> {v.verdict}")


def _per_level(bytes_per_level: int, size_mib: int) -> str:
    """The bytes each level moved: whole I/Os, so --size-mib is rounded down to a multiple of
    run_blocks x 5 MiB; say so rather than print a figure that looks like a typo."""
    shown = f"{bytes_per_level >> 20} MiB per level"
    if bytes_per_level != size_mib << 20:
        shown += f" (--size-mib {size_mib} rounded down to whole I/Os)"
    return shown
