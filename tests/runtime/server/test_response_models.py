"""Every answer the replica writes is exactly one of the protocol models the OpenAPI document is
made from (`kvfleet_runtime.api`): validated against it and written back out, each body is the
same JSON, so a field the handlers add, drop or retype without the model fails here. Streams:
every server-sent event is checked (a streamed completion's events are `CompletionResponse`s, a
streamed chat's `ChatCompletionChunk`s)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kvfleet_runtime.api import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)

from .conftest import RunningReplica
from .test_api import get, post

PROMPT = [(7 * i) % 256 for i in range(40)]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def exactly(model: type[BaseModel], body: Any) -> None:
    """`body` is `model`'s JSON: nothing the model lacks, nothing of another type."""
    parsed = model.model_validate(body)
    assert parsed.model_dump(mode="json", exclude_unset=True) == body, model.__name__


def events(text: str) -> list[Any]:
    out = []
    for event in text.split("\n\n"):
        data = "".join(line[len("data: "):] for line in event.splitlines()
                       if line.startswith("data: "))
        if data and data != "[DONE]":
            out.append(json.loads(data))
    assert text.rstrip().endswith("data: [DONE]")
    return out


COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": PROMPT, "max_tokens": 5},
    {"prompt": "Hello, kvfleet", "max_tokens": 4, "echo": True, "logprobs": 2},
    {"prompt": [PROMPT, PROMPT[:20]], "max_tokens": 3, "n": 2, "seed": 3, "temperature": 0.8},
    {"prompt": PROMPT, "max_tokens": 4, "stop": ["\x00"], "logprobs": 0},
]
CHATS: list[dict[str, Any]] = [
    {"messages": CHAT, "max_tokens": 5},
    {"messages": CHAT, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2},
    {"messages": CHAT, "max_tokens": 3, "n": 2, "seed": 1, "temperature": 1.0},
]
STREAMS: list[dict[str, Any]] = [
    {},
    {"stream_options": {"include_usage": True}},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
]


@pytest.mark.parametrize("body", COMPLETIONS)
def test_completions(running: RunningReplica, body: dict[str, Any]) -> None:
    r = post(running, {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    exactly(CompletionResponse, r.json())


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("body", COMPLETIONS)
def test_completion_streams(running: RunningReplica, body: dict[str, Any],
                            stream: dict[str, Any]) -> None:
    r = post(running, {"model": "tiny", **body, "stream": True, **stream})
    assert r.status_code == 200, r.text
    chunks = events(r.text)
    assert chunks
    for chunk in chunks:
        exactly(CompletionResponse, chunk)


@pytest.mark.parametrize("body", CHATS)
def test_chat_completions(running: RunningReplica, body: dict[str, Any]) -> None:
    r = post(running, {"model": "tiny", **body}, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    exactly(ChatCompletionResponse, r.json())


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("body", CHATS)
def test_chat_streams(running: RunningReplica, body: dict[str, Any],
                      stream: dict[str, Any]) -> None:
    r = post(running, {"model": "tiny", **body, "stream": True, **stream},
             path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    chunks = events(r.text)
    assert chunks
    for chunk in chunks:
        exactly(ChatCompletionChunk, chunk)


def test_models_tokenize_detokenize_and_errors(running: RunningReplica) -> None:
    exactly(ModelList, get(running.base_url + "/v1/models").json())
    exactly(ModelCard, get(running.base_url + "/v1/models/tiny").json())
    for body in ({"prompt": "Hello", "return_token_strs": True}, {"messages": CHAT}):
        r = post(running, {"model": "tiny", **body}, path="/tokenize")
        assert r.status_code == 200, r.text
        exactly(TokenizeResponse, r.json())
    r = post(running, {"model": "tiny", "tokens": [72, 101, 108]}, path="/detokenize")
    assert r.status_code == 200, r.text
    exactly(DetokenizeResponse, r.json())
    for bad, path in (({"prompt": [1], "max_tokens": -1}, "/v1/completions"),
                      ({"messages": []}, "/v1/chat/completions"),
                      ({"model": "other", "prompt": "x"}, "/tokenize")):
        r = post(running, bad, path=path)
        assert 400 <= r.status_code < 500, r.text
        exactly(ErrorResponse, r.json())


def test_a_field_the_model_lacks_is_caught() -> None:
    """The check itself: an extra field, a missing required one, a retyped one all fail."""
    good = {"prompt": "hi"}
    exactly(DetokenizeResponse, good)
    for bad in ({"prompt": "hi", "extra": 1}, {"prompt": 3}):
        with pytest.raises((AssertionError, ValidationError)):
            exactly(DetokenizeResponse, bad)
