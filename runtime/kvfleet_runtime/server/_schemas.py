"""Request and response models of the replica API; the OpenAPI document is generated from them.

Requests are strict: unknown fields, wrong JSON types (a string for an int, `true` for a number)
and out-of-range values are refused with 400 and a message naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

__all__ = [
    "TENANT_PATTERN",
    "WEIGHTS_DIGEST_PATTERN",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorBody",
    "ErrorResponse",
    "InvalidateAccepted",
    "InvalidateRequest",
    "PromptTokensDetails",
    "StreamOptions",
    "Usage",
]

TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
WEIGHTS_DIGEST_PATTERN = r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}|blake2b:[0-9a-f]{32,128})$"


def _prompt_kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "token_ids"


Prompt = Annotated[
    Annotated[str, Tag("text"), Field(min_length=1, description="Text, byte-level tokenized.")]
    | Annotated[list[Annotated[int, Field(ge=0)]], Tag("token_ids"),
                Field(min_length=1, description="Token ids, used as given.")],
    Discriminator(_prompt_kind),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """OpenAI `POST /v1/completions`, the subset a reference replica serves."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, description="Must name the served model when given.")
    prompt: Prompt
    max_tokens: int = Field(default=16, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy.")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1,
                             description="Seeds sampling: same seed, same tokens.")
    stream: bool = Field(default=False, description="Server-sent events, one per token.")
    stream_options: StreamOptions | None = None


class InvalidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model_version: str = Field(pattern=WEIGHTS_DIGEST_PATTERN,
                               description="Weights digest whose cache entries to drop.")


class InvalidateAccepted(BaseModel):
    model_version: str
    status: Literal["accepted"] = "accepted"


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort", "error"] | None
    token_ids: list[int] = Field(description="The generated token ids (an extension).")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
