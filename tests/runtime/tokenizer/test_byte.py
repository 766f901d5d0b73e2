"""The byte tokenizer's chat: its documented template, and its refusals."""

from __future__ import annotations

import pytest

from kvfleet_runtime.tokenizer import BOS_ID, ByteTokenizer


def test_byte_chat_is_the_documented_template() -> None:
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    text = "<|system|>\nBe brief.\n<|user|>\nhéllo\n<|assistant|>\n"
    assert tok.encode_chat(messages) == [BOS_ID, *text.encode("utf-8")]
    without = tok.encode_chat(messages, add_generation_prompt=False)
    assert without == [BOS_ID, *text.removesuffix("<|assistant|>\n").encode("utf-8")]


@pytest.mark.parametrize(("messages", "message"), [
    ([], "messages is empty"),
    ([{"role": "user"}], r"messages\[0\] needs a string role and a string content, got role "
                         r"'user' and content of type NoneType"),
    ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], r"messages\[1\]"),
])
def test_byte_chat_refusals(messages: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ByteTokenizer().encode_chat(messages)
