"""The OpenAI-compatible HTTP surface shared by the replica and the router (no torch).

    _errors    the one error envelope and the middleware that makes every error use it
    _body      JSON request bodies read within size, time, number, depth and Unicode bounds
    _listen    the listener: parser limits, the head deadline, parser refusals in the envelope
    _requests  request and response models; which OpenAI fields are supported, ignored, refused
    _stop      stop strings matched on streamed text (nothing after a stop is ever sent)
"""

from kvfleet_runtime.api._body import MAX_DEPTH, MAX_INT_DIGITS, parse_json, read_body, read_json
from kvfleet_runtime.api._errors import (
    CANCEL_ON_DISCONNECT,
    ApiError,
    error_body,
    error_middleware,
    error_response,
    is_client_gone,
    one_line,
)
from kvfleet_runtime.api._listen import (
    AppRunner,
    ListenerLimits,
    handler_args,
    run_app,
)
from kvfleet_runtime.api._requests import (
    MAX_N,
    MAX_STOP_SEQUENCES,
    PROMPT_TAGS,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    StreamOptions,
    TextPart,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    refused_fields,
)
from kvfleet_runtime.api._stop import StopMatcher

__all__ = [
    "CANCEL_ON_DISCONNECT",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_N",
    "MAX_STOP_SEQUENCES",
    "PROMPT_TAGS",
    "ApiError",
    "AppRunner",
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
    "ListenerLimits",
    "ModelCard",
    "ModelList",
    "StopMatcher",
    "StreamOptions",
    "TextPart",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "error_body",
    "error_middleware",
    "error_response",
    "handler_args",
    "is_client_gone",
    "one_line",
    "parse_json",
    "read_body",
    "read_json",
    "refused_fields",
    "run_app",
]
