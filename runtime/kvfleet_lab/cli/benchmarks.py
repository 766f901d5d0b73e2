"""`kvfleet bench ...`: benchmarks that print measured figures and ratios side by side.

This module is the `bench` group and what belongs to the whole group: plain `kvfleet bench`
(the policy comparison with its defaults) and `kvfleet bench all` (every benchmark with quick
settings, each other one in its own process so that one failing benchmark does not stop the
others). Each benchmark is one command in its own `bench_*` module, which imports this one; this
one imports none of them (it finds a command by name on the group when it runs it). None of them
is a timed test.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from kvfleet_lab.cli._commands import commands
from kvfleet_runtime.cli._app import fail

__all__ = ["QUICK_ARGS", "TRACE_HELP", "all_benchmarks", "bench",
           "default_trace", "trace_path"]

TRACE_HELP = ("A vendored trace by name (synthetic: Mooncake's synthetic trace, the default; "
              "conversation: Mooncake's conversation trace) or a Mooncake-format JSONL file "
              "(.gz read compressed).")


def default_trace() -> Path:
    """The Mooncake synthetic trace vendored in the lab package (kvfleet_lab/traces)."""
    from kvfleet_lab.traces import DEFAULT_TRACE

    return DEFAULT_TRACE


def trace_path(name_or_path: str | None) -> Path:
    """What a `--trace` names (None: the default trace), or a clear CLI error."""
    from kvfleet_lab.traces import resolve_trace

    if name_or_path is None:
        return default_trace()
    try:
        return resolve_trace(name_or_path)
    except ValueError as exc:
        fail(f"--trace: {exc}")


bench = typer.Typer(
    name="bench",
    help="Benchmarks: measured figures and ratios, side by side. With no subcommand: the "
    "policy comparison (`policies`, its defaults); `all` runs every benchmark quickly.",
    invoke_without_command=True,
)
commands.add_typer(bench)

QUICK_ARGS: dict[str, list[str]] = {
    "replica": ["--reps", "2", "--prefill-tokens", "512,2000", "--prompt-tokens", "1000",
                "--concurrency", "1,8"],
    "cache": ["--requests", "1000", "--lookup-reps", "50", "--materialize-reps", "3"],
    "fleet": ["--max-requests", "1000", "--reps", "3", "--router-requests", "200"],
    "nvme": ["--size-mib", "128", "--reps", "1"],
    "policies": ["--trace-requests", "2000", "--requests", "1000", "--seed", "1",
                 "--workloads", "trace,system-prompts,rag,agent-loops,conversation,mixed"],
}
"""Options `kvfleet bench all` passes to each benchmark (those a command lacks are left out); a
benchmark not named here runs with its own defaults."""


def command(name: str) -> Any:  # typer's own (vendored) click.Command
    """The `bench` subcommand `name` as registered (`kvfleet_lab.cli` imports its module)."""
    group = typer.main.get_command(bench)
    assert isinstance(group, typer.core.TyperGroup)
    found = group.commands.get(name)
    if found is None:
        raise LookupError(f"no `kvfleet bench {name}` is registered")
    return found


@bench.callback()
def _default(ctx: typer.Context) -> None:
    """With no subcommand, run `kvfleet bench policies` with its defaults."""
    if ctx.invoked_subcommand is None:
        run_in_process(ctx, "policies", [])


def run_in_process(ctx: typer.Context, name: str, args: list[str]) -> None:
    """`kvfleet bench <name> <args>` in this process, as the command line would run it."""
    found = command(name)
    with found.make_context(name, args, parent=ctx) as sub:
        found.invoke(sub)


def _quick_args(name: str) -> list[str]:
    """QUICK_ARGS[name], minus the options that command does not have."""
    known = {opt for p in command(name).params for opt in p.opts}
    args = QUICK_ARGS.get(name, [])
    kept: list[str] = []
    for opt, value in zip(args[::2], args[1::2], strict=True):
        if opt in known:
            kept += [opt, value]
    return kept


@bench.command("all")
def all_benchmarks(
    ctx: typer.Context,
    out: Annotated[Path | None, typer.Option(
        help="Where `policies` writes its table and plots; default: `policies`' own.")] = None,
    skip: Annotated[
        list[str] | None, typer.Option(help="Skip a benchmark by name (repeatable).")
    ] = None,
    timeout_s: Annotated[
        int, typer.Option(help="Wall-clock limit of each other benchmark.")
    ] = 1800,
) -> None:
    """Every benchmark with quick settings: the policy comparison, then each other
    `kvfleet bench` subcommand in its own process; a summary at the end."""
    skipped = set(skip or [])
    others = [
        c.name
        for c in bench.registered_commands
        if c.name and c.name not in {"all", "policies"} and c.name not in skipped
    ]
    console = Console(highlight=False)
    results: list[tuple[str, str, float]] = []
    if "policies" not in skipped:
        console.rule("kvfleet bench policies")
        t0 = time.perf_counter()
        try:
            run_in_process(ctx, "policies",
                           _quick_args("policies") + (["--out", str(out)] if out else []))
            status = "ok"
        except typer.Exit as exc:
            status = f"exit {exc.exit_code}"
        results.append(("policies", status, time.perf_counter() - t0))
    for name in others:
        args = [sys.executable, "-m", "kvfleet_lab.cli", "bench", name, *_quick_args(name)]
        console.rule(f"kvfleet bench {name} {' '.join(args[5:])}".rstrip())
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(args, timeout=timeout_s).returncode
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout_s} s"
        results.append((name, status, time.perf_counter() - t0))
    table = Table(title="kvfleet bench all")
    for col in ("benchmark", "status", "wall time"):
        table.add_column(col)
    for name, status, seconds in results:
        table.add_row(name, status, f"{seconds:.0f} s")
    console.print(table)
    if any(status != "ok" for _, status, _ in results):
        raise typer.Exit(code=1)
