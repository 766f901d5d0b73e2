"""Every default the docs state for a setting the code defines is the code's own default.

The docs name a setting in backticks and state its default close by (`` `admit_min_sightings`,
default 1 ``, `` `CacheTuning.hash_memo_entries`, default 32,768 ``). This reads every such
statement in docs/ and README.md, finds the setting among the config records (the cache's
`CacheTuning`, the replica's settings, the fleet config) and compares the number. A statement
whose name is not a setting, or is one with different defaults in different records and no
qualifier saying which, is left alone.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]

# `name` (dotted allowed), then within the same clause "default" and a number.
_STATEMENT = re.compile(
    r"`(?P<name>[A-Za-z_][\w.]*)`(?P<gap>[^`.;|\n]{0,40}?)\bdefaults?\b[:=]?\s*(?:is\s+)?"
    r"(?P<value>\d[\d,_]*(?:\.\d+)?)(?![\w.])"
)


def _records() -> dict[str, Any]:
    """Qualifier -> a config record (a dataclass instance or a pydantic model class)."""
    from kvfleet_runtime.cache import CacheTuning
    from kvfleet_runtime.config.fleet import FleetConfig
    from kvfleet_runtime.server import CacheSettings, EngineSettings, Limits, ReplicaConfig

    records: dict[str, Any] = {
        "CacheTuning": CacheTuning(num_t0_blocks=1),
        "cache": CacheSettings,
        "engine": EngineSettings,
        "limits": Limits,
        "replica": ReplicaConfig,
        "fleet": FleetConfig,
    }
    for name, field in FleetConfig.model_fields.items():  # tiers.*, admission.*, ...
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            records[name] = annotation
    return records


def _defaults(record: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(record):
        return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return {name: f.default for name, f in record.model_fields.items()}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def stated_defaults(texts: Iterable[tuple[str, str]], records: dict[str, Any]
                    ) -> tuple[list[str], list[str]]:
    """(statements tied to a code default and equal to it, those that differ), as
    "file:line `name` default N (code: M)"."""
    defaults = {q: _defaults(r) for q, r in records.items()}
    agreed: list[str] = []
    wrong: list[str] = []
    for source, text in texts:
        for match in _STATEMENT.finditer(text):
            *qualifiers, field = match["name"].split(".")
            if qualifiers and qualifiers[-1] in defaults:
                candidates = [defaults[qualifiers[-1]]]
            elif qualifiers:
                continue  # qualified by something that is not a config record
            else:
                candidates = list(defaults.values())
            values = {_number(d[field]) for d in candidates if field in d} - {None}
            if len(values) != 1:
                continue
            (code,) = values
            stated = float(match["value"].replace(",", "").replace("_", ""))
            line = text.count("\n", 0, match.start()) + 1
            where = f"{source}:{line} `{match['name']}` default {match['value']} (code: {code:g})"
            (agreed if stated == code else wrong).append(where)
    return agreed, wrong


def _docs() -> list[tuple[str, str]]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in paths]


def test_the_docs_state_the_codes_defaults() -> None:
    agreed, wrong = stated_defaults(_docs(), _records())
    assert wrong == []
    assert len(agreed) >= 3, f"the scan ties almost nothing to the code: {agreed}"


@pytest.mark.parametrize(
    ("doc", "ok"),
    [
        ("Admission (`admit_min_sightings`, default 1) stores on first sight.", True),
        ("Admission (`admit_min_sightings`, default 2) stores on the second.", False),
        ("The memo (`CacheTuning.hash_memo_entries`, default 32,768 steps)", True),
        ("The memo (`CacheTuning.hash_memo_entries`, default 16,384 steps)", False),
        ("`cache.admit_min_sightings` (default 3)", False),
    ],
)
def test_the_scan_would_catch_a_stale_default(doc: str, ok: bool) -> None:
    agreed, wrong = stated_defaults([("planted.md", doc)], _records())
    assert (agreed, wrong) != ([], [])  # the statement was read
    assert (wrong == []) is ok, wrong


def test_the_demo_plot_title_says_the_shipped_admission() -> None:
    from kvfleet_lab.demo._plots import admission_words
    from kvfleet_runtime.cache import CacheTuning

    shipped = CacheTuning(num_t0_blocks=1).admit_min_sightings
    assert admission_words() == admission_words(shipped)
    assert admission_words(1) == "stored on first sighting"
    assert admission_words(2) == "stored from sighting 2"
