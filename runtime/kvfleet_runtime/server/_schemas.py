"""Replica-only request and response models (cache control) and the tenant header's pattern.

The OpenAI endpoints' models are in `kvfleet_runtime.api` (the router shares them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "TENANT_PATTERN",
    "WEIGHTS_DIGEST_PATTERN",
    "InvalidateAccepted",
    "InvalidateRequest",
]

TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
WEIGHTS_DIGEST_PATTERN = r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}|blake2b:[0-9a-f]{32,128})$"


class InvalidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model_version: str = Field(pattern=WEIGHTS_DIGEST_PATTERN,
                               description="Weights digest whose cache entries to drop.")


class InvalidateAccepted(BaseModel):
    model_version: str
    status: Literal["accepted"] = "accepted"
