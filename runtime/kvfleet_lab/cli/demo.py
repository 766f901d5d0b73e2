"""`kvfleet demo`: a router and 3 replica processes on this machine, driven, measured, reported."""

from __future__ import annotations

import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvfleet_lab.cli._commands import commands
from kvfleet_runtime.cli._app import fail

__all__ = ["demo"]

INTERRUPTED_EXIT_CODE = 130
DEFAULT_OUT = Path("kvfleet-demo-out")
DEFAULT_TRACE_BLOCK_TOKENS = 16


class _LiveProgress:
    """The live display: one bar per run, with the hit rate and TTFT so far."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self._task: TaskID | None = None
        self._prompt = self._cached = self._errors = 0
        self._ttft_ms: list[float] = []

    def status(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def phase(self, name: str, total: int) -> None:
        self._prompt = self._cached = self._errors = 0
        self._ttft_ms = []
        self._task = self.progress.add_task(name, total=total, stats="")

    def result(self, result: object) -> None:
        from kvfleet_lab.demo import RequestResult, percentile

        assert isinstance(result, RequestResult) and self._task is not None
        if result.ok:
            self._prompt += result.prompt_tokens
            self._cached += result.cached_tokens
            self._ttft_ms.append(result.ttft_s * 1e3)
        else:
            self._errors += 1
        hit = self._cached / self._prompt if self._prompt else 0.0
        stats = (f"hit {hit:5.1%}  TTFT p50 {percentile(self._ttft_ms, 50):6.0f} ms"
                 if self._ttft_ms else "")
        if self._errors:
            stats += f"  errors {self._errors}"
        self.progress.update(self._task, advance=1, stats=stats)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@commands.command()
def demo(
    workload: Annotated[str, typer.Option(
        help="Built-in workload: mixed, system-prompts, rag or conversations.")] = "mixed",
    trace: Annotated[str | None, typer.Option(
        metavar="NAME|PATH",
        help="A trace to replay instead of a built-in workload: a vendored one by name "
        "(synthetic, conversation) or a Mooncake-format JSONL file (.gz read compressed).")]
        = None,
    requests: Annotated[int | None, typer.Option(
        help="Requests per run (default 120; --quick 36; --trace: about N, whole prefix trees).")]
        = None,
    tenants: Annotated[int | None, typer.Option(
        help="Tenants, each with its own API key (default 4; --quick 2).")] = None,
    scale: Annotated[float | None, typer.Option(
        help="Multiplies the design's prompt lengths (default 0.2; --quick 0.1).")] = None,
    trace_block_tokens: Annotated[int, typer.Option(
        help="Tokens per 512-token trace block (a multiple of 16).")]
        = DEFAULT_TRACE_BLOCK_TOKENS,
    concurrency: Annotated[int, typer.Option(help="Requests in flight.")] = 4,
    kv_blocks: Annotated[int, typer.Option(
        help="Working KV blocks (16 tokens) per replica; fewer make busy homes spill.")] = 512,
    out: Annotated[Path, typer.Option(help="Folder for report.json, plots and logs.")]
        = DEFAULT_OUT,
    redis_url: Annotated[str | None, typer.Option(
        help="Shared hint index (redis://...): T2 between replicas and the cache-aware "
        "override. Default: each process's embedded index.")] = None,
    model_dir: Annotated[Path | None, typer.Option(
        help="Checkpoint to serve (default: a generated 'small' model, cached).")] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 1,
    quick: Annotated[bool, typer.Option(help="A short run (tests, smoke checks).")] = False,
) -> None:
    """Run a cache-aware fleet on this machine; measure it against a cache-off run."""
    from kvfleet_lab.demo import (
        DemoOptions,
        FleetError,
        WorkloadSpec,
        builtin_workload,
        render_report,
        run_demo,
        trace_workload,
    )
    from kvfleet_lab.traces import resolve_trace

    num_requests = requests if requests is not None else (36 if quick else 120)
    length_scale = scale if scale is not None else (0.1 if quick else 0.2)
    num_tenants = tenants if tenants is not None else (2 if quick else 4)
    if num_requests < 1:
        fail(f"--requests must be >= 1, got {num_requests}")
    if not 1 <= num_tenants <= 1000:
        fail(f"--tenants must be in [1, 1000], got {num_tenants}")
    if not 0 < length_scale <= 1:
        fail(f"--scale must be in (0, 1], got {length_scale}")
    if not 64 <= kv_blocks <= 65536:
        fail(f"--kv-blocks must be in [64, 65536], got {kv_blocks}")
    if not 1 <= concurrency <= 64:
        fail(f"--concurrency must be in [1, 64], got {concurrency}")
    if redis_url is not None and not redis_url.startswith(("redis://", "rediss://", "unix://")):
        fail(f"--redis-url must start with redis://, rediss:// or unix://, got {redis_url!r}")
    if model_dir is not None and not (model_dir / "config.json").is_file():
        fail(f"--model-dir {model_dir} has no config.json")
    try:
        if trace is not None:
            wl = trace_workload(resolve_trace(trace), num_requests=num_requests,
                                num_tenants=num_tenants, block_tokens=trace_block_tokens,
                                max_prompt_tokens=2000)
        else:
            wl = builtin_workload(workload, WorkloadSpec(
                num_requests=num_requests, num_tenants=num_tenants, scale=length_scale, seed=seed))
    except ValueError as exc:
        fail(str(exc))

    longest = max(len(r.token_ids) for r in wl.requests)
    if kv_blocks * 16 < longest + 1:
        fail(f"--kv-blocks {kv_blocks} ({kv_blocks * 16} tokens) cannot hold the workload's "
             f"longest prompt ({longest} tokens)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--out {out}: cannot create the folder: {exc.strerror or exc}")
    console = Console(highlight=False)
    live = _LiveProgress(console)
    command = "kvfleet " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    options = DemoOptions(out=out.resolve(), concurrency=concurrency, redis_url=redis_url,
                          model_dir=model_dir, command=command, num_kv_blocks=kv_blocks)
    console.print(f"kvfleet demo: {wl.description}; {wl.num_prompt_tokens:,} prompt tokens "
                  "per run, run twice (no cache, then cache)", markup=False)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    try:
        with live.progress:
            report = run_demo(wl, options, live)
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted: the fleet's processes were stopped",
                                   markup=False)
        raise typer.Exit(code=INTERRUPTED_EXIT_CODE) from None
    except FleetError as exc:
        Console(stderr=True).print(f"error: {exc}", markup=False)
        raise typer.Exit(code=1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    console.print()
    for line in render_report(report):
        console.print(line, markup=False)
    console.print(f"\nreport   {options.out / 'report.json'}", markup=False)
    for plot in report["plots"]:
        console.print(f"plot     {plot}", markup=False)
    console.print(f"done in {time.monotonic() - started:.0f} s", markup=False)
    for line in next_steps():
        console.print(line, markup=False)


def next_steps() -> list[str]:
    """What to try after the demo, and how to reach the commands it names: `make demo` runs
    kvfleet from the checkout's environment, which is not on the PATH."""
    lines = []
    bin_dir = Path(sys.executable).parent
    if shutil.which("kvfleet") != str(bin_dir / "kvfleet"):
        lines.append(f'commands `kvfleet` and `kvfleet-operator`: export PATH="{bin_dir}:$PATH"')
    lines.append("next     kvfleet breakeven (fetch or recompute, for your model and GPUs); "
                 "kvfleet simulate all (44 replicas); make demo-cluster (the operator, a "
                 "rollout and its rollback on a local control plane); docs/quickstart.md")
    return lines
