"""One intra-op thread: a tiny model on a small shared CPU runs faster without a thread team."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread() -> None:
    torch.set_num_threads(1)
