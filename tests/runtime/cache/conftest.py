"""Shared fixtures of the cache tests: a fake clock and small keys and layouts."""

from __future__ import annotations

import pytest

from kvfleet_runtime.cache import CacheKey
from tests.support import FakeClock

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64


def make_key(tenant: str = "tenant-a", digest: str = DIGEST_A) -> CacheKey:
    return CacheKey(tenant, "tiny-model", digest, "float32", "rope-1", "sdpa-v1")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
