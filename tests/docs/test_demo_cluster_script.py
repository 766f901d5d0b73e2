"""`make demo-cluster`'s script without a cluster: it parses, and the ModelRollouts it applies are
valid for the operator and aim at the chart's replica Deployment (the run itself needs the
cluster binaries and the runtime image: `make demo-cluster`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvfleet_operator.api import ModelRolloutSpec
from tests.cluster.cluster import CommandError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "demo_cluster.py"


def _module() -> object:
    spec = importlib.util.spec_from_file_location("demo_cluster", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rollouts_it_applies_are_valid() -> None:
    demo = _module()
    for image in (None, "x/y:1"):
        doc = yaml.safe_load(demo._rollout("v2", "sha256:" + "a" * 64,  # type: ignore[attr-defined]
                                           "http://127.0.0.1:9", 50, image=image))
        spec = ModelRolloutSpec.model_validate(doc["spec"])
        assert spec.target_ref.name == "kvfleet-replica" and spec.image == image
        assert spec.gate.window_seconds == 50


def test_help_runs() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "--keep" in out.stdout, out.stderr


class _FlakyApiServer:
    """A cluster whose API server does not answer the first `misses` requests (the fault: a TLS
    handshake timing out on loaded cores), or refuses them outright (`refusal`)."""

    def __init__(self, misses: int, refusal: str | None = None) -> None:
        self.misses, self.refusal, self.calls = misses, refusal, 0

    def kubectl(self, *args: str, stdin: str | None = None, timeout_s: float = 0) -> object:
        self.calls += 1
        argv = ["kubectl", *args]
        if self.refusal is not None:
            raise CommandError(argv, 1, "", self.refusal)
        if self.calls <= self.misses:
            raise CommandError(argv, 1, "", "Unable to connect to the server: net/http: TLS "
                               "handshake timeout")
        return subprocess.CompletedProcess(argv, 0, "NAME   STATUS\nllm    Active\n", "")


def test_kubectl_asks_again_while_the_api_server_does_not_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    demo = _module()
    monkeypatch.setattr(demo, "KUBECTL_RETRY_PAUSE_S", 0.0)
    flaky = _FlakyApiServer(misses=2)
    assert "Active" in demo.kubectl(flaky, "get", "namespace", "llm")  # type: ignore[attr-defined]
    assert flaky.calls == 3


def test_kubectl_gives_up_naming_the_command_and_the_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    demo = _module()
    monkeypatch.setattr(demo, "KUBECTL_RETRY_PAUSE_S", 0.0)
    monkeypatch.setattr(demo, "KUBECTL_RETRY_S", 0.0)
    with pytest.raises(demo.DemoError, match=r"`kubectl get pods`: the API server did not "  # type: ignore[attr-defined]
                       r"answer for 0 s .*TLS handshake timeout"):
        demo.kubectl(_FlakyApiServer(misses=10**6), "get", "pods")  # type: ignore[attr-defined]
    # A refusal is an answer: not asked again.
    refused = _FlakyApiServer(misses=0, refusal='Error from server (Forbidden): pods is forbidden')
    with pytest.raises(demo.DemoError, match="Forbidden"):  # type: ignore[attr-defined]
        demo.kubectl(refused, "get", "pods")  # type: ignore[attr-defined]
    assert refused.calls == 1


def test_the_quickstart_shows_the_columns_kubectl_prints() -> None:
    """docs/quickstart.md's excerpt of a run has the CRD's `-o wide` columns, in order, and rows
    with one cell each and a phase the operator writes (the figures are a recorded run's)."""
    guide = (ROOT / "docs" / "quickstart.md").read_text()
    start = guide.index("```text", guide.index("`make demo-cluster` walks"))
    block = guide[start:guide.index("```", start + 3)].splitlines()[1:]
    crd = yaml.safe_load((ROOT / "charts" / "kvfleet" / "crds" /
                          "kvfleet.dev_modelrollouts.yaml").read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert block[0].split() == ["NAME", *(c["name"].upper() for c in columns)]
    phases = set(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
                 ["status"]["properties"]["phase"]["enum"])
    rows = {row.split()[0]: row.split() for row in block[1:]}
    assert set(rows) == {"bad", "v2"}
    assert all(len(row) == len(columns) + 1 for row in rows.values())
    assert rows["bad"][2] == "RolledBack" and rows["v2"][2] == "Succeeded"
    assert {rows["bad"][2], rows["v2"][2]} <= phases
