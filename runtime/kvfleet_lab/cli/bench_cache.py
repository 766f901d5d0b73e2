"""`kvfleet bench cache`: the cache core's figures side by side (`kvfleet_lab.cache.bench`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_lab.cli.benchmarks import TRACE_HELP, bench, default_trace, trace_path
from kvfleet_runtime.cli._app import fail

if TYPE_CHECKING:
    from kvfleet_lab.cache.bench import CacheBenchReport, MaterializeBandwidth, RequestCpu

__all__ = ["cache"]

QUICK_REQUESTS = 2000


@bench.command("cache")
def cache(
    trace: Annotated[str | None, typer.Option(help=TRACE_HELP, metavar="NAME|PATH")] = None,
    requests: Annotated[
        int, typer.Option(help="Replay the first N requests of the trace (the quick run).")
    ] = QUICK_REQUESTS,
    full: Annotated[
        bool, typer.Option("--full", help="Replay the whole trace (several minutes on 2 cores).")
    ] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (materialize target).")] = "auto",
    lookup_reps: Annotated[int, typer.Option(help="Lookups per prompt size.")] = 200,
    materialize_reps: Annotated[int, typer.Option(help="Copies per bandwidth figure.")] = 5,
    request_reps: Annotated[
        int, typer.Option(help="Requests per round of the request-CPU figure (3 rounds).")
    ] = 400,
    index_blocks: Annotated[
        int, typer.Option(help="Blocks in the index of the lookup and request-CPU figures.")
    ] = 100_000,
    only: Annotated[
        str | None,
        typer.Option(help="Comma-separated sections to run (lookup, request-cpu, materialize, "
                     "metadata, hit-rates); default: all."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Lookup latency, the cache's CPU per request beside vLLM's KVCacheManager, materialize
    bandwidth, metadata per block and trace hit rates vs LRU, Belady and the infinite cache."""
    import torch

    from kvfleet_lab.cache.bench import SECTIONS, run_cache_bench

    sections = SECTIONS if only is None else tuple(s.strip() for s in only.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        fail(f"--only: unknown section(s) {', '.join(unknown) or '(none given)'}; "
             f"known: {', '.join(SECTIONS)}")
    path = trace_path(trace) if "hit-rates" in sections else default_trace()
    if min(requests, lookup_reps, materialize_reps, request_reps, index_blocks) < 1:
        fail("--requests, --lookup-reps, --materialize-reps, --request-reps and --index-blocks "
             "must be >= 1")
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
            request_cpu_reps=request_reps,
            index_blocks=index_blocks,
            sections=sections,
        )
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    out = Console(highlight=False)
    if report.lookup:
        _print_lookup(out, report)
    r = report.request_cpu
    if r is not None:
        _print_request_cpu(out, r)
    m = report.materialize
    if m is not None:
        _print_materialize(out, m)
    if "metadata" in sections:
        out.print(
            f"metadata per indexed block: {report.metadata_bytes_per_block:.0f} B "
            f"({report.metadata_num_blocks:,} blocks; target <= 256 B); chain memo: "
            f"{report.memo_bytes_per_step:.0f} B per step, "
            f"{report.memo_bytes_per_step * report.memo_max_steps / 2**20:.1f} MiB full "
            f"({report.memo_max_steps:,} steps, fixed)"
        )
    if report.hit_rates:
        _print_hit_rates(out, report, full=full, requests=requests)


def _print_request_cpu(out: Console, r: RequestCpu) -> None:
    table = Table(
        title=f"the cache's CPU per request, {r.prompt_tokens:,}-token prompt, index of "
        f"{r.num_index_blocks:,} blocks ({r.num_requests:,} requests per figure)"
    )
    for col in ("request", "kvfleet", "vLLM KVCacheManager", "kvfleet / vLLM"):
        table.add_column(col, justify="right")
    for name, ours, theirs, ratio in (
        ("hit", r.request_cpu_hit_s, r.vllm_request_cpu_hit_s, r.hit_ratio),
        ("miss, evicting", r.request_cpu_miss_s, r.vllm_request_cpu_miss_s, r.miss_ratio),
    ):
        table.add_row(
            name,
            f"{ours * 1e6:.0f} us",
            "-" if theirs is None else f"{theirs * 1e6:.0f} us",
            "-" if ratio is None else f"{ratio:.2f}x (target <= 1.0)",
        )
    out.print(table)
    if r.vllm_absent_reason:
        out.print(f"vLLM's figures absent: {r.vllm_absent_reason} (run it in the vLLM "
                  "environment: scripts/vllm-env.sh)")
    else:
        out.print(f"vLLM {r.vllm_version}: SHA-256 block hashes, get_computed_blocks, "
                  "allocate_slots (caching the full blocks), free; kvfleet: the engine's "
                  "prepare / fill / finish with the shipped ghosts, events to one listener")


def _print_lookup(out: Console, report: CacheBenchReport) -> None:
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


def _print_materialize(out: Console, m: MaterializeBandwidth) -> None:
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


def _print_hit_rates(out: Console, report: CacheBenchReport, *, full: bool, requests: int) -> None:
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
