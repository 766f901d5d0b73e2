"""PNG plots of `kvfleet simulate` reports (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvfleet_lab.simulate import (
    CoverageReport,
    RolloutReport,
    WhatIfReport,
)
from kvfleet_runtime.breakeven import GB


def write_plots(reports: Mapping[str, Any], out: Path) -> list[Path]:
    written = []
    for report in reports.values():
        if isinstance(report, CoverageReport):
            written.append(_coverage(report, out / "coverage.png"))
        elif isinstance(report, RolloutReport):
            written.append(_rollout(report, out / "rollout_ttft.png"))
        elif isinstance(report, WhatIfReport):
            written.append(_what_if(report, out / "what_if.png"))
    return written


def _coverage(report: CoverageReport, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [run.policy for run in report.runs]
    values = [run.metrics.template_hit_rate * 100 for run in report.runs]
    bars = ax.bar(names, values, color=["#c44e52", "#dd8452", "#4c72b0"][: len(names)])
    ax.bar_label(bars, fmt="%.1f%%")
    ax.axhline(
        report.figures.host_coverage * 100,
        color="grey",
        ls="--",
        label=f"closed form, random: {report.figures.host_coverage:.1%}",
    )
    ax.set_ylim(0, 110)
    ax.set_ylabel("reusable prefixes found in the replica's cache (%)")
    ax.set_title(
        f"Coverage: {len(report.runs)} routing policies, "
        f"{report.home_slice.mean_tenants:.0f} tenants/replica home slice"
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rollout(report: RolloutReport, path: Path) -> Path:
    fig, (ax_ttft, ax_hit) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    colours = ["#c44e52", "#dd8452", "#4c72b0"]
    for run, colour in zip(report.runs, colours, strict=False):
        minutes = [w.start_s / 60 for w in run.windows]
        ax_ttft.plot(minutes, [w.ttft_p99_s for w in run.windows], color=colour, label=run.name)
        ax_hit.plot(minutes, [w.hit_rate * 100 for w in run.windows], color=colour, label=run.name)
    ax_ttft.axhline(
        report.ttft_slo_s,
        color="black",
        ls="--",
        lw=1,
        label=f"TTFT p99 objective {report.ttft_slo_s:g} s",
    )
    ax_ttft.set_yscale("log")
    # Room above the curves for the legend.
    top = max((w.ttft_p99_s for run in report.runs for w in run.windows), default=1.0)
    ax_ttft.set_ylim(top=max(top, report.ttft_slo_s) * 30)
    ax_ttft.set_ylabel(f"TTFT p99 per {report.window_s:g} s window (s)")
    ax_ttft.set_title("Weights rollout on a fleet sized for its warm cache")
    ax_ttft.legend(loc="upper left", ncol=2, fontsize="small")
    ax_hit.set_ylabel("hit rate (%)")
    ax_hit.set_xlabel("simulated time (min)")
    ax_hit.set_ylim(0, 100)
    for ax in (ax_ttft, ax_hit):
        ax.axvline(report.rollout_at_s / 60, color="grey", lw=1, ls=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _what_if(report: WhatIfReport, path: Path) -> Path:
    fig, (ax_saved, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [run.name for run in report.runs]
    saved = [run.metrics.replicas_saved for run in report.runs]
    p99 = [run.metrics.ttft_p99_s * 1e3 for run in report.runs]
    bars = ax_saved.barh(names, saved, color="#4c72b0")
    ax_saved.bar_label(bars, fmt="%.2f")
    ax_saved.set_xlabel("replicas of prefill compute saved")
    ax_saved.invert_yaxis()
    ax_saved.margins(x=0.15)  # room for the labels
    bars = ax_ttft.barh(names, p99, color="#dd8452")
    ax_ttft.bar_label(bars, fmt="%.0f ms")
    ax_ttft.set_xlabel("TTFT p99 (ms)")
    ax_ttft.invert_yaxis()
    ax_ttft.margins(x=0.15)
    ax_ttft.set_yticklabels([])
    sf = report.shared_fetch
    fig.suptitle(
        f"What-ifs · NVMe shared by {sf.num_concurrent} fetches: "
        f"{sf.effective_bytes_per_s / GB:.2f} GB/s each (break-even "
        f"{sf.break_even_bytes_per_s / GB:.2f} GB/s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
