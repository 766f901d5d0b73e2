"""`kvfleet bench replica`: the engine next to transformers and the cache next to its floor.

(The `bench` group itself and `bench all` are in `cli.benchmarks`.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_lab.cli.benchmarks import bench
from kvfleet_runtime.cli._app import fail

__all__ = ["replica"]


def _int_list(text: str, option: str, minimum: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        fail(f"{option} takes comma-separated integers >= {minimum}, got {text!r}")
    return values


@bench.command("replica")
def replica(
    model_dir: Annotated[Path | None, typer.Option(
        help="Checkpoint to measure; default: a generated one of --preset.")] = None,
    preset: Annotated[str, typer.Option(
        help="Preset to generate when no --model-dir (its context raised to fit the longest "
        "prompt).")] = "small",
    prefill_tokens: Annotated[str, typer.Option(
        help="Prompt lengths for full prefill vs transformers.")] = "512,2000,8000",
    prompt_tokens: Annotated[int, typer.Option(
        help="Prompt length for the hit, suffix and deterministic figures.")] = 2000,
    concurrency: Annotated[str, typer.Option(
        help="Concurrencies for decode throughput.")] = "1,8,32",
    decode_tokens: Annotated[int, typer.Option(
        help="Tokens each request generates in the decode figures.")] = 32,
    reps: Annotated[int, typer.Option(help="Runs per figure (median).")] = 3,
    max_tokens_per_step: Annotated[int | None, typer.Option(
        help="The engine's token budget per step (default: the engine's).")] = None,
    attn_impl: Annotated[str, typer.Option(
        help="The engine's attention: sdpa (as transformers' baseline) or eager.")] = "sdpa",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    cpu_threads: Annotated[int, typer.Option(
        help="torch intra-op threads on CPU (0: torch's default).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """The engine next to transformers and the cache next to its physical floor: prefill TTFT,
    T0/T1 hit TTFT vs the suffix alone, the T1 copy vs a raw copy, decode tok/s, the
    deterministic mode's price, cached blocks beside an in-flight load, the cost of a miss."""
    import torch

    from kvfleet_lab.engine.bench import run_replica_bench
    from kvfleet_runtime.model import default_device

    lengths = _int_list(prefill_tokens, "--prefill-tokens", 1)
    concurrencies = _int_list(concurrency, "--concurrency", 1)
    if prompt_tokens < 32 or reps < 1 or decode_tokens < 1:
        fail("--prompt-tokens must be >= 32 and --reps, --decode-tokens >= 1")
    if attn_impl not in ("sdpa", "eager"):
        fail(f"--attn-impl must be sdpa or eager, got {attn_impl!r}")
    if device not in ("auto", "cpu", "cuda"):
        fail(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: CUDA is not available here")
    dev = default_device() if device == "auto" else torch.device(device)
    if dev.type == "cpu" and cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    try:
        report = run_replica_bench(model_dir=model_dir, preset=preset, prefill_tokens=lengths,
                                   prompt_tokens=prompt_tokens, reps=reps,
                                   concurrencies=concurrencies, decode_new_tokens=decode_tokens,
                                   device=dev, attn_impl=attn_impl,
                                   max_tokens_per_step=max_tokens_per_step)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))  # raw: no console wrapping
        return
    _print_replica(report)


