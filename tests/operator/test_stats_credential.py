"""The operator's `/cache/stats` fallback against a real secured `kvfleet replica` process on
127.0.0.1: with the operator token it reads the replica's totals; without it, or with a wrong
one, the replica refuses and the fallback has no data (never a made-up rate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet_operator.api import CacheStatsSource, MetricsSpec
from kvfleet_operator.metrics import DeploymentPods, read_cache_stats, read_hit_rates
from tests import credentials
from tests.support import free_port


@pytest.fixture(scope="module")
def replica_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint

    tmp = tmp_path_factory.mktemp("stats-credential")
    generate_checkpoint(tmp / "tiny", ModelArgs.from_preset("tiny"), seed=0)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    env.update(credentials.ENV, KVFLEET_REPLICA_CPU_THREADS="1", OMP_NUM_THREADS="1",
               KVFLEET_REPLICA_CACHE__ADMIT_MIN_SIGHTINGS="1")
    log = (tmp / "replica.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfleet_runtime.cli", "replica", "--model-dir", str(tmp / "tiny"),
         "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--log-level",
         "WARNING"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    log.close()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp / "replica.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                    break
            except (OSError, urllib.error.URLError):
                assert time.monotonic() < deadline, "replica not ready"
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def _complete(port: int, prompt: str) -> None:
    url = f"http://127.0.0.1:{port}/v1/completions"
    request = urllib.request.Request(
        url, data=json.dumps({"prompt": prompt, "max_tokens": 1}).encode(), method="POST",
        headers={"Content-Type": "application/json", **credentials.as_router("acme", url)})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200


def test_the_operator_token_opens_the_stats_fallback(replica_port: int) -> None:
    prompt = "the operator reads hit rates from the replicas themselves. " * 2  # 7 full blocks
    source = CacheStatsSource(port=replica_port)
    _complete(replica_port, prompt)
    deadline = time.monotonic() + 30
    rate: float | None = 0.0
    while rate == 0.0:  # stored asynchronously after the first sighting
        assert time.monotonic() < deadline, "the prompt was never served from cache"
        _complete(replica_port, prompt)
        rate = read_cache_stats(source, ["127.0.0.1"], credentials.OPERATOR_TOKEN.encode())
    assert rate is not None and 0.0 < rate < 1.0
    assert read_cache_stats(source, ["127.0.0.1"]) is None  # refused: no data, not zero
    assert read_cache_stats(source, ["127.0.0.1"], b"guessed") is None


def test_read_hit_rates_passes_the_token_on(replica_port: int) -> None:
    spec = MetricsSpec.model_validate({"cacheStats": {"port": replica_port}})
    pods = DeploymentPods("ns", "llm", ("127.0.0.1",))
    _complete(replica_port, "x" * 40)
    with_token = read_hit_rates(spec, pods, None, token=credentials.OPERATOR_TOKEN.encode())
    assert with_token.source == "cache-stats" and with_token.target_hit_rate is not None
    assert read_hit_rates(spec, pods, None).target_hit_rate is None


def test_the_handlers_read_the_token_the_chart_mounts(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_operator.handlers.rollout import _operator_token

    token = tmp_path / "token"
    token.write_text("mounted-token\n")
    monkeypatch.delenv("KVFLEET_OPERATOR_TOKEN", raising=False)
    monkeypatch.setenv("KVFLEET_OPERATOR_TOKEN_FILE", str(token))
    assert _operator_token() == b"mounted-token"
    monkeypatch.setenv("KVFLEET_OPERATOR_TOKEN_FILE", str(tmp_path / "missing"))
    assert _operator_token() is None  # logged; the Prometheus source still works
