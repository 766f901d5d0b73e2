"""The Typer application shared by the subcommand modules, and the one way to fail on bad input."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

app = typer.Typer(
    name="kvfleet",
    help="Cache-aware LLM inference fleets: plan, run and measure prefix-KV reuse.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

stderr = Console(stderr=True, highlight=False, soft_wrap=True)

USAGE_ERROR_EXIT_CODE = 2


def fail(message: str) -> NoReturn:
    """Report bad input as one line on stderr and exit 2, without a traceback."""
    stderr.print(f"error: {message}", markup=False)
    raise typer.Exit(code=USAGE_ERROR_EXIT_CODE)


@app.callback()
def _root() -> None:
    """Cache-aware LLM inference fleets: plan, run and measure prefix-KV reuse."""
