"""PNG plots of the `kvfleet bench policies` comparison (matplotlib, Agg backend: no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvfleet_lab.cache.compare import PolicyComparison

__all__ = ["write_policy_plots"]

_STYLE = {
    "vllm": ("vLLM (hash + LRU)", "#dd8452", "o", "-"),
    "radix": ("radix + LRU (SGLang)", "#55a868", "s", "-"),
    "s3fifo": ("S3-FIFO", "#c44e52", "v", "-."),
    "sieve": ("SIEVE", "#937860", "P", "-."),
    "kvfleet": ("kvfleet", "#4c72b0", "D", "-"),
    "belady": ("Belady (offline optimum)", "#8172b3", "^", "--"),
    "infinite": ("infinite cache", "#444444", "", ":"),
}


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return -(-n // cols), cols


def write_policy_plots(report: PolicyComparison, out: Path) -> list[Path]:
    return [_hit_rates(report, out / "policies.png"), _ratios(report, out / "ratios.png")]


def _hit_rates(report: PolicyComparison, path: Path) -> Path:
    rows, cols = _grid(len(report.workloads))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, w in zip(axes.flat, report.workloads, strict=False):
        x = [r.capacity_fraction * 100 for r in w.rows]
        for policy, (label, color, marker, line) in _STYLE.items():
            y = [r.rate(policy) * 100 for r in w.rows]
            ax.plot(x, y, line, color=color, marker=marker or None, label=label)
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v:g}%" for v in x])
        ax.minorticks_off()
        ax.set_ylim(0, 100)
        ax.set_title(f"{w.name} ({w.num_requests:,} requests)")
        ax.set_xlabel("capacity, % of the workload's unique blocks")
        ax.set_ylabel("token hit rate, %")
        ax.grid(alpha=0.3)
    return _finish(fig, axes, len(report.workloads), path,
                   "Prefix-cache token hit rate by policy, same requests, same capacity", 0.05)


def _ratios(report: PolicyComparison, path: Path) -> Path:
    rows, cols = _grid(len(report.workloads))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, w in zip(axes.flat, report.workloads, strict=False):
        x = [r.capacity_fraction * 100 for r in w.rows]
        for policy in ("vllm", "radix", "s3fifo", "sieve", "belady"):
            label, color, marker, line = _STYLE[policy]
            y = [r.kvfleet_vs(policy) for r in w.rows]
            ax.plot(
                x,
                [v if v is not None else float("nan") for v in y],
                line,
                color=color,
                marker=marker,
                label=f"kvfleet / {label}",
            )
        ax.axhline(1.0, color="#444444", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v:g}%" for v in x])
        ax.minorticks_off()
        ax.set_title(w.name)
        ax.set_xlabel("capacity, % of unique blocks")
        ax.set_ylabel("ratio of token hit rates")
        ax.grid(alpha=0.3)
    return _finish(fig, axes, len(report.workloads), path,
                   "kvfleet's hit rate over each baseline's (above 1: kvfleet hits more)", 0.06)


def _finish(fig: Any, axes: Any, num_panels: int, path: Path, title: str, legend_room: float
            ) -> Path:
    """Blank the unused panels, one legend below the grid, the title; write and close."""
    for ax in list(axes.flat)[num_panels:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, legend_room, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
