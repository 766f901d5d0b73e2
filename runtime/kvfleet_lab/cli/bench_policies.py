"""`kvfleet bench policies` (also plain `kvfleet bench`).

`policies`: no cache, vLLM-style hash + LRU, SGLang-style radix + LRU, S3-FIFO and SIEVE (the
published scan-resistant anchors), kvfleet's shipped policy, Belady's offline optimum and the
infinite cache, side by side on the Mooncake traces (each `--trace` given, its own row set: the
synthetic one by default, `--trace synthetic --trace conversation` for both) and on the generated
populations (`kvfleet_lab.cache.compare`, `.workloads`), at several capacities.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_lab.cli.benchmarks import TRACE_HELP, bench, default_trace, trace_path
from kvfleet_runtime.cli._app import fail

__all__ = ["DEFAULT_FRACTIONS", "DEFAULT_OUT", "policies"]

DEFAULT_OUT = Path("out/bench")
DEFAULT_FRACTIONS = "0.01,0.03,0.1,0.3"
TRACE_WORKLOAD = "trace"



def _trace_row_sets(given: list[str] | None) -> list[tuple[str, Path]]:
    """(row-set name, file) per `--trace`: one trace is the row set `trace`, as it always was;
    several are `trace:<vendored name or file stem>` each, in the order given."""
    from kvfleet_lab.traces import TRACES

    if not given:
        return [(TRACE_WORKLOAD, default_trace())]
    paths = [trace_path(t) for t in given]
    if len(paths) == 1:
        return [(TRACE_WORKLOAD, paths[0])]
    names = [f"{TRACE_WORKLOAD}:{t if t in TRACES else Path(t).name.split('.')[0]}" for t in given]
    if len(set(names)) < len(names) or len(set(paths)) < len(paths):
        fail(f"--trace: each trace once, with distinct file names; got {', '.join(given)}")
    return list(zip(names, paths, strict=True))


def _parse_fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--fractions takes comma-separated numbers in (0, 1], got {text!r}")
    if not values or any(not 0 < v <= 1 for v in values):
        fail(f"--fractions takes comma-separated numbers in (0, 1], got {text!r}")
    return sorted(set(values))


@bench.command("policies")
def policies(
    trace: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME|PATH",
            help=TRACE_HELP + " Give it more than once for a row set per trace, e.g. "
            "--trace synthetic --trace conversation."
        ),
    ] = None,
    trace_requests: Annotated[
        int, typer.Option(help="Replay the first N requests of each trace (the quick run).")
    ] = 2000,
    full: Annotated[
        bool,
        typer.Option("--full", help="Replay each trace whole (minutes: docs/benchmarks.md)."),
    ] = False,
    requests: Annotated[int, typer.Option(help="Requests per generated workload.")] = 1000,
    workloads: Annotated[
        str,
        typer.Option(
            help="Comma-separated: trace, system-prompts, rag, agent-loops, conversation, mixed "
            "(default all)."
        ),
    ] = "trace,system-prompts,rag,agent-loops,conversation,mixed",
    fractions: Annotated[
        str, typer.Option(help="Capacities, as fractions of each workload's unique blocks.")
    ] = DEFAULT_FRACTIONS,
    seed: Annotated[int, typer.Option(help="Seed of the generated workloads.")] = 1,
    out: Annotated[
        Path, typer.Option(help="Writes policies.md, policies.json, policies.png, ratios.png.")
    ] = DEFAULT_OUT,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the JSON report instead of tables.")
    ] = False,
    vllm_pool: Annotated[
        bool,
        typer.Option(
            help="Also replay through vLLM's own BlockPool when vllm is importable here or in "
            "$KVFLEET_VLLM_PYTHON / $KVFLEET_HOME/vllm-venv (docs/cache.md)."
        ),
    ] = True,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Also find, per cell, what Belady hits and kvfleet does not: the reuse distance "
            "of those blocks and the once-seen blocks stored between their uses (docs/cache.md).",
        ),
    ] = False,
) -> None:
    """Hit rates side by side: no cache, vLLM-style hash + LRU, radix + LRU (SGLang), S3-FIFO,
    SIEVE, kvfleet, Belady and the infinite cache, on the trace and the generated populations."""
    from kvfleet_lab.cache.blockpool import vllm_python
    from kvfleet_lab.cache.compare import compare_policies
    from kvfleet_lab.cache.sim import TraceRequest, load_mooncake_trace
    from kvfleet_lab.cache.workloads import WORKLOADS, generate_workload
    from kvfleet_lab.traces import trace_label

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    known = (TRACE_WORKLOAD, *WORKLOADS)
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        fail(f"--workloads takes {', '.join(known)}; got {workloads!r}")
    if trace_requests < 1 or requests < 1:
        fail(f"--trace-requests and --requests must be >= 1, got {trace_requests}, {requests}")
    capacity_fractions = _parse_fractions(fractions)
    err = Console(stderr=True, highlight=False)
    start = time.perf_counter()
    inputs: list[tuple[str, str, list[TraceRequest]]] = []
    traces = _trace_row_sets(trace) if TRACE_WORKLOAD in names else []
    for name in names:
        if name == TRACE_WORKLOAD:
            for row_set, path in traces:
                try:
                    reqs = load_mooncake_trace(path, max_requests=None if full else trace_requests)
                except (ValueError, OSError) as exc:
                    fail(f"{exc} (pass --trace with a Mooncake-format JSONL file)")
                scope = "whole trace" if full else f"first {len(reqs):,} requests"
                inputs.append((row_set, f"{trace_label(path)} ({path.name}), {scope}", reqs))
        else:
            generated = generate_workload(name, num_requests=requests, seed=seed)
            inputs.append((name, generated.description, generated.requests))

    def progress(message: str) -> None:
        err.print(f"[{time.perf_counter() - start:6.0f} s] {message}", markup=False)

    python = vllm_python() if vllm_pool else None
    if vllm_pool and python is None:
        progress("vLLM's BlockPool: vllm not found (docs/cache.md makes its environment); skipped")
    report = compare_policies(
        inputs, capacity_fractions, on_progress=progress, vllm_python=python, explain=explain
    )
    report.seconds = time.perf_counter() - start
    try:
        out.mkdir(parents=True, exist_ok=True)
        from kvfleet_lab.cache.plots import write_policy_plots

        header = (
            "# kvfleet bench policies\n\n"
            f"Token hit rate by policy, same requests, same capacity. {report.seconds:.0f} s.\n\n"
        )
        (out / "policies.md").write_text(header + report.to_markdown())
        (out / "policies.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        plots = write_policy_plots(report, out)
    except OSError as exc:
        fail(f"cannot write to --out {out}: {exc}")
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    console = Console(highlight=False)
    for w in report.workloads:
        table = Table(
            title=f"{w.name}: {w.num_requests:,} requests, {w.num_unique_blocks:,} unique blocks",
            caption=w.description,
        )
        for col in (
            "capacity (blocks)",
            "vLLM",
            "radix",
            "S3-FIFO",
            "SIEVE",
            "kvfleet",
            "Belady",
            "inf.",
            "kv/vLLM",
            "kv/radix",
            "kv/S3-FIFO",
            "kv/SIEVE",
            "kv/Belady",
            "kv/inf.",
            "saved: kv",
            "Belady",
            "kv/Belady",
        ):
            table.add_column(col, justify="right")
        for r in w.rows:
            table.add_row(
                f"{r.capacity_fraction:.0%} ({r.capacity_blocks:,})",
                *(
                    f"{r.rate(p):.1%}"
                    for p in ("vllm", "radix", "s3fifo", "sieve", "kvfleet", "belady", "infinite")
                ),
                *(_ratio(r.kvfleet_vs(p)) for p in ("vllm", "radix", "s3fifo", "sieve", "belady")),
                _ratio(r.of_infinite("kvfleet")),
                f"{r.saved('kvfleet'):.1%}",
                f"{r.saved('belady'):.1%}",
                _ratio(r.kvfleet_saved_vs("belady")),
            )
        console.print(table)
        if any(r.vllm_pool is not None for r in w.rows):
            console.print(
                "  vLLM's own BlockPool beside the vLLM replay: "
                + ", ".join(
                    f"{r.capacity_fraction:.0%} {r.vllm_pool.token_hit_rate:.2%} vs "
                    f"{r.rate('vllm'):.2%}"
                    for r in w.rows
                    if r.vllm_pool is not None
                )
            )
        if w.vllm_pool_error:
            console.print(f"  vLLM's BlockPool replay did not run: {w.vllm_pool_error}")
        for r in w.rows:
            lost = r.lost_hits
            if lost is not None:
                console.print(
                    f"  {r.capacity_fraction:.0%}: Belady hits {lost.num_lost_blocks:,} blocks "
                    f"kvfleet does not ({lost.first_reuse_share:.0%} at their first reuse); "
                    "between their uses (x capacity, p50): "
                    f"{lost.accesses_quartiles[1]:.2f} requested, "
                    f"{lost.new_quartiles[1]:.2f} first sightings, "
                    f"{lost.once_quartiles[1]:.2f} once-seen; "
                    f"{lost.share_returning_below_capacity:.0%} had room without the once-seen; "
                    "LRU storing only returning blocks (offline): "
                    f"{lost.returning_only_lru_hit_blocks * 16 / max(1, w.num_tokens):.1%}"
                )
    console.print(
        "Token hit rates; kv/X = kvfleet's over X's; saved: the share of the prefill FLOPs of "
        "the reference model (breakeven's 2N per token plus attention by position) the hits "
        "saved; no cache prefills every prompt token (hit rate 0); each policy over the "
        "infinite cache in policies.md. "
        f"{report.seconds:.0f} s in all; "
        f"wrote {out / 'policies.md'}, {out / 'policies.json'}, " + ", ".join(str(p) for p in plots)
    )


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"
