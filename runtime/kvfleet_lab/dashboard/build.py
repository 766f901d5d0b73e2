"""The dashboard JSON, built from `panels.PANELS` with grafana-foundation-sdk's builders (Grafana's
own dashboard schema as typed Python models), and the check that a JSON document is a valid
dashboard under that schema.

    python -m kvfleet_lab.dashboard.build            # write DASHBOARD_JSON
    python -m kvfleet_lab.dashboard.build --check    # exit 1 when it differs from what is built
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model

from kvfleet_lab.dashboard.panels import PANELS, VARIABLES, Panel

__all__ = ["DASHBOARD_JSON", "UID", "build_dashboard", "dashboard_json", "main", "schema_errors"]

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD_JSON = ROOT / "charts" / "kvfleet" / "dashboards" / "kvfleet.json"
UID = "kvfleet-fleet"
_DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
_WIDTH = 24
_PANEL_WIDTH = 12
_PANEL_HEIGHT = 8


def _panel(panel: Panel) -> Any:
    builder: Any = (statetimeline.Panel() if panel.kind == "state" else timeseries.Panel())
    builder = (builder.title(panel.title).description(panel.description).unit(panel.unit)
               .datasource(_DATASOURCE).height(_PANEL_HEIGHT).span(_PANEL_WIDTH))
    if panel.kind == "timeseries" and panel.unit == "percentunit":
        builder = builder.min(0).max(1)
    if panel.mappings:
        builder = builder.mappings([model.ValueMap(options={
            value: model.ValueMappingResult(text=text, color="green" if text == "on" else "red")
            for value, text in panel.mappings.items()})])
    for i, target in enumerate(panel.targets):
        builder = builder.with_target(
            prometheus.Dataquery().expr(target.expr).legend_format(target.legend)
            .ref_id(chr(ord("A") + i)).range())
    return builder


def build_dashboard() -> model.Dashboard:
    board = (
        db.Dashboard("kvfleet: cache-aware fleet")
        .uid(UID)
        .description("Hit rates per tier and tenant, TTFT with and without a hit, prefill saved, "
                     "T2 traffic, evictions, routing and the ModelRollout gate; metrics of "
                     "kvfleet's replicas and router (charts/kvfleet, docs/operator.md).")
        .tags(["kvfleet", "llm", "kv-cache"])
        .editable()
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            db.QueryVariable("namespace").label("Namespace").datasource(_DATASOURCE)
            .query("label_values(kvfleet_replica_prompt_tokens_total, namespace)")
            .include_all(True).all_value(VARIABLES["namespace"]).multi(True)
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED))
        .with_variable(
            db.TextBoxVariable("gate_percent").label("Rollout recoveryPercent")
            .default_value(VARIABLES["gate_percent"])
            .description("The ModelRollout's gate.recoveryPercent (default 90)."))
    )
    rows: dict[str, list[Panel]] = {}
    for panel in PANELS:
        rows.setdefault(panel.row, []).append(panel)
    for row, panels in rows.items():
        board = board.with_row(db.Row(row))
        for panel in panels:
            board = board.with_panel(_panel(panel))
    return board.build()


def dashboard_json() -> str:
    """The dashboard as the chart ships it (sorted keys, two-space indent, a final newline)."""
    return json.dumps(build_dashboard(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def _walk(value: Any, hint: Any, path: str, errors: list[str]) -> None:
    """Check `value` against the SDK model type `hint` (Grafana's schema as the SDK types it)."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return
    if origin is typing.Union:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return
        present = [o for o in options if o is not type(None)]
        if len(present) == 1:  # Optional[X]: X's own, more precise, errors
            _walk(value, present[0], path, errors)
            return
        trials = []
        for option in options:
            if option is type(None):
                continue
            sub: list[str] = []
            _walk(value, option, path, sub)
            if not sub:
                return
            trials.append(sub)
        errors.append(f"{path}: {value!r} matches none of {hint}")
        return
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            errors.append(f"{path}: {value!r} not one of {typing.get_args(hint)}")
        return
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        (item,) = typing.get_args(hint) or (Any,)
        for i, v in enumerate(value):
            _walk(v, item, f"{path}[{i}]", errors)
        return
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        args = typing.get_args(hint)
        for k, v in value.items():
            _walk(v, args[1] if args else Any, f"{path}.{k}", errors)
        return
    if isinstance(hint, type):
        if hasattr(hint, "__members__"):  # an enum of the schema (string or integer values)
            if value not in [m.value for m in hint]:  # type: ignore[attr-defined]
                errors.append(f"{path}: {value!r} not a {hint.__name__}")
        elif issubclass(hint, bool):
            if not isinstance(value, bool):
                errors.append(f"{path}: expected a boolean, got {value!r}")
        elif issubclass(hint, int | float) and not issubclass(hint, bool):
            if isinstance(value, bool) or not isinstance(value, int | float):
                errors.append(f"{path}: expected a number, got {value!r}")
        elif hint is str:
            if not isinstance(value, str):
                errors.append(f"{path}: expected a string, got {value!r}")
        elif hasattr(hint, "from_json"):
            _walk_model(value, hint, path, errors)


# `"fieldConfig": self.field_config,` and `payload["id"] = self.id_val` in a generated `to_json`.
_FIELD = re.compile(r'"(\w+)"\]?\s*[:=]\s*self\.(\w+)')


def _json_names(cls: type) -> dict[str, str]:
    """JSON field name -> attribute name of an SDK model (`type` is `type_val`, `fieldConfig`
    is `field_config`, `auto_count` stays), read from the model's generated `to_json`: the
    schema's own names, whatever the generator renamed."""
    return dict(_FIELD.findall(inspect.getsource(cls.to_json)))  # type: ignore[attr-defined]


def _walk_model(value: Any, cls: type, path: str, errors: list[str]) -> None:
    if not isinstance(value, dict):
        errors.append(f"{path}: expected an object ({cls.__name__}), got {type(value).__name__}")
        return
    hints = typing.get_type_hints(cls)
    names = _json_names(cls)
    for key, item in value.items():
        attr = names.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: not a field of {cls.__name__}")
        elif cls is model.Dashboard and key == "panels" and isinstance(item, list):
            for i, panel in enumerate(item):  # the schema's union, decoded by `type`
                kind = model.RowPanel if isinstance(panel, dict) and panel.get("type") == "row" \
                    else model.Panel
                _walk_model(panel, kind, f"{path}.panels[{i}]", errors)
        else:
            _walk(item, hints[attr], f"{path}.{key}", errors)


def schema_errors(document: dict[str, Any]) -> list[str]:
    """Where `document` breaks Grafana's dashboard schema as grafana-foundation-sdk types it: an
    unknown field, a wrong type, a value outside an enum; and every panel's `type` names a
    panel plugin the SDK knows (its options and field config checked against that plugin's
    models). Empty when it is valid."""
    errors: list[str] = []
    _walk_model(document, model.Dashboard, "$", errors)
    for i, panel in enumerate(document.get("panels", [])):
        if panel.get("type") == "row":
            continue
        plugin = {"timeseries": "timeseries", "state-timeline": "statetimeline"}.get(
            panel.get("type", ""))
        if plugin is None:
            errors.append(f"$.panels[{i}].type: {panel.get('type')!r} is no panel this checks")
            continue
        module = __import__(f"grafana_foundation_sdk.models.{plugin}", fromlist=["Options"])
        if panel.get("options") is not None:
            _walk_model(panel["options"], module.Options, f"$.panels[{i}].options", errors)
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
        if custom is not None:
            _walk_model(custom, module.FieldConfig, f"$.panels[{i}].fieldConfig.defaults.custom",
                        errors)
        for j, target in enumerate(panel.get("targets", [])):
            _walk_model(target, __import__("grafana_foundation_sdk.models.prometheus",
                                           fromlist=["Dataquery"]).Dataquery,
                        f"$.panels[{i}].targets[{j}]", errors)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_lab.dashboard.build",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the committed JSON is not what the code builds")
    parser.add_argument("--out", type=Path, default=DASHBOARD_JSON)
    args = parser.parse_args(argv)
    text = dashboard_json()
    errors = schema_errors(json.loads(text))
    if errors:
        sys.stderr.write("the built dashboard breaks Grafana's schema:\n  " + "\n  ".join(errors))
        return 1
    if args.check:
        if not args.out.is_file() or args.out.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{args.out} is not what kvfleet_lab.dashboard.build makes; run "
                             "`python -m kvfleet_lab.dashboard.build`\n")
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    sys.stdout.write(f"wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
