"""`kvfleet bench operator`: the operator's planners, timed (`kvfleet_lab.operator.bench`).

It lives under `kvfleet bench` with the other benchmarks: the operator package may not import the
lab, so `kvfleet-operator` has no bench command.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvfleet_lab.cli.benchmarks import bench

__all__ = ["operator"]


@bench.command("operator")
def operator(
    quick: Annotated[bool, typer.Option(help="Fewer repetitions.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of lines.")] = False,
) -> None:
    """Home sets for 2,000 tenants over 44 replicas, the fleet-config publish plan, the tier
    decision and one rollout step: medians (the cluster figures: tests/lab/operator)."""
    from kvfleet_lab.operator.bench import run_all

    results = run_all(quick=quick)
    if as_json:
        typer.echo(json.dumps(results, indent=2))
        return
    for name, figures in results.items():
        typer.echo(f"{name}: {_figures(figures)}")


def _figures(figures: object) -> str:
    """One result as `key value` pairs, the way the other benches print (not a Python repr)."""
    if not isinstance(figures, dict):
        return str(figures)
    parts = []
    for key, value in figures.items():
        shown = "/".join(str(v) for v in value) if isinstance(value, list | tuple) else value
        parts.append(f"{key.replace('_', ' ')} {shown}")
    return ", ".join(parts)