def _print_replica(report: Any) -> None:
    r = report
    ms = 1e3
    threads = f", {r.cpu_threads} CPU thread(s)" if r.device == "cpu" else ""
    table = Table(title=f"kvfleet bench replica — {r.model} on {r.device}{threads}; "
                  f"attention {r.attn_impl}, {r.max_tokens_per_step} tokens per step")
    table.add_column("measure")
    table.add_column("kvfleet", justify="right")
    table.add_column("baseline", justify="right")
    table.add_column("ratio / note", justify="right")
    for p in r.prefill:
        table.add_row(f"TTFT, full prefill of {p.tokens:,} tokens",
                      f"{p.ttft_full_prefill_s * ms:.1f} ms",
                      f"{p.transformers_prefill_s * ms:.1f} ms",
                      f"{p.ratio:.2f}x transformers' forward (target <= 1.2)")
    n = r.prompt_tokens
    suffix = f"{r.suffix_prefill_s * ms:.1f} ms"
    table.add_row(f"TTFT {n:,} tokens, T0 hit ({r.cached_tokens_t0:,} cached)",
                  f"{r.ttft_t0_hit_s * ms:.1f} ms", suffix,
                  f"{r.t0_vs_suffix:.2f}x the suffix alone (target <= 1.2)")
    table.add_row(f"TTFT {n:,} tokens, T0 hit vs its floor", f"{r.ttft_t0_hit_s * ms:.1f} ms",
                  f"{r.suffix_at_position_s * ms:.1f} ms",
                  f"{r.t0_vs_suffix_at_position:.2f}x the suffix at its position, prefix "
                  "resident (target <= 1.1)")
    table.add_row(f"TTFT {n:,} tokens, T1 hit ({r.cached_tokens_t1:,} cached)",
                  f"{r.ttft_t1_hit_s * ms:.1f} ms", suffix,
                  f"{r.t1_vs_suffix:.2f}x the suffix alone (target <= 1.2)")
    gbps = r.t1_copy_bytes / 1e9
    table.add_row(f"T1 copy of {r.t1_copy_bytes / 2**20:.1f} MiB into the engine's blocks",
                  f"{gbps / r.t1_copy_s:.2f} GB/s", f"{gbps / r.raw_copy_s:.2f} GB/s raw copy",
                  f"{r.t1_copy_vs_raw:.2f}x raw (target >= 0.8)")
    for d in r.decode:
        table.add_row(f"decode, {d.concurrency} concurrent, {r.decode_new_tokens} tokens each",
                      f"{d.decode_tok_s:.1f} tok/s", f"{d.transformers_decode_tok_s:.1f} tok/s",
                      f"{d.ratio:.2f}x generate; with cache {d.decode_cache_tok_s:.1f} tok/s"
                      + (f"; {d.graphs_speedup:.2f}x uncaptured" if d.graphs_speedup else ""))
    table.add_row(f"deterministic: TTFT, full prefill of {n:,} tokens",
                  f"{r.deterministic_ttft_s * ms:.1f} ms",
                  f"{r.ttft_full_prefill_s * ms:.1f} ms fast",
                  f"{r.deterministic_ttft_price:.2f}x the fast path's")
    table.add_row(f"deterministic: decode, {r.deterministic_concurrency} concurrent",
                  f"{r.deterministic_tok_s:.1f} tok/s", f"{r.fast_tok_s:.1f} tok/s fast",
                  f"{r.deterministic_tok_s_price:.2f}x fewer tokens/s")
    table.add_row(f"cached blocks beside {r.inflight_requests} in-flight hits "
                  f"({r.inflight_blocks:,} blocks) in {r.kv_budget_blocks:,}",
                  f"{r.cached_blocks_shared:,} (T0 = engine KV)",
                  f"{r.cached_blocks_doubled:,} (T0 doubled)",
                  f"+{r.inflight_prefix_blocks:,} with one pool (the engine's since #17)")
    table.add_row("miss: lookup + store on the request path",
                  f"{(r.miss_lookup_s + r.miss_store_path_s) * ms:.3f} ms",
                  f"{r.prefill_s * ms:.1f} ms prefill",
                  f"{r.miss_overhead_fraction:.2%} of prefill (target < 1%)")
    table.add_row("store copy into the pool (background)", f"{r.store_drain_s * ms:.3f} ms", "",
                  f"{r.store_drain_s / r.prefill_s:.2%} of prefill, off the path")
    out = Console(highlight=False, width=200)
    out.print(table)
    out.print(f"median of {r.reps} runs each; `kvfleet bench replica --json` for raw figures")
