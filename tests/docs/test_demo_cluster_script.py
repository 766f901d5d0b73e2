"""`make demo-cluster`'s script without a cluster: it parses, and the ModelRollouts it applies are
valid for the operator and aim at the chart's replica Deployment (the run itself needs the
cluster binaries and the runtime image: `make demo-cluster`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml

from kvfleet_operator.api import ModelRolloutSpec

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
