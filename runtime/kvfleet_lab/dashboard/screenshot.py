"""The dashboard's panels drawn with matplotlib from a real Prometheus (Grafana itself is not to
be had here): a live fleet on loopback (`live.LiveDashboard`) serves the demo's workload in
several rounds, then every panel's queries are asked over the run as range queries, exactly as
Grafana sends them, and drawn in the dashboard's layout (two panels a row, the rows in order).

    python -m kvfleet_lab.dashboard.screenshot --out docs/images/dashboard.png
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfleet_lab.dashboard.live import NAMESPACE, LiveDashboard
from kvfleet_lab.dashboard.panels import PANELS, Panel, render_expr

__all__ = ["draw", "main"]

_PERCENT_UNITS = {"percentunit"}


def _legend(template: str, metric: dict[str, str]) -> str:
    out = template.replace("$gate_percent", "90")
    for key, value in metric.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def draw(series: dict[str, list[tuple[str, list[tuple[float, float]]]]], out: Path,
         subtitle: str) -> Path:
    """`series`: panel title -> [(legend, [(t_s, value)])]; one subplot per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.0 * rows), squeeze=False)
    fig.patch.set_facecolor("#181b1f")
    t0 = min((pts[0][0] for lines in series.values() for _, pts in lines if pts), default=0.0)
    for ax, panel in zip(axes.flat, PANELS, strict=False):
        ax.set_facecolor("#111217")
        ax.set_title(f"{panel.row} · {panel.title}", color="#d8d9da", fontsize=10, loc="left")
        ax.tick_params(colors="#8e8e8e", labelsize=8)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        for legend, pts in series.get(panel.title, []):
            if not pts:
                continue
            xs = [t - t0 for t, _ in pts]
            ys = [v * 100 if panel.unit in _PERCENT_UNITS else v for _, v in pts]
            if panel.kind == "state":
                ax.step(xs, ys, where="post", label=legend, linewidth=1.5)
            else:
                ax.plot(xs, ys, label=legend, linewidth=1.3,
                        linestyle="--" if legend.startswith("gate") else "-")
        _axis_labels(ax, panel)
        ax.legend(fontsize=7, loc="upper left", facecolor="#181b1f", labelcolor="#d8d9da",
                  edgecolor="#2c3235")
    for ax in list(axes.flat)[len(PANELS):]:
        ax.set_visible(False)
    fig.suptitle(f"kvfleet: cache-aware fleet — {subtitle}", color="#d8d9da", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)
    return out


def _axis_labels(ax: Any, panel: Panel) -> None:
    units = {"percentunit": "%", "s": "seconds", "Bps": "bytes/s", "reqps": "requests/s",
             "short": "per second" if panel.kind == "timeseries" else ""}
    if panel.kind == "state":
        ax.set_yticks([0, 1], ["off", "on"])
        ax.set_ylim(-0.2, 1.2)
    else:
        ax.set_ylabel(units.get(panel.unit, ""), color="#8e8e8e", fontsize=8)
    ax.set_xlabel("seconds into the run", color="#8e8e8e", fontsize=8)


def collect(live: LiveDashboard, start_s: float, end_s: float
            ) -> dict[str, list[tuple[str, list[tuple[float, float]]]]]:
    out: dict[str, list[tuple[str, list[tuple[float, float]]]]] = {}
    for panel in PANELS:
        lines = out.setdefault(panel.title, [])
        for target in panel.targets:
            expr = render_expr(target.expr, {"namespace": NAMESPACE}, "30s")
            for s in live.query_range(expr, start_s, end_s):
                pts = [(float(t), float(v)) for t, v in s["values"] if math.isfinite(float(v))]
                lines.append((_legend(target.legend, s["metric"]), pts))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_lab.dashboard.screenshot",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/images/dashboard.png"))
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds of the workload, a pause between them")
    parser.add_argument("--pause-s", type=float, default=10.0)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvfleet-dashboard-"))
    with LiveDashboard(work) as live:
        start = time.time()
        ok = 0
        for i in range(args.rounds):
            ok += live.drive(rounds=1)
            if i + 1 < args.rounds:
                time.sleep(args.pause_s)
        end = time.time()
        series = collect(live, start - 5, end)
    subtitle = (f"{ok} requests through kvfleet router + 3 replicas on loopback, "
                f"Prometheus scraping every 1 s ({time.strftime('%Y-%m-%d', time.gmtime())})")
    path = draw(series, args.out, subtitle)
    sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
