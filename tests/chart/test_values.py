"""The chart's values: every key commented, a draft-07 schema that refuses unknown keys in our
blocks, and every CI scenario valid against it. These need no helm."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from tests.chart.conftest import CHART, CI_VALUES

VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"

# Kubernetes types passed through as they are (PodSecurityContext, Affinity, a volume source...):
# their schema is Kubernetes', not ours, so they stay open.
OPEN_KUBERNETES_BLOCKS = {
    "podSecurityContext", "securityContext", "affinity", "volume", "updateStrategy",
}


def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


def _values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def _keys_with_lines(node: yaml.Node, path: str = "") -> Iterator[tuple[str, int]]:
    """(dotted path, 0-based line) of every mapping key in values.yaml, outside open blocks."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        dotted = f"{path}.{key_node.value}" if path else key_node.value
        yield dotted, key_node.start_mark.line
        if key_node.value not in OPEN_KUBERNETES_BLOCKS:
            yield from _keys_with_lines(value_node, dotted)


def test_every_value_is_commented() -> None:
    lines = VALUES.read_text().splitlines()
    root = yaml.compose(VALUES.read_text())
    uncommented = []
    for dotted, line in _keys_with_lines(root):
        above = lines[line - 1].strip() if line > 0 else ""
        if not above.startswith("#") and "#" not in lines[line]:
            uncommented.append(dotted)
    assert not uncommented, f"values without a comment: {uncommented}"


def test_schema_is_valid_draft_07() -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)


def _object_schemas(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            yield path or "<root>", node
        for key, value in node.get("properties", {}).items():
            yield from _object_schemas(value, f"{path}.{key}" if path else key)


def test_our_blocks_refuse_unknown_keys() -> None:
    blocks = dict(_object_schemas(_schema()))
    assert "<root>" in blocks and "replica.model" in blocks
    open_blocks = [p for p, s in blocks.items() if s.get("additionalProperties") is not False]
    assert not open_blocks, f"blocks that accept unknown keys: {open_blocks}"


def _value_paths(node: Any, path: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            dotted = f"{path}.{key}" if path else key
            yield dotted
            if key not in OPEN_KUBERNETES_BLOCKS and key not in {"tenants", "labels"}:
                yield from _value_paths(value, dotted)


def _schema_has(schema: dict[str, Any], dotted: str) -> bool:
    node: Any = schema
    for part in dotted.split("."):
        props = node.get("properties")
        if props is None:
            return True  # a free-form map (labels, annotations, nodeSelector)
        if part not in props:
            return False
        node = props[part]
    return True


def test_schema_describes_every_value_and_no_more() -> None:
    schema = _schema()
    values = _values()
    missing = [p for p in _value_paths(values) if not _schema_has(schema, p)]
    assert not missing, f"values.yaml keys the schema does not know: {missing}"
    assert set(schema["properties"]) == set(values), "top-level keys differ"


def test_defaults_are_valid() -> None:
    jsonschema.validate(_values(), _schema(), cls=jsonschema.Draft7Validator)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


CI_FILES = sorted(p.name for p in CI_VALUES.glob("*-values.yaml"))


def test_ci_scenarios_exist() -> None:
    assert {"default-values.yaml", "external-redis-values.yaml", "monitoring-values.yaml"} <= set(
        CI_FILES
    )


@pytest.mark.parametrize("name", CI_FILES)
def test_ci_scenario_is_valid(name: str) -> None:
    merged = _merge(_values(), yaml.safe_load((CI_VALUES / name).read_text()) or {})
    jsonschema.validate(merged, _schema(), cls=jsonschema.Draft7Validator)


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ({"replica": {"gpus": 1}}, "a typo of replica.gpu"),
        ({"redis": {"bundled": {"enabled": True}, "external": {"url": "redis://r:6379/0"}}},
         "bundled and external Redis at once"),
        ({"replica": {"model": {"weightsDigest": "v2"}}}, "a tag instead of a digest"),
        ({"monitoring": {"create": "yes"}}, "create is auto, always or never"),
        ({"monitoring": {"hitRateAlert": {"threshold": 1.5}}}, "a hit rate is at most 1"),
        ({"router": {"apiKeys": {"tenants": {"__platform__": ["k"]}}}}, "the reserved tenant"),
    ],
)
def test_schema_refuses(override: dict[str, Any], why: str) -> None:
    merged = _merge(_values(), override)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged, _schema(), cls=jsonschema.Draft7Validator)


def test_labels_are_written_only_by_the_helpers() -> None:
    """No template spells a standard label itself: names, selectors, versions in one place."""
    offenders = [
        str(path.relative_to(CHART))
        for path in sorted((CHART / "templates").rglob("*.yaml"))
        if re.search(r"app\.kubernetes\.io/|helm\.sh/chart", path.read_text())
    ]
    assert not offenders, offenders
