"""The `kvfleet` command line. Each subcommand lives in its own module of this package.

Bad input exits with code 2 and one line on stderr, never a traceback (`fail` in `_app.py`).
"""

from __future__ import annotations

from kvfleet_runtime.cli._app import app

__all__ = ["app", "main"]


def main() -> None:
    app()


# Subcommands register themselves on `app` when imported.
from kvfleet_runtime.cli import bench_cache as _bench_cache  # noqa: E402, F401
from kvfleet_runtime.cli import bench_fleet as _bench_fleet  # noqa: E402, F401
from kvfleet_runtime.cli import bench_nvme as _bench_nvme  # noqa: E402, F401
from kvfleet_runtime.cli import bench_operator as _bench_operator  # noqa: E402, F401
from kvfleet_runtime.cli import bench_policies as _bench_policies  # noqa: E402, F401
from kvfleet_runtime.cli import bench_replica as _bench  # noqa: E402, F401
from kvfleet_runtime.cli import bench_scale as _bench_scale  # noqa: E402, F401
from kvfleet_runtime.cli import bench_soak as _bench_soak  # noqa: E402, F401
from kvfleet_runtime.cli import bench_startup as _bench_startup  # noqa: E402, F401
from kvfleet_runtime.cli import bench_vllm as _bench_vllm  # noqa: E402, F401
from kvfleet_runtime.cli import benchmarks as _benchmarks  # noqa: E402, F401
from kvfleet_runtime.cli import breakeven as _breakeven  # noqa: E402, F401
from kvfleet_runtime.cli import demo as _demo  # noqa: E402, F401
from kvfleet_runtime.cli import epp as _epp  # noqa: E402, F401
from kvfleet_runtime.cli import model as _model  # noqa: E402, F401
from kvfleet_runtime.cli import router as _router  # noqa: E402, F401
from kvfleet_runtime.cli import serve_replica as _serve_replica  # noqa: E402, F401
from kvfleet_runtime.cli import simulate as _simulate  # noqa: E402, F401
