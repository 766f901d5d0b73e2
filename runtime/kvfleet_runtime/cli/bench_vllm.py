"""`kvfleet bench vllm-connector`: the vLLM connector's scheduler-side lookup cost next to vLLM's
own CPU offloading connector, and host-pool copy bandwidth against a raw copy. The code lives
in kvfleet_lab.vllm.bench and runs in vLLM's own environment (vllm pins its own torch), so this
command re-executes it there, or prints the command that builds and runs it."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import typer

from kvfleet_runtime.cli._app import fail
from kvfleet_runtime.cli.benchmarks import bench

__all__ = ["vllm_connector"]

_ROOT = Path(__file__).resolve().parents[3]
_LAB_MODULE = "kvfleet_lab.vllm.bench"


def _vllm_python() -> Path | None:
    """vLLM's env as scripts/vllm-env.sh builds it (keyed by the lock's digest), if built."""
    lock = _ROOT / "requirements-vllm.lock"
    if not lock.is_file():
        return None
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()[:12]
    home = Path(os.environ.get("KVFLEET_HOME", Path.home() / ".cache" / "kvfleet"))
    env = home / "vllm-envs" / digest
    python = env / "bin" / "python"
    return python if (env / ".complete").is_file() and python.is_file() else None


@bench.command("vllm-connector", context_settings={"allow_extra_args": True,
                                                   "ignore_unknown_options": True,
                                                   "help_option_names": []})
def vllm_connector(ctx: typer.Context) -> None:
    """kvfleet's vLLM connector vs vLLM's CPU offloading connector: get_num_new_matched_tokens
    per request (2,000 / 32,000 tokens, hit and miss) and host pool -> vLLM-layout copy
    bandwidth vs a raw copy. Options are the lab's (--sizes, --lookup-reps, --copy-blocks,
    --copy-layers, --copy-heads, --copy-head-dim, --copy-reps, --threads, --json, --help)."""
    args = [str(a) for a in ctx.args]
    pythonpath = os.pathsep.join(str(_ROOT / p) for p in ("runtime", "operator", "."))
    if importlib.util.find_spec("vllm") is not None:
        python = Path(sys.executable)
    else:
        found = _vllm_python()
        if found is None:
            command = (f"cd {shlex.quote(str(_ROOT))} && PYTHONPATH=runtime:operator:. "
                       f'"$(scripts/vllm-env.sh)" -m {_LAB_MODULE} {shlex.join(args)}')
            fail("vLLM's environment is not built here (scripts/vllm-env.sh builds it from "
                 f"requirements-vllm.lock); run:\n  {command.rstrip()}")
        python = found
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = subprocess.run([str(python), "-m", _LAB_MODULE, *args], env=env, check=False)
    raise typer.Exit(code=result.returncode)
