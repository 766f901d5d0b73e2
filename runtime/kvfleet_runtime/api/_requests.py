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
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatMessage",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "TextPart",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
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
MAX_REPETITION_PENALTY = 10.0
"""vLLM sets no upper bound; past 10 every seen token is all but banned, which is a typo."""
MAX_STOP_TOKEN_IDS = 256
"""Entries of `stop_token_ids` at most (vLLM documents none; bounded like `logit_bias`)."""
MAX_TOP_K = 2**31 - 1


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


Unset = (None | Literal[False] | Annotated[list[Any], Field(max_length=0)]
         | Annotated[dict[str, Any], Field(max_length=0)])
"""A refused vLLM field at its empty default (null, false, [], {}): clients send the defaults;
`refused_fields` names any other value before validation."""
_UNSET = Field(default=None, description="Refused unless empty (null, false, [], {}).")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = Field(default=False, description="Accepted and ignored.")
    continuous_usage_stats: bool = Field(default=False, description="vLLM's field: with "
                                         "include_usage, every chunk carries the usage so far.")


class _Sampling(_Strict):
    """Fields both endpoints share: OpenAI's, then vLLM's sampling extensions."""

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

    # vLLM's extensions (its `SamplingParams`, same names and defaults).
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=MAX_REPETITION_PENALTY,
        description="Over the prompt and the output: a positive logit is divided by it, a "
                    "negative one multiplied (1 and null are off).")
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K), _INTEGRAL] | None = Field(
        default=None, description="Sample from the k most likely tokens; 0, -1 and null are off.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0,
                                description="Drop tokens less likely than min_p times the most "
                                            "likely one; 0 and null are off.")
    ignore_eos: bool = Field(default=False, description="The model's EOS does not end the "
                                                        "answer.")
    min_tokens: Annotated[int, Field(ge=0), _INTEGRAL] = Field(
        default=0, description="No EOS, stop token id or stop string ends the answer before "
                               "this many tokens.")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        default=None, description="Token ids that end the answer (finish_reason \"stop\").")
    include_stop_str_in_output: bool = Field(
        default=False, description="Return the stop string (or stop token) that ended the answer.")
    skip_special_tokens: bool | None = Field(default=None,
                                             description="Leave special tokens out of the text "
                                                         "(default true).")
    spaces_between_special_tokens: bool = Field(
        default=True, description="With skip_special_tokens false: false joins consecutive "
                                  "special tokens without the space the decoder may add.")
    truncate_prompt_tokens: PositiveInt | Literal[-1] | None = Field(
        default=None, description="Keep only this many prompt tokens (-1: as many as the context "
                                  "leaves beside max_tokens).")
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="Which side truncate_prompt_tokens cuts: left (the default) "
                                  "keeps the last tokens, right the first.")
    use_beam_search: Literal[False] = Field(default=False, description="Only false.")
    length_penalty: float = Field(default=1.0, ge=1.0, le=1.0,
                                  description="Only 1 (it is for beam search).")
    priority: Literal[0] = Field(default=0, description="Only 0 (one priority).")
    allowed_token_ids: Unset = _UNSET
    bad_words: Unset = _UNSET
    prompt_logprobs: Unset = _UNSET
    logprob_token_ids: Unset = _UNSET
    structured_outputs: Unset = _UNSET
    guided_json: Unset = _UNSET
    guided_regex: Unset = _UNSET
    guided_choice: Unset = _UNSET
    guided_grammar: Unset = _UNSET
    return_tokens_as_token_ids: Unset = _UNSET
    prompt_embeds: Unset = _UNSET
    kv_transfer_params: Unset = _UNSET
    vllm_xargs: Unset = _UNSET

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return self.include_usage() and bool(self.stream_options
                                             and self.stream_options.continuous_usage_stats)

    def skips_special_tokens(self) -> bool:
        return self.skip_special_tokens is not False


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
    add_special_tokens: bool = Field(default=True, description="Let the tokenizer add its "
                                     "special tokens (BOS) to a text prompt (vLLM's field).")


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
    add_generation_prompt: Literal[True] = Field(default=True, description="Only true (vLLM's "
                                                 "field).")
    add_special_tokens: Literal[False] = Field(default=False, description="Only false: the "
                                               "chat template writes the special tokens.")
    chat_template: Unset = _UNSET
    chat_template_kwargs: Unset = _UNSET
    continue_final_message: Unset = _UNSET

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
_REFUSED_VLLM = {
    # vLLM's extensions that kvfleet does not implement (docs/api.md says why); their empty
    # defaults (null, false, [], {}) are accepted, since clients send them.
    "allowed_token_ids": "allowed_token_ids is not supported (use logit_bias)",
    "bad_words": "bad_words is not supported (use logit_bias)",
    "prompt_logprobs": "prompt log-probabilities are not computed",
    "logprob_token_ids": "logprob_token_ids is not supported (top logprobs only)",
    "structured_outputs": "structured outputs are not supported",
    "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported",
    "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "chat_template": "a per-request chat template is not supported (the model's own is used)",
    "chat_template_kwargs": "chat_template_kwargs are not supported (the model's own template "
                            "is used)",
    "continue_final_message": "continue_final_message is not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "kv_transfer_params": "kv_transfer_params is not supported (the fleet moves KV itself)",
    "vllm_xargs": "vllm_xargs is not supported",
}
_VLLM_DEFAULTS: dict[str, Any] = {"use_beam_search": False, "length_penalty": 1.0,
                                  "priority": 0, "add_generation_prompt": True}
"""Fields accepted only at vLLM's default value (clients send the defaults); any other is
refused with the reason below."""
_VLLM_REASONS = {
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "priority": "priority scheduling is not supported (one priority)",
    "add_generation_prompt": "add_generation_prompt false is not supported (the answer "
                             "always starts a new assistant message)",
}


def refused_fields(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, reason) for each field set in `data` that is not supported: 400 names it."""
    out: list[tuple[str, str]] = []
    for name, reason in _REFUSED_COMMON.items():
        value = data.get(name)
        if value is None or value in ([], "none"):
            continue
        out.append((name, reason))
    for name, reason in _REFUSED_VLLM.items():
        value = data.get(name)
        if value is None or value is False or value in ([], {}):
            continue
        out.append((name, reason))
    for name, default in _VLLM_DEFAULTS.items():
        if name in data and data[name] is not None and data[name] != default:
            out.append((name, _VLLM_REASONS[name]))
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


class ChatDelta(BaseModel):
    """What one chat stream event adds: the role in the first, text after, nothing in the last."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (a streamed completion's events are
    `CompletionResponse`s: a choice's text so far, `usage` null until the last)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str = Field(description="Where the weights come from (vLLM's field): the model "
                                  "folder the replica loaded.")
    parent: str | None = Field(default=None, description="vLLM's field: the base model of an "
                                                         "adapter; null (no adapters).")
    max_model_len: int = Field(description="The context, in tokens (vLLM's field).")
    permission: list[dict[str, Any]] = Field(default_factory=list,
                                             description="vLLM's field; always empty.")
    weights_digest: str


