"""The `kvfleet` command line. Each subcommand lives in its own module of this package.

Installed distributions add their own commands through the `kvfleet.commands` entry points
(`_installed.py`): the lab's `bench`, `demo` and `simulate` come that way, so this package
names none of them.

Bad input exits with code 2 and one line on stderr, never a traceback (`fail` in `_app.py`).
"""

from __future__ import annotations

from kvfleet_runtime.cli._app import app
from kvfleet_runtime.cli._installed import add_commands, add_installed_commands

__all__ = ["add_commands", "add_installed_commands", "app", "main"]


def main() -> None:
    add_installed_commands(app)
    app()


# Subcommands register themselves on `app` when imported.
from kvfleet_runtime.cli import breakeven as _breakeven  # noqa: E402, F401
from kvfleet_runtime.cli import epp as _epp  # noqa: E402, F401
from kvfleet_runtime.cli import model as _model  # noqa: E402, F401
from kvfleet_runtime.cli import router as _router  # noqa: E402, F401
from kvfleet_runtime.cli import serve_replica as _serve_replica  # noqa: E402, F401
