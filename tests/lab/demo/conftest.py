"""A tiny checkpoint for the demo's process tests (the demo's default 'small' model is slower)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "kvfleet_lab.cli"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo-model") / "tiny"
    subprocess.run([*CLI, "model", "generate", "--out", str(out), "--preset", "tiny"],
                   check=True, capture_output=True, timeout=300)
    return out
