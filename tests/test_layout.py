"""Guards for the repository layout: folders show the architecture and nothing shadows stdlib."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_operator_folder_is_not_an_importable_package() -> None:
    # A top-level package named `operator` would shadow Python's own `operator` module.
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert (ROOT / "operator" / "kvfleet_operator" / "__init__.py").exists()


def test_stdlib_operator_module_is_the_one_imported_from_the_repo_root() -> None:
    code = "import operator, sys; print(operator.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert "kvfleet" not in out and Path(out).parent != ROOT / "operator"
    assert hasattr(importlib.import_module("operator"), "itemgetter")


@pytest.mark.parametrize(
    ("package", "folder"),
    [("kvfleet_runtime", "runtime"), ("kvfleet_lab", "runtime"), ("kvfleet_operator", "operator")],
)
def test_packages_import_from_their_folders(package: str, folder: str, tmp_path: Path) -> None:
    module = importlib.import_module(package)
    assert module.__file__ is not None
    assert Path(module.__file__).parent == ROOT / folder / package
    # So do the processes the tests start, from any working directory.
    code = f"import {package}; print({package}.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(out).parent == ROOT / folder / package


@pytest.mark.parametrize("module", ["kvfleet_operator", "kvfleet_runtime.breakeven"])
def test_control_plane_modules_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or f"{module} imported torch"


def test_no_file_refers_to_a_folder_outside_the_repository() -> None:
    # Spelled in pieces so that this file does not match itself.
    needles = ["..".join(["", "/shared"]), "/work" + "/shared"]
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert len(tracked) > 100
    offenders = []
    for name in tracked:
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 1_000_000:
            continue  # the vendored trace holds only numbers
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{name}: {n}" for n in needles if n in text]
    assert offenders == []
