"""User docs give today's results, not the project's history: no issue numbers in the README,
the chart's README and docs/ (the lab notes, `docs/lab-notes.md`, are where history lives)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"\b[Ii]ssues? \d+|(?<![\w&])#\d+\b")
"""`issue 31`, `issues 41/42`, `#31`; not an HTML entity or a URL fragment."""
LAB_NOTES = ROOT / "docs" / "lab-notes.md"


def user_docs() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "charts" / "kvfleet" / "README.md"]
    return docs + sorted(p for p in (ROOT / "docs").rglob("*.md") if p != LAB_NOTES)


def test_user_docs_name_no_issue_numbers() -> None:
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
            for p in user_docs() for i, line in enumerate(p.read_text().splitlines(), 1)
            if HISTORY.search(line)]
    assert not hits, "say what was done, not which issue did it:\n" + "\n".join(hits)


def test_the_pattern_finds_what_it_must() -> None:
    assert HISTORY.search("the floor (issue 31)") and HISTORY.search("see #45")
    assert not HISTORY.search("`#!/usr/bin/env`") and not HISTORY.search("&#8212;")
