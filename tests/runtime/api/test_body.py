"""Request bodies: every way JSON can hurt a server is a 400 naming the problem."""

from __future__ import annotations

import json

import pytest

from kvfleet_runtime.api import MAX_DEPTH, ApiError, parse_json, refused_fields


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"seed": ' + b"9" * 5000 + b"}", "an integer of 5000 digits (at most 20)"),
        (b'{"seed": -' + b"1" * 21 + b"}", "an integer of 21 digits"),
        (b'{"t": 1e999}', "the number 1e999 is out of range"),
        (b'{"t": NaN}', "NaN is not a JSON number"),
        (b'{"t": -Infinity}', "-Infinity is not a JSON number"),
        (b"[" * 100_000 + b"]" * 100_000, f"nests deeper than {MAX_DEPTH} levels"),
        (json.dumps({"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})
         .encode(), f"nests deeper than {MAX_DEPTH} levels"),
        (b'{"prompt": "ok \\ud800 no"}', "prompt: a lone surrogate U+D800 at character 3"),
        (b'{"messages": [{"content": "\\udfff"}]}', "messages.0.content: a lone surrogate"),
        (b'{"\\ud83d": 1}', "a lone surrogate U+D83D"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"a": ', "not valid JSON"),
    ],
)
def test_unacceptable_json_is_a_400(raw: bytes, needle: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_json(raw)
    assert err.value.status == 400 and needle in err.value.message


def test_acceptable_json_parses_unchanged() -> None:
    body = {"seed": 2**63 - 1, "n": -(10**19), "t": 1.5e300, "prompt": "héllo 😀",
            "deep": [[[[1]]]]}
    assert parse_json(json.dumps(body).encode()) == body
    # A surrogate pair escaped in JSON is one real character, not a lone surrogate.
    assert parse_json(b'{"p": "\\ud83d\\ude00"}') == {"p": "😀"}


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ({"tools": [{"type": "function"}]}, ["tools"]),
        ({"tools": [], "tool_choice": "none"}, []),
        ({"response_format": {"type": "json_object"}}, ["response_format"]),
        ({"response_format": {"type": "text"}}, []),
        ({"suffix": "x", "audio": {}}, ["audio", "suffix"]),
        ({"suffix": None}, []),
    ],
)
def test_refused_fields_are_named(body: dict[str, object], refused: list[str]) -> None:
    assert sorted(name for name, _ in refused_fields(body)) == refused
