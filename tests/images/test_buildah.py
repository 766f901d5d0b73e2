"""The buildah helpers the e2e's kubelet shim relies on (tests/images/buildah.py), on the built
runtime image: a stop reaches the container's command with SIGTERM (its handler runs, as under a
kubelet), and a stale image is told from a current one file by file."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.images.buildah import PACKAGES, SITE_PACKAGES, Container, stop_run

pytestmark = [pytest.mark.image]

# Writes "started", then on SIGTERM "term <uid>" and exits 0: what a graceful shutdown looks like.
GRACEFUL = (
    "import os, signal, sys, time\n"
    "def term(signum, frame):\n"
    "    open('/w/got', 'w').write(f'term {os.getuid()}')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "open('/w/started', 'w').write('x')\n"
    "time.sleep(300)\n"
)


def test_stop_sends_sigterm_to_the_command_and_its_handler_runs(
    runtime_image: Container, tmp_path: Path
) -> None:
    shared = tmp_path / "w"
    shared.mkdir()
    shared.chmod(0o777)
    proc = runtime_image.start(["python", "-c", GRACEFUL], tmp_path / "log",
                               volumes=[f"{shared}:/w"])
    try:
        deadline = time.monotonic() + 120
        while not (shared / "started").exists():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.1)
    finally:
        stop_run(proc, grace_s=30)
    # A signal to buildah's process group instead would have SIGKILLed the command (no "got").
    assert (shared / "got").read_text() == "term 10001"
    assert proc.returncode == 0


def test_stale_sources_names_every_changed_missing_and_extra_file(
    runtime_image: Container, tmp_path: Path
) -> None:
    # A checkout made of the image's own files: current, then changed three ways.
    for package in PACKAGES:
        shutil.copytree(runtime_image.mount / SITE_PACKAGES / Path(package).name,
                        tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert runtime_image.stale_sources(tmp_path) == []
    wire = tmp_path / "runtime/kvfleet_runtime/wire.py"
    wire.write_text(wire.read_text() + "\n# changed\n")
    (tmp_path / "runtime/kvfleet_runtime/config/watch.py").unlink()
    (tmp_path / "operator/kvfleet_operator/new_module.py").write_text("")
    assert runtime_image.stale_sources(tmp_path) == [
        "runtime/kvfleet_runtime/config/watch.py",
        "runtime/kvfleet_runtime/wire.py",
        "operator/kvfleet_operator/new_module.py",
    ]
