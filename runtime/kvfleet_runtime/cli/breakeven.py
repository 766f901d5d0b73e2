"""`kvfleet breakeven`: which cache tiers beat recomputing, for a model on given hardware."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvfleet_runtime.breakeven import (
    DEFAULT_BATCH_SLACK,
    DEFAULT_MEDIA,
    GB,
    GPUS,
    MEDIA,
    MODELS,
    TFLOPS,
    BreakEvenPlan,
    GpuProfile,
    KVDtype,
    ModelProfile,
    load_hf_config,
    lookup_profile,
    plan,
)
from kvfleet_runtime.cli._app import app, fail
from kvfleet_runtime.units import format_bytes_binary, format_seconds, significant

REFERENCE_TP = 4
REFERENCE_PREFIX_TOKENS = 2000


def _positive(name: str, value: float | None) -> None:
    if value is not None and (math.isnan(value) or math.isinf(value) or value <= 0):
        fail(f"{name} must be a positive finite number, got {value}")


def _parse_bandwidths(items: list[str]) -> dict[str, float]:
    """`NAME=GBPS` pairs: measured bandwidths replacing the profiles' figures."""
    overrides: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            fail(f"--bandwidth expects MEDIUM=GB/s (e.g. nvme-gen4=6.2), got {item!r}")
        lookup_profile("medium", MEDIA, name)
        try:
            gbps = float(value)
        except ValueError:
            fail(f"--bandwidth {name}: {value!r} is not a number of GB/s")
        _positive(f"--bandwidth {name}", gbps)
        overrides[name.strip().lower()] = gbps * GB
    return overrides


def _resolve_model(model: str, model_config: Path | None, params: float | None) -> ModelProfile:
    if model_config is not None:
        return load_hf_config(model_config, params)
    profile = lookup_profile("model", MODELS, model)
    if params is None:
        return profile
    return ModelProfile(
        profile.name,
        profile.num_layers,
        profile.num_kv_heads,
        profile.head_dim,
        params,
        profile.mla,
        profile.description,
    )


def _resolve_gpu(gpu: str, gpu_tflops: float | None) -> GpuProfile:
    profile = lookup_profile("GPU", GPUS, gpu)
    if gpu_tflops is None:
        return profile
    return GpuProfile(
        f"{profile.name}@{gpu_tflops:g}TF",
        gpu_tflops * TFLOPS,
        profile.hbm_bandwidth_bytes_per_s,
        f"{gpu_tflops:g} TFLOP/s dense (given), HBM of {profile.name}",
    )


