"""Running the images scripts/images.sh built, with `buildah run --isolation chroot` (no Docker
engine, no runc: what these machines allow). Used by the image smoke tests (tests/images) and by
the e2e's kubelet shim (tests/e2e/kubelet.py), which starts the chart's replica and router pods
inside the runtime image.

The root filesystem is made read-only as the chart's readOnlyRootFilesystem makes it: every
top-level folder of the container's own filesystem is bind-mounted read-only onto itself, except
/tmp (the chart mounts an emptyDir there). Chroot isolation shares the host's network (so the
processes listen on the host's loopback), PID space, cgroups and capabilities, and ignores the
image's USER and ENTRYPOINT: callers pass the user and the entry point explicitly, read from the
image (or the pod's securityContext), so what runs is what a kubelet would start. buildah gives
every run its own /dev (with a /dev/shm tmpfs), /proc, /sys and /etc/hosts, hostname, resolv.conf.
"""

from __future__ import annotations

import contextlib
import functools
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

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# The tags the chart names, which scripts/images.sh points at the last checkout it ran for
# (buildah names a local image localhost/<repository>:<tag>); what runs is checkout_image's.
RUNTIME = f"localhost/kvfleet/kvfleet-runtime:{VERSION}"
OPERATOR = f"localhost/kvfleet/kvfleet-operator:{VERSION}"
IMAGES_SCRIPT = ROOT / "scripts" / "images.sh"
# The chart's writable mounts (emptyDirs); everything else in the root filesystem is read-only.
WRITABLE = {"tmp"}
# Set up by buildah run itself (devices, proc, the resolver files it injects).
RUNTIME_MANAGED = {"dev", "proc", "sys", "run"}
# Where the image's venv keeps kvfleet's packages (the Dockerfiles' /opt/kvfleet venv).
SITE_PACKAGES = "opt/kvfleet/lib/python3.11/site-packages"
# kvfleet's wheel: these checkout folders, installed under SITE_PACKAGES by their last part.
PACKAGES = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())
    ["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
)


def buildah() -> list[str]:
    return ["buildah"] if os.geteuid() == 0 else ["sudo", "-n", "buildah"]


@functools.cache
def checkout_image(kind: str) -> str:
    """This checkout's build of the `runtime` or `operator` image: the tag scripts/images.sh
    gives a build of exactly these sources (`<version>-src-<digest of the build context>`), which
    another checkout's build of other sources cannot replace (its <version> tag can)."""
    out = subprocess.run(["bash", str(IMAGES_SCRIPT), "--tag", kind], capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.strip()


def have_image(name: str) -> bool:
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
             env: dict[str, str] | None = None, user: str | None = None,
             hostname: str | None = None) -> list[str]:
        """`buildah run` of `command` as `user` (default: the image's), on a read-only root.
        `volumes` are buildah's `HOST:CONTAINER[:ro]`."""
        user = user or self.config.get("User") or "0"
        args = [*buildah(), "run", "--isolation", "chroot", "--user", user]
        if hostname is not None:
            args += ["--hostname", hostname]
        # A volume mounted on a top-level folder replaces it (a mount point made by an earlier
        # run of this working container, e.g. /models): no read-only bind of its own there.
        replaced = {v.split(":")[1].strip("/") for v in volumes}
        for top in sorted(os.listdir(self.mount)):
            path = self.mount / top
            if top in WRITABLE | RUNTIME_MANAGED | replaced or not path.is_dir() \
                    or path.is_symlink():
                continue
            args += ["--volume", f"{path}:/{top}:ro"]
        for volume in volumes:
            # The runtime makes mount points before the root turns read-only; so do we (in the
            # working container's own layer, which every run of it shares).
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

    def stale_sources(self, root: Path = ROOT) -> list[str]:
        """The checkout's package files (kvfleet's wheel) that the image does not carry as they
        are here: what a run of the image would not exercise. Empty when the image was built from
        this tree's sources (the .py files; data files travel in the same wheel)."""
        differ = []
        for package in PACKAGES:
            source = root / package
            installed = self.mount / SITE_PACKAGES / Path(package).name
            ours = {p.relative_to(source) for p in source.rglob("*.py")}
            theirs = {p.relative_to(installed) for p in installed.rglob("*.py")}
            for relative in sorted(ours | theirs):
                here, there = source / relative, installed / relative
                if relative not in ours or relative not in theirs \
                        or here.read_bytes() != there.read_bytes():
                    differ.append(f"{package}/{relative}")
        return differ


def payload_pids(buildah_pid: int) -> list[int]:
    """The processes a `buildah run` started for its command: its descendants that are not
    buildah's own (buildah, buildah-chroot-runtime, buildah-chroot-exec). Chroot isolation has no
    PID namespace, so these are host PIDs. A kubelet signals the container's process; a signal to
    the whole group would stop buildah's helpers first, and they take the command down with
    SIGKILL, before its SIGTERM handler has run."""
    found: list[int] = []
    frontier = [buildah_pid]
    while frontier:
        helpers: list[int] = []
        for pid in frontier:
            for child in _children(pid):
                try:
                    argv0 = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]
                except OSError:
                    continue  # gone meanwhile
                is_helper = os.path.basename(argv0).startswith(b"buildah")
                (helpers if is_helper else found).append(child)
        frontier = helpers
    return found


def stop_run(popen: subprocess.Popen[bytes], grace_s: float) -> None:
    """Stop a `buildah run` started in its own session as the kubelet stops a container: SIGTERM
    to its command (not to buildah's helpers: they would SIGKILL it before its handler ran),
    SIGKILL to the whole group after `grace_s`, then reap buildah."""
    if popen.poll() is None:
        pids = payload_pids(popen.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not pids:  # the command is not started yet (or gone): buildah itself
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait(timeout=grace_s)


def _children(pid: int) -> list[int]:
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                children += [int(c) for c in text.split()]
    return children


@contextlib.contextmanager
def working_container(image: str, prefix: str = "kvfleet-test") -> Iterator[Container]:
    """`buildah from` the local image (never pulled), mounted; removed afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
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
