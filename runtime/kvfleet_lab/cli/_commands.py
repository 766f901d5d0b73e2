"""The one Typer the lab's command modules register on; `kvfleet` merges it into its own app."""

from __future__ import annotations

import typer

# No name and no callback: added to the product's app, its commands and groups join the top
# level (`kvfleet bench ...`, `kvfleet demo`, `kvfleet simulate`), with the app's settings.
commands = typer.Typer()
