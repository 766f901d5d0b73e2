"""Two serving vLLM replicas behind a real Envoy configured as a GIE gateway, `kvfleet epp` its
endpoint picker (router secret set, KV events followed): `vllm bench serve` through the gateway
completes every request, vLLM's own prefix cache answers the repeated prefixes, and the picker
sent each tenant's requests with its signed `cache_salt` (a salt that did not verify would leave
the connector out; here there is no connector, and vLLM's cache keeps the tenants apart by it).

The picker and Envoy run from the main environment (`python -m kvfleet_lab.gateway`, as
`kvfleet bench fronts` runs them): this environment has no Envoy API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvfleet_runtime.config.fleet import FleetConfig, ReplicaEndpoint, dump_fleet_config
from tests.support import BY_SOURCE, counter

from .conftest import MODEL, REPO, VllmServe, free_port, start_all, stop_all
from .test_serve import settled

SECRET = "router-secret-vllm-gateway-tests"


def _main_python() -> str:
    """The main environment's python (scripts/env.sh says where it is for this checkout)."""
    out = subprocess.run(["bash", "-c", 'source scripts/env.sh && echo "$KVFLEET_VENV"'],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    python = Path(out) / "bin" / "python"
    assert python.exists(), f"no main environment at {out}: run scripts/bootstrap.sh"
    return str(python)


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} not ready in {timeout_s:g} s:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def gateway(serve_dir: Path, serve_model: Path) -> Iterator[tuple[str, list[VllmServe]]]:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    replicas = [VllmServe(n, serve_model, serve_dir / f"gateway-{n}.log",
                          env={**base_env, "VLLM_SERVER_DEV_MODE": "1"}) for n in ("a", "b")]
    config = serve_dir / "gateway-fleet.json"
    config.write_text(dump_fleet_config(FleetConfig(
        generation=1, recompute_s_per_token=1e-3,
        replicas=tuple(ReplicaEndpoint(name=s.name, url=s.url, engine="vllm")
                       for s in replicas))))
    keys = serve_dir / "gateway-keys.json"
    keys.write_text(json.dumps({"tenants": {"acme": ["sk-acme"], "globex": ["sk-globex"]}}))
    port, metrics = free_port(), free_port()
    log = serve_dir / "gateway.log"
    start_all(replicas)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [_main_python(), "-m", "kvfleet_lab.gateway", "--port", str(port), "--metrics-port",
             str(metrics), "--work", str(serve_dir / "gateway"),
             *[a for s in replicas for a in ("--endpoint", f"127.0.0.1:{s.port}")], "--",
             "--keys", str(keys), "--fleet-config", str(config), "--tokenizer",
             str(serve_model), "--poll-interval-s", "0.5"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            env={**base_env, "KVFLEET_ROUTER_SECRET": SECRET,
                 "PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}:{REPO}"})
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc, log, 120)
        yield f"http://127.0.0.1:{port}", replicas
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        stop_all(replicas)


def test_vllm_bench_serve_through_the_gateway(gateway: tuple[str, list[VllmServe]],
                                              serve_dir: Path, serve_model: Path) -> None:
    url, replicas = gateway
    before = sum(counter(settled(r), BY_SOURCE, source="local_cache_hit") for r in replicas)
    result = serve_dir / "gateway-bench.json"
    cmd = [str(Path(sys.executable).with_name("vllm")), "bench", "serve", "--backend", "openai",
           "--endpoint", "/v1/completions", "--base-url", url, "--model", MODEL, "--tokenizer",
           str(serve_model), "--max-concurrency", "4", "--request-rate", "inf", "--seed", "1",
           "--ignore-eos", "--dataset-name", "prefix_repetition", "--num-prompts", "24",
           "--prefix-repetition-prefix-len", "256", "--prefix-repetition-suffix-len", "32",
           "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "4",
           "--save-result", "--result-dir", str(serve_dir), "--result-filename", result.name]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OPENAI_API_KEY": "sk-acme"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(result.read_text())
    assert (report["completed"], report.get("failed", 0)) == (24, 0), report
    hits = sum(counter(settled(r), BY_SOURCE, source="local_cache_hit") for r in replicas)
    # 4 prefixes of 256 tokens, 6 requests each: vLLM's own cache answers the repeats
    assert hits - before >= 16 * 256, hits - before
