"""Every measured figure in docs/benchmarks.md, and in the README's sections that name a
benchmark command, carries the date it was measured and the command that reproduces it.

A figure is a number with a result's unit (a ratio `1.2x`, a percentage, a time, a rate); sizes of
the set-up (`62.5 MiB`, `2,000-token`) are not figures. A stamp is a paragraph with `Measured
YYYY-MM-DD` and a command in backticks (docs/benchmarks.md says how the file is organised). In
each section (any heading level) every paragraph or table with a figure must come at or after a
stamp of that section.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"

FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x|\s?(?:%|ms|us|s|GB/s|tok/s|requests/s|req/s))(?![\w/])")
STAMP = re.compile(r"\bMeasured (\d{4})-(\d{2})-(\d{2})\b")
COMMAND = re.compile(r"`[^`]+`")
BENCH_COMMAND = re.compile(
    r"`(?:make demo|make demo-cluster|kvfleet (?:demo|bench|simulate)|[^`]*kvfleet_lab\.)[^`]*`")


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, paragraphs) of each section; code blocks are one paragraph each."""
    sections: list[tuple[str, list[str]]] = [("(top)", [])]
    paragraph: list[str] = []
    in_code = False

    def flush() -> None:
        if paragraph:
            sections[-1][1].append("\n".join(paragraph))
            paragraph.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            paragraph.append(line)
            if in_code:
                flush()
            in_code = not in_code
            continue
        if not in_code and line.startswith("#"):
            flush()
            sections.append((line.lstrip("#").strip(), []))
        elif not in_code and not line.strip():
            flush()
        else:
            paragraph.append(line)
    flush()
    return sections


def _unstamped(text: str, *, only_bench_sections: bool, skip_top: bool) -> list[str]:
    problems = []
    for i, (heading, paragraphs) in enumerate(_sections(text)):
        if skip_top and i <= 1 and heading in ("(top)", "Benchmarks"):
            continue
        body = "\n".join(paragraphs)
        if only_bench_sections and not BENCH_COMMAND.search(heading + "\n" + body):
            continue
        stamped = False
        for paragraph in paragraphs:
            stamp = STAMP.search(paragraph)
            if stamp and COMMAND.search(paragraph):
                year, month, day = (int(g) for g in stamp.groups())
                assert year >= 2025 and 1 <= month <= 12 and 1 <= day <= 31, stamp.group(0)
                stamped = True
            figure = FIGURE.search(paragraph)
            if figure and not stamped:
                problems.append(f"{heading!r}: {figure.group(0)!r} in {paragraph[:80]!r}...")
    return problems


def test_every_benchmark_figure_has_a_date_and_a_command() -> None:
    problems = _unstamped(BENCHMARKS.read_text(), only_bench_sections=False, skip_top=True)
    assert not problems, "\n".join(problems)


def test_every_readme_figure_of_a_benchmark_has_a_date_and_a_command() -> None:
    problems = _unstamped(README.read_text(), only_bench_sections=True, skip_top=False)
    assert not problems, "\n".join(problems)


def test_benchmarks_has_one_section_per_benchmark_command() -> None:
    headings = [h for h, _ in _sections(BENCHMARKS.read_text())]
    for command in ("kvfleet demo", "kvfleet simulate", "kvfleet bench policies",
                    "kvfleet bench cache", "kvfleet bench replica", "kvfleet bench fleet",
                    "kvfleet bench nvme", "kvfleet bench vllm-connector",
                    "kvfleet bench vllm-serve", "kvfleet bench operator",
                    "kvfleet bench startup"):
        assert sum(f"`{command}`" in h for h in headings) == 1, (command, headings)


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("## `kvfleet bench x`\n\nIt reads 1.2x.\n", True),
        ("## `kvfleet bench x`\n\nMeasured 2026-12-07, box: `kvfleet bench x`.\n\n| a | 1.2x |\n",
         False),
        ("## `kvfleet bench x`\n\n| a | 3.4 ms |\n\nMeasured 2026-12-07: `kvfleet bench x`.\n",
         True),
        ("## `kvfleet bench x`\n\nMeasured 2026-12-07 with no command: 1.2x.\n", True),
        ("## `kvfleet bench x`\n\nA 62.5 MiB run of 2,000 tokens.\n", False),
    ],
)
def test_the_rule(text: str, found: bool) -> None:
    assert bool(_unstamped(text, only_bench_sections=False, skip_top=False)) is found
