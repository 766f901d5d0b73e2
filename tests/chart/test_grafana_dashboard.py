"""The chart's Grafana dashboard: opt-in, a ConfigMap the sidecar finds by its label, carrying
exactly the JSON the lab builds (kvfleet_lab.dashboard.build) and a valid dashboard under
Grafana's schema as grafana-foundation-sdk types it."""

from __future__ import annotations

import json

import pytest

from kvfleet_lab.dashboard.build import DASHBOARD_JSON, UID, dashboard_json, schema_errors
from kvfleet_lab.dashboard.panels import PANELS
from tests.chart.conftest import NAMESPACE, RELEASE, Render

DEFAULT = "default-values.yaml"
MONITORING = "monitoring-values.yaml"
CONFIGMAP = f"{RELEASE}-dashboard"


def test_the_dashboard_is_opt_in(render: Render) -> None:
    assert CONFIGMAP not in [o["metadata"]["name"] for o in render(DEFAULT).of_kind("ConfigMap")]


def test_the_configmap_carries_the_sidecar_label_and_the_built_json(render: Render) -> None:
    cm = render(MONITORING).get("ConfigMap", CONFIGMAP)
    assert cm["metadata"]["namespace"] == NAMESPACE
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "kvfleet"}
    assert cm["metadata"]["labels"]["app.kubernetes.io/component"] == "monitoring"
    assert cm["data"]["kvfleet.json"] + "\n" == DASHBOARD_JSON.read_text(encoding="utf-8")
    board = json.loads(cm["data"]["kvfleet.json"])
    assert board["uid"] == UID


def test_label_namespace_and_value_follow_the_values(render: Render) -> None:
    cm = render(DEFAULT, set=["monitoring.grafanaDashboard.enabled=true",
                              "monitoring.grafanaDashboard.label=grafana_dash",
                              "monitoring.grafanaDashboard.labelValue=kvfleet",
                              "monitoring.grafanaDashboard.namespace=grafana"]).get(
        "ConfigMap", CONFIGMAP)
    assert cm["metadata"]["labels"]["grafana_dash"] == "kvfleet"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "grafana"


def test_the_committed_json_is_what_the_lab_builds() -> None:
    """Edit kvfleet_lab/dashboard/panels.py, then `python -m kvfleet_lab.dashboard.build`."""
    assert DASHBOARD_JSON.read_text(encoding="utf-8") == dashboard_json()


def test_the_committed_json_is_a_valid_grafana_dashboard() -> None:
    board = json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))
    assert schema_errors(board) == []
    titles = [p["title"] for p in board["panels"] if p["type"] != "row"]
    assert titles == [p.title for p in PANELS]
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])


@pytest.mark.parametrize(
    ("break_it", "why"),
    [
        (lambda b: b["panels"][1].update(bogus=1), "a field the schema does not have"),
        (lambda b: b.update(graphTooltip=7), "a value outside an enum"),
        (lambda b: b["panels"][1]["targets"][0].update(refId=3), "a number for a string"),
        (lambda b: b["panels"][1]["fieldConfig"]["defaults"].update(unitx="s"), "a typo"),
        (lambda b: b["templating"]["list"][0].update(hide=9), "a variable's hide out of range"),
    ],
)
def test_the_schema_check_refuses(break_it: object, why: str) -> None:
    board = json.loads(dashboard_json())
    break_it(board)  # type: ignore[operator]
    assert schema_errors(board), why


@pytest.mark.parametrize(
    "override",
    [
        {"enabled": "yes"},
        {"label": "grafana dashboard"},
        {"labelValue": "x" * 64},
        {"folder": "kvfleet"},
    ],
    ids=["not-a-boolean", "not-a-label-key", "label-value-too-long", "unknown-key"],
)
def test_the_schema_refuses_bad_dashboard_values(override: dict[str, object]) -> None:
    import jsonschema
    import yaml

    from tests.chart.conftest import CHART

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["monitoring"]["grafanaDashboard"].update(override)
    schema = json.loads((CHART / "values.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, schema, cls=jsonschema.Draft7Validator)
