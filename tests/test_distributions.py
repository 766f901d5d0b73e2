"""The checkout's two distributions, built and installed as a user gets them.

`kvfleet` (pyproject.toml) is the product: the runtime, the vLLM connector and the operator, no
lab module. `kvfleet-lab` (lab/pyproject.toml) is the lab; its `kvfleet.commands` entry point adds
`bench`, `demo` and `simulate` to the product's `kvfleet`. Both wheels are built offline by the
uv that scripts/bootstrap.sh installs (hatchling comes from its cache), then installed into a
fresh environment from the same cache: the product alone, then the lab beside it.
"""

from __future__ import annotations

import os
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UV = Path(os.environ.get("KVFLEET_HOME", Path.home() / ".cache" / "kvfleet")) / "tools/bin/uv"
PRODUCT_PACKAGES = {"kvfleet_runtime", "kvfleet_vllm", "kvfleet_operator"}
LAB_COMMANDS = ("bench", "demo", "simulate")
PRODUCT_COMMANDS = ("breakeven", "epp", "model", "replica", "router")


def _uv(*args: str) -> None:
    assert UV.exists(), f"no uv at {UV}: run scripts/bootstrap.sh"
    subprocess.run([str(UV), *args], check=True, capture_output=True, text=True)


def _build(project: Path, out: Path) -> Path:
    _uv("build", "--offline", "--wheel", "--quiet", "--out-dir", str(out), str(project))
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    return {"product": _build(ROOT, out / "product"), "lab": _build(ROOT / "lab", out / "lab")}


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def _entry_points(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        found = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return archive.read(found[0]).decode() if found else ""


def test_the_product_wheel_holds_no_lab_module(wheels: dict[str, Path]) -> None:
    names = _names(wheels["product"])
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == PRODUCT_PACKAGES
    assert [n for n in names if "kvfleet_lab" in n] == []
    assert "kvfleet.commands" not in _entry_points(wheels["product"])


def test_the_lab_wheel_holds_the_lab_and_its_commands(wheels: dict[str, Path]) -> None:
    names = _names(wheels["lab"])
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvfleet_lab"}
    assert "kvfleet_lab/cli/__init__.py" in names
    assert "kvfleet_lab/traces/mooncake_synthetic_trace.jsonl" in names  # data files too
    assert [n for n in names if "__pycache__" in n] == []
    # Every source file of the checkout's lab, none left behind.
    lab = ROOT / "runtime" / "kvfleet_lab"
    sources = {f"kvfleet_lab/{p.relative_to(lab)}" for p in lab.rglob("*.py")}
    assert sources <= set(names)
    assert "[kvfleet.commands]\nlab = kvfleet_lab.cli:commands" in _entry_points(wheels["lab"])


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("env") / "venv"
    _uv("venv", "--quiet", "--python", "3.11", str(where))
    yield where


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Neither this checkout's PYTHONPATH (tests/conftest.py sets it) nor its editable installs:
    # only what the wheels installed.
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _commands(help_text: str) -> set[str]:
    listed = help_text.split("Commands:", 1)[1]
    return {line.split()[0] for line in listed.splitlines() if line.startswith("  ")}


def test_a_product_only_install_has_no_lab_then_the_lab_adds_its_commands(
    wheels: dict[str, Path], venv: Path, tmp_path: Path
) -> None:
    python = str(venv / "bin" / "python")
    _uv("pip", "install", "--quiet", "--offline", "--python", python,
        "--constraint", str(ROOT / "requirements.lock"), str(wheels["product"]))
    probe = _run(venv, "python", "-c",
                 "import importlib.util as u, kvfleet_runtime as k; "
                 "print(u.find_spec('kvfleet_lab'), k.__file__)", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    spec, where = probe.stdout.split()
    assert spec == "None"
    assert Path(where).is_relative_to(venv)  # the installed wheel, not this checkout
    product = _run(venv, "kvfleet", "--help", cwd=tmp_path)
    assert product.returncode == 0, product.stderr
    assert _commands(product.stdout) == set(PRODUCT_COMMANDS)
    missing = _run(venv, "kvfleet", "bench", "policies", "--help", cwd=tmp_path)
    assert missing.returncode == 2 and "No such command 'bench'" in missing.stderr

    # The lab's wheel alone (its third-party set is the product's `lab` extra, not needed to
    # list and parse its commands): `kvfleet` now has them, as typed in the docs.
    _uv("pip", "install", "--quiet", "--offline", "--no-deps", "--python", python,
        str(wheels["lab"]))
    both = _run(venv, "kvfleet", "--help", cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    assert _commands(both.stdout) == {*PRODUCT_COMMANDS, *LAB_COMMANDS}
    bench = _run(venv, "kvfleet", "bench", "policies", "--help", cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    assert bench.stdout.startswith("Usage: kvfleet bench policies")
