"""Commands other distributions add to `kvfleet` (`kvfleet_runtime.cli._installed`)."""

from __future__ import annotations

import importlib.metadata

import pytest
import typer
from typer.testing import CliRunner

from kvfleet_runtime.cli import add_commands, add_installed_commands


def _app() -> typer.Typer:
    app = typer.Typer(name="kvfleet", no_args_is_help=True)

    @app.command()
    def replica() -> None:
        print("replica")

    return app


def _extra() -> typer.Typer:
    extra = typer.Typer()
    group = typer.Typer(name="bench")

    @group.command("policies")
    def policies() -> None:
        print("policies ran")

    @extra.command()
    def demo() -> None:
        print("demo ran")

    extra.add_typer(group)
    return extra


def test_added_commands_join_the_top_level_once() -> None:
    app, extra = _app(), _extra()
    add_commands(app, extra)
    add_commands(app, extra)  # a second caller in the same process adds nothing
    assert len(app.registered_groups) == 1
    runner = CliRunner()
    assert runner.invoke(app, ["demo"]).output == "demo ran\n"
    assert runner.invoke(app, ["bench", "policies"]).output == "policies ran\n"
    assert runner.invoke(app, ["replica"]).output == "replica\n"


def test_an_entry_point_that_is_no_typer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fault: a distribution whose entry point names something else. `kvfleet` says which.
    bad = importlib.metadata.EntryPoint("broken", "json:dumps", "kvfleet.commands")

    def points(group: str) -> list[importlib.metadata.EntryPoint]:
        return [bad] if group == "kvfleet.commands" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", points)
    with pytest.raises(TypeError, match=r"broken = json:dumps is not a typer\.Typer"):
        add_installed_commands(_app())
