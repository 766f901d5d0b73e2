"""`kvfleet bench soak`: a fleet under load with faults on a schedule (`kvfleet_lab.fleet.soak`)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvfleet_lab.cli.benchmarks import bench
from kvfleet_runtime.cli._app import fail

__all__ = ["soak"]


@bench.command("soak")
def soak(
    minutes: Annotated[float, typer.Option(help="How long the load runs.")] = 15.0,
    redis: Annotated[str, typer.Option(help="Hint index: single (one redis-server) or cluster "
                                            "(three masters, a replica each).")] = "single",
    concurrency: Annotated[int, typer.Option(help="Closed-loop clients.")] = 4,
    bucket_s: Annotated[float, typer.Option(help="Seconds per reported time bucket.")] = 30.0,
    outage_s: Annotated[float, typer.Option(help="How long a killed replica and Redis stay "
                                                 "down.")] = 10.0,
    work_dir: Annotated[Path | None, typer.Option(help="Logs and configs (default: a temp "
                                                       "dir).")] = None,
    out: Annotated[Path | None, typer.Option(help="Also write the report's JSON here.")] = None,
) -> None:
    """Router, three tiny-checkpoint replicas and Redis for --minutes; a replica killed, Redis
    restarted, a config rewritten, a peer cut mid-T2, a slow client. Every request accounted
    for, p50/p99 and hit rate over time, RSS and fds at start and end, recovery per fault."""
    from kvfleet_lab.fleet.soak import SoakOptions, render, run_soak

    if minutes <= 0 or concurrency < 1 or bucket_s <= 0 or outage_s < 0:
        fail("--minutes > 0, --concurrency >= 1, --bucket-s > 0, --outage-s >= 0")
    console = Console(highlight=False, stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvfleet-soak-") as tmp:
        options = SoakOptions(work_dir=work_dir or Path(tmp), duration_s=minutes * 60,
                              redis=redis, concurrency=concurrency, bucket_s=bucket_s,
                              outage_s=outage_s)
        try:
            report = run_soak(options, progress=lambda line: console.print(line, markup=False))
        except (OSError, RuntimeError, ValueError) as exc:
            fail(str(exc))
    if out is not None:
        out.write_text(json.dumps(report.to_json(), indent=1))
    Console(highlight=False).print(render(report), markup=False)
