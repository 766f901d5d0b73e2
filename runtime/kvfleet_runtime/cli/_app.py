"""The Typer application shared by the subcommand modules, and the one way to fail on bad input."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import typer
from rich.console import Console

app = typer.Typer(
    name="kvfleet",
    help="Cache-aware LLM inference fleets: plan, run and measure prefix-KV reuse.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Plain help: paragraphs re-wrapped at word boundaries to the terminal, no `<bool>` type
    # column on every flag, nothing cut at 80 columns when piped.
    rich_markup_mode=None,
)
# Piped or redirected, rich lays tables out for 80 columns and cuts figures ("120,1…"): give it
# more than any table needs. Set before the commands' modules create their Consoles.
PIPED_COLUMNS = "200"
if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
    os.environ["COLUMNS"] = PIPED_COLUMNS

stderr = Console(stderr=True, highlight=False, soft_wrap=True)

USAGE_ERROR_EXIT_CODE = 2


def fail(message: str) -> NoReturn:
    """Report bad input as one line on stderr and exit 2, without a traceback."""
    stderr.print(f"error: {message}", markup=False)
    raise typer.Exit(code=USAGE_ERROR_EXIT_CODE)


@app.callback()
def _root() -> None:
    """Cache-aware LLM inference fleets: plan, run and measure prefix-KV reuse."""