# ---- vLLM's auxiliary routes: /tokenize, /detokenize -------------------------------------

MAX_DETOKENIZE_IDS = 65536
"""Ids one /detokenize may send (bounded like every list a body carries)."""


class TokenizeCompletionRequest(_Strict):
    """vLLM's `POST /tokenize` with a prompt."""

    model: str | None = Field(default=None, description="Must name the served model when given.")
    prompt: str
    add_special_tokens: bool = Field(default=True, description="Let the tokenizer add BOS.")
    return_token_strs: bool | None = Field(default=False, description="Also return each "
                                           "token as the vocabulary writes it.")


class TokenizeChatRequest(_Strict):
    """vLLM's `POST /tokenize` with chat messages, rendered as `/v1/chat/completions` does."""

    model: str | None = Field(default=None, description="Must name the served model when given.")
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    add_special_tokens: Literal[False] = Field(default=False, description="Only false: the "
                                               "chat template writes the special tokens.")
    continue_final_message: Literal[False] = Field(default=False, description="Only false.")
    chat_template: Unset = _UNSET
    chat_template_kwargs: Unset = _UNSET
    tools: Unset = _UNSET


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    """vLLM's `POST /detokenize`."""

    model: str | None = Field(default=None, description="Must name the served model when given.")
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_IDS)]


class DetokenizeResponse(BaseModel):
    prompt: str


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
