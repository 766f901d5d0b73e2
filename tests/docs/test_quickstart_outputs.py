"""The figures docs/quickstart.md shows are the ones its steps give: the steps that run on one
machine are run here and their outputs compared with the guide's blocks (a stale figure fails).

- step 2: `kvfleet model generate --preset small --seed 0|1` prints the digests the guide shows;
- step 6: the guide's three completions through a real router to a real replica serving that
  checkpoint (the chart's default replica settings; one replica, so it is acme's home) give the
  guide's `cached_tokens` and `prompt_tokens`, and the replica's `/cache/stats` and `/metrics`
  the guide's counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet_runtime.affinity import parse_api_keys
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.router import RouterState
from kvfleet_runtime.server import ReplicaAuth, build_replica
from kvfleet_runtime.server._config import ReplicaConfig
from tests.router.test_openai_fleet import RouterThread
from tests.runtime.server.conftest import (
    METRICS_TOKEN,
    OPERATOR_TOKEN,
    ROUTER_SECRET,
    ServerThread,
)

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "quickstart.md").read_text()
KVFLEET = Path(sys.executable).with_name("kvfleet")


def _section(title: str) -> str:
    start = GUIDE.index(f"## {title}")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start:end]


def _generate(out: Path, seed: int) -> str:
    return subprocess.run(
        [str(KVFLEET), "model", "generate", "--preset", "small", "--seed", str(seed),
         "--out", str(out)], capture_output=True, text=True, timeout=300, check=True,
    ).stdout.split()[-1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("quickstart") / "ckpt-v1"
    return out, _generate(out, 0)


def test_step_2_digests(checkpoint: tuple[Path, str], tmp_path: Path) -> None:
    shown = re.findall(r"^(ckpt-v[12])\s+(sha256:[0-9a-f]{64})$", _section("2."), flags=re.M)
    assert [name for name, _ in shown] == ["ckpt-v1", "ckpt-v2"]
    assert checkpoint[1] == shown[0][1]
    assert _generate(tmp_path / "ckpt-v2", 1) == shown[1][1]
    # The values file pins the same digest.
    assert f"weightsDigest: {checkpoint[1]}" in _section("3.")


def _post(url: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        out: dict[str, Any] = json.loads(response.read())
    return out


def _get(url: str, token: bytes | None = None) -> bytes:
    headers = {} if token is None else {"Authorization": f"Bearer {token.decode()}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
        data: bytes = r.read()
    return data


@pytest.fixture(scope="module")
def fleet(checkpoint: tuple[Path, str]) -> Iterator[tuple[str, str]]:
    """(router URL, replica URL): one replica with the chart's default settings, the router in
    front of it with acme's key, as steps 3-4 install them."""
    config = ReplicaConfig.model_validate(
        {"model_dir": str(checkpoint[0]), "model_id": "demo-small", "device": "cpu"})
    with contextlib.ExitStack() as stack:
        replica = stack.enter_context(ServerThread(build_replica(config), ReplicaAuth(
            router_secret=ROUTER_SECRET, operator_token=OPERATOR_TOKEN, name="r0",
            metrics_token=METRICS_TOKEN)))
        state = RouterState(
            view=FleetView(static_replicas={"r0": f"http://127.0.0.1:{replica.port}"}),
            keys=parse_api_keys({"tenants": {"acme": ["sk-acme-1"]}}),
            poll_interval_s=0.2, max_body_bytes=1 << 20, body_read_timeout_s=5.0,
            router_secret=ROUTER_SECRET)
        router = stack.enter_context(RouterThread(state))
        yield f"http://127.0.0.1:{router.port}", f"http://127.0.0.1:{replica.port}"


def test_step_6_cached_tokens_stats_and_metrics(fleet: tuple[str, str]) -> None:
    router, replica = fleet
    text = _section("6.")
    script = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert script is not None
    assert "P=$(python3 -c \"print('You are a helpful assistant for ACME Corp. ' * 12)\")" in (
        script.group(1))
    prefix = "You are a helpful assistant for ACME Corp. " * 12  # $(...) drops print's newline
    usages = [
        _post(f"{router}/v1/completions", {"model": "demo-small",
              "prompt": f"{prefix} Question {i}?", "max_tokens": 8, "temperature": 0},
              "sk-acme-1")["usage"]
        for i in (1, 2, 3)
    ]
    shown_cached = [int(n) for n in re.findall(r'"cached_tokens": (\d+)', text)]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == shown_cached
    assert usages[0]["prompt_tokens"] == int(re.findall(r'"prompt_tokens": (\d+)', text)[0])

    stats = json.loads(_get(f"{replica}/cache/stats?tenant=acme", OPERATOR_TOKEN))["totals"]
    shown = re.search(r"\{\"tenant\": \"acme\", \"totals\": \{(.*?)\}", text)
    assert shown is not None
    for field, value in re.findall(r'"(\w+)": ([0-9.]+)', shown.group(1)):
        assert stats[field] == pytest.approx(float(value), abs=1e-4), (field, stats)
    assert "Authorization: Bearer $MTOKEN" in text  # per-tenant series need the metrics token
    assert b'tenant="acme"' not in _get(f"{replica}/metrics")
    metrics = _get(f"{replica}/metrics", METRICS_TOKEN).decode()
    for line in re.findall(r"^(kvfleet_cache_\w+_tokens_total\{tenant=\"acme\"\} [0-9.]+)$", text,
                           flags=re.M):
        name, value = line.rsplit(" ", 1)
        got = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", metrics, flags=re.M)
        assert got is not None and float(got.group(1)) == float(value), line


def _readme_block(after: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("```\n", text.index(after)) + 4
    return text[start:text.index("```", start)]


def test_readme_breakeven_block_and_model_config_example(
    checkpoint: tuple[Path, str],
) -> None:
    block = _readme_block("`kvfleet breakeven` for the design's reference case")
    # Piped, as a user's `| less` (pytest exports COLUMNS=80 to children: a user has none).
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([str(KVFLEET), "breakeven"], capture_output=True, text=True,
                         timeout=60, check=True, env=env).stdout
    printed = {" ".join(o.split()) for o in out.splitlines()}
    for line in block.splitlines()[1:]:
        if line != "...":
            assert " ".join(line.split()) in printed, (line, out)
    # The README's example on the project's own generated checkpoint works as written.
    example = re.search(r"kvfleet breakeven --model-config ckpt/config\.json --tp (\d+)",
                        (ROOT / "README.md").read_text())
    assert example is not None
    run = subprocess.run([str(KVFLEET), "breakeven", "--model-config",
                          str(checkpoint[0] / "config.json"), "--tp", example.group(1)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
