"""The model tests' fixtures: the tiny checkpoint, and one intra-op thread (a tiny model on a small
shared CPU runs faster without a thread team)."""

from __future__ import annotations

import pytest
import torch

from tests.support import tiny_dir

__all__ = ["tiny_dir"]


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread() -> None:
    torch.set_num_threads(1)
