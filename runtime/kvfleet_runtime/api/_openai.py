"""The OpenAI request and response models the replica and the router serve (pydantic, no torch).

Requests are strict: wrong JSON types (a string for an int, `true` for a number) and out-of-range
values are refused with 400 naming the field. Every field of the OpenAI API reference is decided
one of three ways (the table is in docs/api.md):
- supported: a field of the models below;
- accepted and ignored, where ignoring it cannot change an answer (`user`, `metadata`, ...):
  `IGNORED_*`, declared on the models so clients that always send them work;
- refused with a 400 naming the field (`tools`, `suffix`, `response_format: json_object`, ...):
  `refused_fields` says why, before the model is validated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

__all__ = [
    "MAX_N",
    "MAX_STOP_SEQUENCES",
    "PROMPT_TAGS",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "TextPart",
    "refused_fields",
]

MAX_N = 8
"""Choices per request at most (each is a sequence with its own KV)."""
MAX_STOP_SEQUENCES = 4
"""OpenAI's limit."""
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300
"""Entries of `logit_bias` at most (OpenAI documents none; bounded so a body cannot be costly)."""
MAX_PENALTY = 2.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _integral(value: Any) -> Any:
    # JSON has one number type: JSON Schema's "integer" includes 257.0, so it is accepted as
    # 257 (strictness still refuses 2.5, "4" and true).
    if type(value) is float and value.is_integer():
        return int(value)
    return value


_INTEGRAL = BeforeValidator(_integral)
# The constraints come before the validator, so the JSON schema keeps minimum/maximum.
TokenId = Annotated[int, Field(ge=0), _INTEGRAL]
PositiveInt = Annotated[int, Field(ge=1), _INTEGRAL]
NumChoices = Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1), _INTEGRAL]
NumLogprobs = Annotated[int, Field(ge=0, le=5), _INTEGRAL]
NumTopLogprobs = Annotated[int, Field(ge=0, le=20), _INTEGRAL]


def _prompt_kind(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "id_lists"
    return "ids"


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]

Prompt = Annotated[
    Annotated[Text, Tag("text"), Field(description="Text, tokenized by the replica.")]
    | Annotated[list[Text], Tag("texts"), Field(min_length=1, max_length=MAX_N,
                                                description="A batch of texts.")]
    | Annotated[TokenIds, Tag("ids"), Field(description="Token ids, used as given.")]
    | Annotated[list[TokenIds], Tag("id_lists"), Field(min_length=1, max_length=MAX_N,
                                                       description="A batch of token-id lists.")],
    Discriminator(_prompt_kind),
]
PROMPT_TAGS = ("text", "texts", "ids", "id_lists")
"""The union's tags; error locations leave them out (`prompt.1`, not `prompt.ids.1`)."""

Stop = (Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                    Field(max_length=MAX_STOP_SEQUENCES)]
        | None)

Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                           Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=MAX_LOGIT_BIAS)]


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = Field(default=False, description="Accepted and ignored.")


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str | None = Field(default=None, description="Must name the served model when given.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling.")
    n: NumChoices = Field(default=1, description="Choices to generate.")
    seed: Seed | None = Field(default=None,
                             description="Seeds sampling: same seed, same tokens; choice i "
                                         "uses seed + i.")
    stop: Stop = Field(default=None, description="Up to 4 strings; generation stops before "
                                                 "the first one, which is not returned.")
    stream: bool = Field(default=False, description="Server-sent events.")
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = Field(default=None,
                                         description="Token id (as a string) -> bias added to "
                                                     "its logit, in [-100, 100].")
    user: str | None = Field(default=None, max_length=256, description="Accepted and ignored.")
    safety_identifier: str | None = Field(default=None, max_length=256,
                                          description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(default=None, max_length=256,
                                         description="Accepted and ignored: the cache is "
                                                     "keyed by tenant and tokens.")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """OpenAI `POST /v1/completions`."""

    prompt: Prompt
    max_tokens: PositiveInt = Field(default=16, description="Tokens to generate at most.")
    logprobs: NumLogprobs | None = Field(default=None,
                                 description="Log-probabilities of the sampled token and of "
                                             "this many most likely ones.")
    echo: bool = Field(default=False, description="Return the prompt before the completion.")
    best_of: Literal[1] | None = Field(default=None, description="Only 1 (the default).")
    suffix: None = Field(default=None, description="Refused when set: not supported.")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="Text, or text parts (joined).")
    name: str | None = Field(default=None, max_length=256, description="Accepted and ignored.")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    """OpenAI `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: PositiveInt | None = Field(default=None, description="Deprecated by OpenAI; "
                                   "the same as max_completion_tokens.")
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumTopLogprobs | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16, description="Accepted and ignored.")
    store: bool | None = Field(default=None, description="Accepted and ignored (nothing is "
                                                         "stored).")
    service_tier: Literal["auto", "default"] | None = Field(
        default=None, description="Accepted and ignored.")
    parallel_tool_calls: bool | None = Field(default=None, description="Accepted and ignored "
                                                                       "(no tools).")
    modalities: list[Literal["text"]] | None = None

    def generation_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


_REFUSED_COMMON = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this model has no reasoning effort setting",
    "verbosity": "this model has no verbosity setting",
    "suffix": "suffix (insertion) is not supported",
}


def refused_fields(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, reason) for each field set in `data` that is not supported: 400 names it."""
    out: list[tuple[str, str]] = []
    for name, reason in _REFUSED_COMMON.items():
        value = data.get(name)
        if value is None or value in ([], "none"):
            continue
        out.append((name, reason))
    fmt = data.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        out.append(("response_format", f"response_format {fmt.get('type')!r} is not supported "
                                       "(only 'text')"))
    return out


# ---- responses ---------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "error"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] = Field(description="The generated token ids (an extension).")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    weights_digest: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
