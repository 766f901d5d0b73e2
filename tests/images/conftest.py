"""The images scripts/images.sh built, run with `buildah run --isolation chroot`.

The root filesystem is made read-only as the chart's readOnlyRootFilesystem makes it: every
top-level folder of the container's own filesystem is bind-mounted read-only onto itself, except
/tmp (the chart mounts an emptyDir there). Chroot isolation shares the host's network (so the
processes listen on the host's loopback), PID space, cgroups and capabilities, and ignores the
image's USER and ENTRYPOINT: the tests pass the image's configured user and entrypoint
explicitly, after reading them from the image, so what runs is what a kubelet would start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tomllib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
RUNTIME = f"localhost/kvfleet/kvfleet-runtime:{VERSION}"
OPERATOR = f"localhost/kvfleet/kvfleet-operator:{VERSION}"
# The chart's writable mounts (emptyDirs); everything else in the root filesystem is read-only.
WRITABLE = {"tmp"}
# Set up by buildah run itself (devices, proc, the resolver files it injects).
RUNTIME_MANAGED = {"dev", "proc", "sys", "run"}


def buildah() -> list[str]:
    return ["buildah"] if os.geteuid() == 0 else ["sudo", "-n", "buildah"]


def _have_image(name: str) -> bool:
    if shutil.which("buildah") is None:
        return False
    proc = subprocess.run([*buildah(), "inspect", "--type", "image", name],
                          capture_output=True, timeout=60)
    return proc.returncode == 0


@dataclass(slots=True)
class Container:
    """A working container of one image, its filesystem mounted on the host at `mount`."""

    name: str
    mount: Path
    config: dict[str, Any]  # the image's OCI config (User, Entrypoint, Env, ...)

    def argv(self, command: Sequence[str], *, volumes: Sequence[str] = (),
             env: dict[str, str] | None = None) -> list[str]:
        """`buildah run` of `command` as the image's user, on a read-only root."""
        user = self.config.get("User") or "0"
        args = [*buildah(), "run", "--isolation", "chroot", "--user", user]
        for top in sorted(os.listdir(self.mount)):
            path = self.mount / top
            if top in WRITABLE | RUNTIME_MANAGED or not path.is_dir() or path.is_symlink():
                continue
            args += ["--volume", f"{path}:/{top}:ro"]
        for volume in volumes:
            # The runtime makes mount points before the root turns read-only; so do we.
            target = volume.split(":")[1]
            (self.mount / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
            args += ["--volume", volume]
        for key, value in (env or {}).items():
            args += ["--env", f"{key}={value}"]
        return [*args, self.name, "--", *command]

    def run(
        self, command: Sequence[str], *, volumes: Sequence[str] = (),
        env: dict[str, str] | None = None, timeout_s: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command, volumes=volumes, env=env), capture_output=True,
                              text=True, timeout=timeout_s)

    def start(self, command: Sequence[str], log: Path, *, volumes: Sequence[str] = (),
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A long-running process in its own session, so stop() reaches what buildah forked."""
        with log.open("wb") as out:
            return subprocess.Popen(self.argv(command, volumes=volumes, env=env), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def entrypoint(self) -> list[str]:
        return list(self.config.get("Entrypoint") or [])


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _container(image: str) -> Iterator[Container]:
    if not _have_image(image):
        pytest.skip(f"{image} is not built (scripts/images.sh builds it; `make test` runs it)")
    name = f"kvfleet-test-{uuid.uuid4().hex[:8]}"
    subprocess.run([*buildah(), "from", "--pull-never", "--name", name, image], check=True,
                   capture_output=True, timeout=120)
    try:
        mount = subprocess.run([*buildah(), "mount", name], check=True, capture_output=True,
                               text=True, timeout=60).stdout.strip()
        inspect = subprocess.run([*buildah(), "inspect", "--type", "image", image], check=True,
                                 capture_output=True, text=True, timeout=60).stdout
        config = json.loads(inspect)["OCIv1"]["config"]
        yield Container(name, Path(mount), config)
    finally:
        subprocess.run([*buildah(), "rm", name], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def runtime_image() -> Iterator[Container]:
    yield from _container(RUNTIME)


@pytest.fixture(scope="module")
def operator_image() -> Iterator[Container]:
    yield from _container(OPERATOR)
