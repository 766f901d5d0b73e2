"""`kvfleet bench ...`: benchmarks that print measured figures and ratios side by side.

Each benchmark is one command on the `bench` sub-app; none of them is a timed test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_runtime.cli._app import app, fail

__all__ = ["TRACE_HELP", "bench", "default_trace"]

TRACE_HELP = "Mooncake-format JSONL trace; default: the vendored Mooncake synthetic trace."


def default_trace() -> Path:
    """The Mooncake synthetic trace vendored in the lab package (kvfleet_lab/traces)."""
    from kvfleet_lab.traces import DEFAULT_TRACE

    return DEFAULT_TRACE


bench = typer.Typer(
    name="bench",
    help="Benchmarks: measured figures and ratios, side by side. With no subcommand: the "
    "policy comparison (`policies`, its defaults); `all` runs every benchmark quickly.",
    invoke_without_command=True,
)
app.add_typer(bench)


@bench.callback()
def _default(ctx: typer.Context) -> None:
    """With no subcommand, run `kvfleet bench policies` with its defaults."""
    if ctx.invoked_subcommand is None:
        from kvfleet_runtime.cli.bench_policies import policies

        ctx.invoke(policies)


@bench.command("replica")
def replica(
    model_dir: Annotated[Path | None, typer.Option(
        help="Checkpoint to measure; default: a generated one of --preset.")] = None,
    preset: Annotated[str, typer.Option(help="Preset to generate when no --model-dir.")] = "small",
    prompt_tokens: Annotated[int, typer.Option(help="Long-prompt length for TTFT.")] = 2000,
    reps: Annotated[int, typer.Option(help="Runs per TTFT figure (median).")] = 5,
    requests: Annotated[int, typer.Option(help="Requests in the throughput workload.")] = 32,
    concurrency: Annotated[int, typer.Option(help="Concurrent clients in the workload.")] = 8,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    cpu_threads: Annotated[int, typer.Option(
        help="torch intra-op threads on CPU (0: torch's default).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """TTFT full prefill vs T0 hit vs T1 hit; throughput with and without the cache; miss cost."""
    import torch

    from kvfleet_lab.engine.bench import run_replica_bench
    from kvfleet_runtime.model import default_device

    if prompt_tokens < 32 or reps < 1 or requests < 1 or concurrency < 1:
        fail("--prompt-tokens must be >= 32 and --reps, --requests, --concurrency >= 1")
    if device not in ("auto", "cpu", "cuda"):
        fail(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: CUDA is not available here")
    dev = default_device() if device == "auto" else torch.device(device)
    if dev.type == "cpu" and cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    try:
        report = run_replica_bench(model_dir=model_dir, preset=preset,
                                   prompt_tokens=prompt_tokens, reps=reps, device=dev,
                                   num_requests=requests, concurrency=concurrency)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    out = Console(highlight=False)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))  # raw: no console wrapping
        return
    ms = 1e3
    threads = f", {torch.get_num_threads()} CPU thread(s)" if dev.type == "cpu" else ""
    table = Table(title=f"kvfleet bench replica — {report.model} on {report.device}{threads}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("ratio / note", justify="right")
    n = report.prompt_tokens
    table.add_row(f"TTFT {n}-token prompt, full prefill",
                  f"{report.ttft_full_prefill_s * ms:.2f} ms", "1x")
    table.add_row(f"TTFT, T0 hit ({report.cached_tokens_t0} cached)",
                  f"{report.ttft_t0_hit_s * ms:.2f} ms", f"{report.t0_speedup:.1f}x faster")
    table.add_row(f"TTFT, T1 hit ({report.cached_tokens_t1} cached)",
                  f"{report.ttft_t1_hit_s * ms:.2f} ms", f"{report.t1_speedup:.1f}x faster")
    table.add_row("throughput, no cache", f"{report.throughput_no_cache_tok_s:.1f} tok/s",
                  report.workload)
    table.add_row("throughput, with cache", f"{report.throughput_cache_tok_s:.1f} tok/s",
                  f"{report.throughput_ratio:.2f}x; "
                  f"{report.workload_cached_token_fraction:.0%} of prompt tokens cached")
    table.add_row(f"prefill {n} tokens", f"{report.prefill_s * ms:.2f} ms", "")
    table.add_row("miss: lookup + store on the request path",
                  f"{(report.miss_lookup_s + report.miss_store_path_s) * ms:.3f} ms",
                  f"{report.miss_overhead_fraction:.2%} of prefill (target < 1%)")
    table.add_row("store copy into the pool (background)", f"{report.store_drain_s * ms:.3f} ms",
                  f"{report.store_drain_s / report.prefill_s:.2%} of prefill, off the path")
    out.print(table)
    out.print(f"median of {report.reps} runs each; `kvfleet bench replica --json` for raw figures")
