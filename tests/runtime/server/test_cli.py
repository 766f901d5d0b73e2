"""The entry points: `kvfleet model generate` and `kvfleet replica` as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from typer.testing import CliRunner

from kvfleet_runtime.auth import sign_assertion
from kvfleet_runtime.cli import app
from kvfleet_runtime.wire import ASSERTION_HEADER
from tests.support import free_port


def test_model_generate_prints_the_digest(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["model", "generate", "--out", str(tmp_path / "m"),
                                      "--preset", "tiny", "--seed", "3"])
    assert result.exit_code == 0, result.output
    digest = result.output.split()[-1]
    assert digest.startswith("sha256:") and (tmp_path / "m" / "config.json").is_file()
    bad = CliRunner().invoke(app, ["model", "generate", "--out", str(tmp_path / "x"),
                                   "--preset", "huge"])
    assert bad.exit_code == 2 and "unknown preset 'huge'" in bad.output


def test_replica_without_a_model_dir_fails_cleanly() -> None:
    result = CliRunner().invoke(app, ["replica"], env={"KVFLEET_REPLICA_CONFIG": ""})
    assert result.exit_code == 2 and "model_dir is not set" in result.output


def test_replica_refuses_weights_other_than_the_expected_digest(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    CliRunner().invoke(app, ["model", "generate", "--out", str(model_dir)])
    result = CliRunner().invoke(app, ["replica", "--model-dir", str(model_dir)],
                                env={"KVFLEET_WEIGHTS_DIGEST": "sha256:" + "0" * 64,
                                     "KVFLEET_REPLICA_CONFIG": ""})
    assert result.exit_code == 2 and "was expected (KVFLEET_WEIGHTS_DIGEST)" in result.output


def test_kvfleet_replica_serves_with_config_file_and_env(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    CliRunner().invoke(app, ["model", "generate", "--out", str(model_dir)])
    config = tmp_path / "replica.yaml"
    config.write_text("cpu_threads: 1\nlimits: {max_tokens: 4}\n")
    port = free_port()
    digest = CliRunner().invoke(app, ["model", "generate", "--out", str(model_dir)]).output
    env = {**os.environ, "KVFLEET_REPLICA_MODEL_ID": "cli-tiny",
           "KVFLEET_WEIGHTS_DIGEST": digest.split()[-1], "KVFLEET_ROUTER_SECRET": "cli-secret"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfleet_runtime.cli", "replica", "--model-dir", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--config", str(config)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "replica did not become ready"
            time.sleep(0.2)
        body = json.dumps({"model": "cli-tiny", "prompt": "hi", "max_tokens": 4}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, method="POST",
                                     headers={"X-Kvfleet-Tenant": "acme",
                                              ASSERTION_HEADER: sign_assertion(
                                                  b"cli-secret", "acme", audience="",
                                                  method="POST", path="/v1/completions",
                                                  now_s=time.time()),
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = json.loads(resp.read())
        assert data["model"] == "cli-tiny" and data["usage"]["completion_tokens"] <= 4
    finally:
        proc.terminate()
        proc.wait(30)
