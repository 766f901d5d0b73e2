"""Help is for people: plain paragraphs re-wrapped at word boundaries, no `<bool>` type column on
every flag, no box drawing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvfleet_lab.cli import kvfleet_app

app = kvfleet_app()


@pytest.mark.parametrize("command", [[], ["demo"], ["breakeven"], ["simulate"], ["bench", "nvme"]])
def test_help_is_plain_text(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "╭" not in result.output, result.output
    assert result.output.startswith("Usage: kvfleet")


def test_simulate_help_says_the_minimum_duration() -> None:
    result = CliRunner().invoke(app, ["simulate", "--help"], terminal_width=100)
    assert "at least 600" in " ".join(result.output.split())


def _command_paths(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command's path under `command` (typer's groups carry their `commands`)."""
    paths = [path]
    if hasattr(command, "commands"):
        for name, sub in sorted(command.commands.items()):
            paths.extend(_command_paths(sub, (*path, name)))
    return paths


_KVFLEET_COMMANDS = _command_paths(typer.main.get_command(app))


def test_the_walk_sees_the_vllm_commands() -> None:
    """The walk below covers what a newcomer types, the commands that re-execute elsewhere too."""
    assert ("bench", "vllm-serve") in _KVFLEET_COMMANDS
    assert ("bench", "vllm-connector") in _KVFLEET_COMMANDS
    assert len(_KVFLEET_COMMANDS) > 15


@pytest.mark.parametrize("path", _KVFLEET_COMMANDS, ids=lambda p: " ".join(p) or "kvfleet")
def test_every_command_answers_help_on_a_fresh_clone(
    path: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh clone has no vLLM environment: `--help` must answer anyway, with exit 0 and the
    command's options, without building or starting anything."""
    monkeypatch.setenv("KVFLEET_HOME", str(tmp_path / "empty-home"))
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not importable here either
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "usage:" in result.output.lower(), result.output
    assert "error" not in result.output.lower().split("usage:")[0], result.output
    assert not (tmp_path / "empty-home").exists(), "help built an environment"


_OPERATOR_COMMANDS = [[], ["run"], ["manifests"]]


@pytest.mark.parametrize("args", _OPERATOR_COMMANDS, ids=lambda a: " ".join(a) or "operator")
def test_every_operator_command_answers_help(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfleet_operator.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvfleet-operator")
