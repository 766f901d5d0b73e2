"""Commands other installed distributions add to `kvfleet`: the `kvfleet.commands` entry points.

The product names none of them. The lab's distribution declares its `bench`, `demo` and
`simulate` in this group; a product-only install has no entry point here, and `kvfleet` is the
product's own commands.
"""

from __future__ import annotations

import typer

__all__ = ["ENTRY_POINT_GROUP", "add_commands", "add_installed_commands"]

ENTRY_POINT_GROUP = "kvfleet.commands"


def add_commands(app: typer.Typer, commands: typer.Typer) -> None:
    """Merge `commands` (an unnamed Typer: its commands and groups join the top level) into
    `app`, once: a second call with the same Typer adds nothing."""
    if any(group.typer_instance is commands for group in app.registered_groups):
        return
    app.add_typer(commands)


def add_installed_commands(app: typer.Typer) -> None:
    """Add each installed `kvfleet.commands` entry point's Typer to `app`, in name order."""
    # Here, not at module level: importing importlib.metadata and reading every installed
    # distribution's entry points costs ~20 ms, paid by `kvfleet` itself, not by every importer
    # of the CLI's modules.
    from importlib.metadata import entry_points

    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        commands = point.load()
        if not isinstance(commands, typer.Typer):
            raise TypeError(f"the {ENTRY_POINT_GROUP} entry point {point.name} = {point.value} "
                            "is not a typer.Typer")
        add_commands(app, commands)
