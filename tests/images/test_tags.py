"""scripts/images.sh --tag: the tag of a checkout's build is decided by what the build context
holds, so two checkouts with other sources never share one, and the same sources always do
(no buildah needed: --tag builds nothing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.images.buildah import ROOT, VERSION, checkout_image

CONTEXT = ("scripts", "docker", "runtime", "operator", "pyproject.toml", "requirements.lock",
           "README.md", ".dockerignore")


def _tag(root: Path, kind: str) -> str:
    out = subprocess.run(["bash", str(root / "scripts" / "images.sh"), "--tag", kind],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in CONTEXT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache"))
        else:
            shutil.copy2(source, copy / name)
    return copy


def test_the_tag_follows_the_sources(tmp_path: Path) -> None:
    ours = checkout_image("runtime")
    assert ours.startswith(f"localhost/kvfleet/kvfleet-runtime:{VERSION}-src-")
    operator = checkout_image("operator")
    assert operator.startswith(f"localhost/kvfleet/kvfleet-operator:{VERSION}-src-")
    copy = _copy(tmp_path)
    assert _tag(copy, "runtime") == ours  # another clone of the same tree: the same build
    source = copy / "runtime" / "kvfleet_runtime" / "__init__.py"
    source.write_text(source.read_text() + "\n# changed\n")
    changed = _tag(copy, "runtime")
    assert changed != ours and changed.rsplit("-src-", 1)[0] == ours.rsplit("-src-", 1)[0]


def test_a_change_of_the_lab_alone_rebuilds_no_image(tmp_path: Path) -> None:
    # The lab is not in kvfleet's wheel (.dockerignore keeps it out of the build context too).
    copy = _copy(tmp_path)
    before = {kind: _tag(copy, kind) for kind in ("runtime", "operator")}
    source = copy / "runtime" / "kvfleet_lab" / "__init__.py"
    source.write_text(source.read_text() + "\n# changed\n")
    assert {kind: _tag(copy, kind) for kind in before} == before
    product = copy / "runtime" / "kvfleet_runtime" / "__init__.py"
    product.write_text(product.read_text() + "\n# changed\n")
    assert _tag(copy, "runtime") != before["runtime"]


def test_a_wrong_argument_is_refused_with_the_usage() -> None:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "images.sh"), "--tag", "router"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage: scripts/images.sh" in out.stderr and not out.stdout
