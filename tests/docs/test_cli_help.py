"""Help is for people: plain paragraphs re-wrapped at word boundaries, no `<bool>` type column on
every flag, no box drawing."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvfleet_runtime.cli import app


@pytest.mark.parametrize("command", [[], ["demo"], ["breakeven"], ["simulate"], ["bench", "nvme"]])
def test_help_is_plain_text(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "╭" not in result.output, result.output
    assert result.output.startswith("Usage: kvfleet")


def test_simulate_help_says_the_minimum_duration() -> None:
    result = CliRunner().invoke(app, ["simulate", "--help"], terminal_width=100)
    assert "at least 600" in " ".join(result.output.split())
