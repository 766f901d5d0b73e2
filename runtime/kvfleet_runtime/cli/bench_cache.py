"""`kvfleet bench cache`: the cache core's figures side by side (`kvfleet_lab.cache.bench`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_runtime.cli._app import fail
from kvfleet_runtime.cli.bench import TRACE_HELP, bench, default_trace

__all__ = ["cache"]

QUICK_REQUESTS = 2000




@bench.command("cache")
def cache(
    trace: Annotated[
        Path | None,
        typer.Option(help=TRACE_HELP),
    ] = None,
    requests: Annotated[
        int, typer.Option(help="Replay the first N requests of the trace (the quick run).")
    ] = QUICK_REQUESTS,
    full: Annotated[
        bool, typer.Option("--full", help="Replay the whole trace (several minutes on 2 cores).")
    ] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (materialize target).")] = "auto",
    lookup_reps: Annotated[int, typer.Option(help="Lookups per prompt size.")] = 200,
    materialize_reps: Annotated[int, typer.Option(help="Copies per bandwidth figure.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Lookup latency, materialize bandwidth, metadata per block and trace hit rates vs LRU,
    Belady and the infinite cache."""
    import torch

    from kvfleet_lab.cache.bench import run_cache_bench

    path = trace if trace is not None else default_trace()
    if not path.is_file():
        fail(f"trace not found: {path} (pass --trace with a Mooncake-format JSONL file)")
    if requests < 1 or lookup_reps < 1 or materialize_reps < 1:
        fail("--requests, --lookup-reps and --materialize-reps must be >= 1")
    if device not in ("auto", "cpu", "cuda"):
        fail(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: CUDA is not available here")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    try:
        report = run_cache_bench(
            trace=path,
            max_requests=None if full else requests,
            device=dev,
            lookup_reps=lookup_reps,
            materialize_reps=materialize_reps,
        )
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    out = Console(highlight=False)
    table = Table(title=f"lookup, full hit, index of {report.lookup[0].num_index_blocks:,} blocks")
    for col in (
        "prompt",
        "p50 / p99",
        "cold p50 / p99",
        "no memo p50",
        "SHA-256 chain p50 / p99",
        "p50 / SHA-256",
        "cold / SHA-256",
    ):
        table.add_column(col, justify="right")
    for row in report.lookup:
        table.add_row(
            f"{row.prompt_tokens:,} tok",
            f"{row.p50_us:.0f} / {row.p99_us:.0f} us",
            f"{row.cold_p50_us:.0f} / {row.cold_p99_us:.0f} us",
            f"{row.plain_p50_us:.0f} us",
            f"{row.sha256_p50_us:.0f} / {row.sha256_p99_us:.0f} us",
            f"{row.p50_us / row.sha256_p50_us:.2f}x",
            f"{row.cold_p50_us / row.sha256_p50_us:.2f}x",
        )
    out.print(table)
    out.print(
        "p50/p99: a prefix this replica looked up recently (chain steps from the memo); cold: "
        "the memo emptied first, every block hashed and remembered; no memo: hash_memo_entries=0"
    )
    out.print("target: 2,000 tokens <= 100 us p50")
    m = report.materialize
    if m is not None:
        table = Table(
            title=f"materialize {m.prefix_tokens:,} tokens T1 -> {m.device} "
            f"({m.layout}, {m.num_bytes / 2**20:.0f} MiB, {m.num_runs} run(s))"
        )
        for col in ("path", "time", "GB/s", "vs one raw copy"):
            table.add_column(col, justify="right")
        gb = m.num_bytes / 1e9
        table.add_row(
            "one raw torch copy (reference)",
            f"{m.raw_copy_s * 1e3:.1f} ms",
            f"{gb / m.raw_copy_s:.2f}",
            "1.00x",
        )
        table.add_row(
            "materialize: one copy per run",
            f"{m.materialize_s * 1e3:.1f} ms",
            f"{gb / m.materialize_s:.2f}",
            f"{m.materialize_ratio:.2f}x (target >= 0.8)",
        )
        table.add_row(
            "promotion T1 -> T0 pool, per run",
            f"{m.promote_s * 1e3:.1f} ms",
            f"{gb / m.promote_s:.2f}",
            f"{m.promote_ratio:.2f}x",
        )
        table.add_row(
            "per-block copy loop",
            f"{m.per_block_s * 1e3:.1f} ms",
            f"{gb / m.per_block_s:.2f}",
            f"{m.per_block_ratio:.2f}x",
        )
        table.add_row(
            "TP4 rank 0 (strided, 1/4 of bytes)",
            f"{m.tp4_gather_s * 1e3:.1f} ms",
            f"{gb / 4 / m.tp4_gather_s:.2f}",
            f"{m.tp4_ratio:.2f}x per byte",
        )
        out.print(table)
    out.print(
        f"metadata per indexed block: {report.metadata_bytes_per_block:.0f} B "
        f"({report.metadata_num_blocks:,} blocks; target <= 256 B); chain memo: "
        f"{report.memo_bytes_per_step:.0f} B per step, "
        f"{report.memo_bytes_per_step * report.memo_max_steps / 2**20:.1f} MiB full "
        f"({report.memo_max_steps:,} steps, fixed)"
    )
    table = Table(
        title=f"token hit rate, {report.num_trace_requests:,} requests of "
        f"{Path(report.trace).name}, {report.num_trace_unique_blocks:,} unique "
        f"blocks"
    )
    for col in (
        "capacity",
        "LRU",
        "kvfleet",
        "kvfleet / LRU",
        "popularity oracle",
        "Belady",
        "infinite",
        "request hit rate LRU / kvfleet",
    ):
        table.add_column(col, justify="right")
    for r in report.hit_rates:
        table.add_row(
            f"{r.capacity_fraction:.0%} ({r.capacity_blocks:,} blocks)",
            f"{r.lru:.2%}",
            f"{r.kvfleet:.2%}",
            f"{r.kvfleet_vs_lru:.2f}x",
            f"{r.popularity_oracle:.2%}",
            f"{r.belady:.2%}",
            f"{r.infinite:.2%}",
            f"{r.lru_request_rate:.1%} / {r.kvfleet_request_rate:.1%}",
        )
    out.print(table)
    out.print(
        "popularity oracle: not online; ranks blocks by their whole-trace request counts, known in "
        "advance (the ceiling of ranking by frequency)"
    )
    scope = "whole trace" if full else f"first {requests:,} requests; --full for the whole trace"
    out.print(
        f"targets: kvfleet never below LRU; >= 1.5x LRU at 1%. ({scope}; "
        f"{report.seconds:.0f} s in all)"
    )
