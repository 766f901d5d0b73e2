"""The lab's `kvfleet` commands: `kvfleet bench ...`, `kvfleet demo` and `kvfleet simulate`.

Each lives in its own module of this package and registers on `commands`, the object the lab
distribution's `kvfleet.commands` entry point names (lab/pyproject.toml): where the lab is
installed, `kvfleet` adds it to the product's own commands, and a product-only install has none
of them. Where the lab is only on PYTHONPATH (vLLM's environments install neither distribution),
`python -m kvfleet_lab.cli` is the same `kvfleet` with the lab's commands.
"""

from __future__ import annotations

import typer

from kvfleet_lab.cli._commands import commands
from kvfleet_runtime.cli import add_commands, app

__all__ = ["commands", "kvfleet_app", "main"]


def kvfleet_app() -> typer.Typer:
    """The product's `kvfleet` app with the lab's commands on it (added once per process)."""
    add_commands(app, commands)
    return app


def main() -> None:
    kvfleet_app()()


# Commands register themselves on `commands` when imported.
from kvfleet_lab.cli import bench_cache as _bench_cache  # noqa: E402, F401
from kvfleet_lab.cli import bench_fleet as _bench_fleet  # noqa: E402, F401
from kvfleet_lab.cli import bench_nvme as _bench_nvme  # noqa: E402, F401
from kvfleet_lab.cli import bench_operator as _bench_operator  # noqa: E402, F401
from kvfleet_lab.cli import bench_policies as _bench_policies  # noqa: E402, F401
from kvfleet_lab.cli import bench_replica as _bench  # noqa: E402, F401
from kvfleet_lab.cli import bench_scale as _bench_scale  # noqa: E402, F401
from kvfleet_lab.cli import bench_soak as _bench_soak  # noqa: E402, F401
from kvfleet_lab.cli import bench_startup as _bench_startup  # noqa: E402, F401
from kvfleet_lab.cli import bench_vllm as _bench_vllm  # noqa: E402, F401
from kvfleet_lab.cli import benchmarks as _benchmarks  # noqa: E402, F401
from kvfleet_lab.cli import demo as _demo  # noqa: E402, F401
from kvfleet_lab.cli import simulate as _simulate  # noqa: E402, F401
