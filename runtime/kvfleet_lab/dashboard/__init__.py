"""The chart's Grafana dashboard, as code: its panels and PromQL (`panels`), the dashboard JSON
built from Grafana's own typed models (`build`, grafana-foundation-sdk), a fleet on loopback that
a real Prometheus scrapes so every panel's query can be run (`live`), and the panels drawn from
that Prometheus with matplotlib (`screenshot`, the picture in docs/operator.md).

    python -m kvfleet_lab.dashboard.build            # charts/kvfleet/dashboards/kvfleet.json
    python -m kvfleet_lab.dashboard.build --check    # exit 1 when the committed JSON differs
    python -m kvfleet_lab.dashboard.screenshot --out docs/images/dashboard.png
"""

from kvfleet_lab.dashboard.panels import PANELS, ROWS, VARIABLES, Panel, Target, render_expr

__all__ = ["PANELS", "ROWS", "VARIABLES", "Panel", "Target", "render_expr"]
