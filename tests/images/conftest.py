"""Fixtures for the image smoke tests: a working container of each image scripts/images.sh built,
run with `buildah run --isolation chroot` on a read-only root (tests/images/buildah.py, which also
lists what chroot isolation does not check)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.images.buildah import (
    OPERATOR,
    ROOT,
    RUNTIME,
    VERSION,
    Container,
    checkout_image,
    have_image,
    stop_run,
    working_container,
)

__all__ = ["OPERATOR", "ROOT", "RUNTIME", "VERSION", "Container", "stop"]


def stop(proc: subprocess.Popen[bytes]) -> None:
    stop_run(proc, grace_s=30)


def _container(kind: str) -> Iterator[Container]:
    image = checkout_image(kind)
    if not have_image(image):
        pytest.skip(f"{image} is not built (scripts/images.sh builds it; `make test` runs it)")
    with working_container(image) as container:
        yield container


@pytest.fixture(scope="module")
def runtime_image() -> Iterator[Container]:
    yield from _container("runtime")


@pytest.fixture(scope="module")
def operator_image() -> Iterator[Container]:
    yield from _container("operator")