@app.command()
def breakeven(
    model: Annotated[
        str, typer.Option(help=f"Model profile: {', '.join(MODELS)}.")
    ] = "reference-70b",
    model_config: Annotated[
        Path | None, typer.Option(help="A Hugging Face config.json to read the model from.")
    ] = None,
    params: Annotated[
        float | None, typer.Option(help="Parameters per token's forward pass (overrides).")
    ] = None,
    kv_dtype: Annotated[str, typer.Option(help="KV dtype: fp32, bf16, fp16, fp8.")] = "fp16",
    gpu: Annotated[str, typer.Option(help=f"GPU profile: {', '.join(GPUS)}.")] = "h100",
    gpu_tflops: Annotated[
        float | None, typer.Option(help="Dense TFLOP/s per GPU, replacing the profile's.")
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree of a replica.")] = REFERENCE_TP,
    prefix_tokens: Annotated[
        int, typer.Option(help="Prefix length in tokens.")
    ] = REFERENCE_PREFIX_TOKENS,
    media: Annotated[
        str, typer.Option(help=f"Comma-separated media to judge, of: {', '.join(MEDIA)}.")
    ] = ",".join(DEFAULT_MEDIA),
    bandwidth: Annotated[
        list[str] | None,
        typer.Option(help="Measured bandwidth MEDIUM=GB/s (repeatable), e.g. nvme-gen4=6.2."),
    ] = None,
    batch_slack: Annotated[
        float, typer.Option(help="How many times the recompute time a batch fetch may take.")
    ] = DEFAULT_BATCH_SLACK,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Fetch or recompute? KV size, recompute cost, break-even bandwidth, per-tier verdicts."""
    _positive("--params", params)
    _positive("--gpu-tflops", gpu_tflops)
    _positive("--batch-slack", batch_slack)
    try:
        media_names = [m.strip().lower() for m in media.split(",") if m.strip()]
        if not media_names:
            fail("--media names no medium")
        for name in media_names:
            lookup_profile("medium", MEDIA, name)
        result = plan(
            _resolve_model(model, model_config, params),
            KVDtype.parse(kv_dtype),
            _resolve_gpu(gpu, gpu_tflops),
            tp,
            prefix_tokens,
            media_names,
            _parse_bandwidths(bandwidth or []),
            batch_slack,
        )
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, Console(highlight=False))


def _gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GB:,.2f} GB/s"


def render(result: BreakEvenPlan, console: Console) -> None:
    m = result.model
    heads = f"MLA latent {m.mla.elements_per_layer}" if m.mla else f"{m.num_kv_heads} KV heads"
    console.print(
        f"[bold]{m.name}[/] ({m.num_layers} layers, {heads}, head_dim {m.head_dim}, "
        f"{m.num_params / 1e9:g}B params/token) · KV {result.kv_dtype.value} · "
        f"{result.gpu.name} {result.gpu.dense_flops / TFLOPS:g} TFLOP/s dense · "
        f"TP{result.tp_degree} · prefix {result.prefix_tokens:,} tokens"
    )
    summary = Table(show_header=False, box=None, padding=(0, 2))
    summary.add_row(
        "KV per token",
        f"{result.kv_bytes_per_token:,} B = {format_bytes_binary(result.kv_bytes_per_token)}",
    )
    summary.add_row(
        f"KV of the {result.prefix_tokens:,}-token prefix",
        format_bytes_binary(result.prefix_kv_bytes),
    )
    summary.add_row("recompute per token", format_seconds(result.recompute_s_per_token, "us"))
    summary.add_row(
        f"recompute the prefix (TP{result.tp_degree})",
        f"{format_seconds(result.recompute_prefix_s, 'ms')} = "
        f"{result.recompute_prefix_gpu_s * 1e3:,.1f} GPU-ms",
    )
    summary.add_row(
        "break-even bandwidth",
        f"[bold]{_gbps(result.break_even_bytes_per_s)}[/] (prefix length cancels)",
    )
    console.print(summary)

    sweep = Table(title="Recompute and break-even by TP degree", title_justify="left")
    sweep.add_column("TP", justify="right")
    sweep.add_column("recompute / token", justify="right")
    sweep.add_column("break-even BW", justify="right")
    for point in result.tp_sweep:
        sweep.add_row(
            str(point.tp_degree),
            format_seconds(point.recompute_s_per_token, "us"),
            _gbps(point.break_even_bytes_per_s),
        )
    console.print(sweep)

    tiers = Table(
        title=f"Media against the TP{result.tp_degree} break-even "
        f"(fetch of {format_bytes_binary(result.prefix_kv_bytes)})",
        title_justify="left",
    )
    for column in (
        "tier",
        "medium",
        "bandwidth",
        "fetch",
        "margin",
        "latency rule",
        "capacity rule (GPU-ms)",
        "verdict",
    ):
        tiers.add_column(
            column, justify="right" if column in {"bandwidth", "fetch", "margin"} else "left"
        )
    for t in result.tiers:
        tiers.add_row(
            t.medium.tier,
            t.medium.description,
            _gbps(t.medium.bandwidth_bytes_per_s),
            format_seconds(t.fetch_s, "ms"),
            f"{significant(t.margin, 2)}x",
            "fetch < recompute" if t.helps_latency else "fetch > recompute",
            f"{t.fetch_gpu_s * 1e3:g} vs {t.recompute_gpu_s * 1e3:,.1f}",
            _verdict_style(t.verdict.value),
        )
    console.print(tiers)
    console.print(
        f"[dim]build: passes the latency rule · batch only: saves GPU-seconds but is slower than "
        f"recompute (within {result.batch_slack:g}x) · never: slower than {result.batch_slack:g}x "
        f"recompute[/]"
    )
    if result.levers:
        levers = Table(title="Levers", title_justify="left")
        levers.add_column("lever")
        levers.add_column("break-even BW", justify="right")
        levers.add_column("vs now", justify="right")
        levers.add_column("verdicts that change")
        for lever in result.levers:
            flips = ", ".join(f"{name}: {a.value} -> {b.value}" for name, a, b in lever.flips)
            levers.add_row(
                lever.description,
                _gbps(lever.break_even_bytes_per_s),
                f"{significant(lever.break_even_ratio, 2)}x",
                flips or "none",
            )
        console.print(levers)


def _verdict_style(verdict: str) -> str:
    colour = {"build": "green", "batch only": "yellow", "never": "red"}[verdict]
    return f"[{colour}]{verdict}[/]"
