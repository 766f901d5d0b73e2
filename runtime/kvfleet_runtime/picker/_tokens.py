"""The token ids a replica will see for a request's prompt, when the picker can know them.

Text is encoded only with the replicas' own tokenizer: a kvfleet replica's load report names it
(a digest of the tokenizer files), and the picker encodes with its own (`--tokenizer`, the model
folder's files) only when the names are equal; the byte tokenizer needs no files. A different or
missing tokenizer gives no ids (the request is routed without the override), never other ids.
"""

from __future__ import annotations

from typing import Any

from kvfleet_runtime.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["chat_token_ids", "encode_chat", "encode_prompt", "prompt_token_ids",
           "tokenizer_named"]

_BYTE_TOKENIZER = ByteTokenizer()


def tokenizer_named(name: str, local: Tokenizer | None) -> Tokenizer | None:
    """The tokenizer the replicas call `name`: `local` when it is that one, the byte tokenizer
    by its name, else None."""
    if local is not None and name and local.name == name:
        return local
    return _BYTE_TOKENIZER if name == _BYTE_TOKENIZER.name else None


def encode_prompt(prompt: Any, tokenizer: Tokenizer | None) -> list[int] | None:
    """A completion's `prompt` as ids: a list of ints as given, text with `tokenizer`."""
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    if not isinstance(prompt, str) or tokenizer is None:
        return None
    try:
        return tokenizer.encode(prompt)
    except ValueError:  # a lone surrogate: the replica refuses it with a 400
        return None


def encode_chat(messages: Any, tokenizer: Tokenizer | None) -> list[int] | None:
    """A chat request's `messages` as the ids a replica computes (its template, with the
    generation prompt); None also when the template refuses the messages (the replica answers
    that request with the reason)."""
    if tokenizer is None or not isinstance(messages, list):
        return None
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ValueError:
        return None


def prompt_token_ids(prompt: Any, tokenizer: str,
                     local: Tokenizer | None = None) -> list[int] | None:
    """The token ids the replica will see for `prompt`, when the picker can know them.

    `tokenizer` is the name the replicas report; `local` the picker's own (`--tokenizer`), used
    only when its name is that one."""
    if isinstance(prompt, list):
        return encode_prompt(prompt, None)
    return encode_prompt(prompt, tokenizer_named(tokenizer, local))


def chat_token_ids(messages: Any, tokenizer: str,
                   local: Tokenizer | None = None) -> list[int] | None:
    """`encode_chat` under `prompt_token_ids`' rule for the tokenizer."""
    return encode_chat(messages, tokenizer_named(tokenizer, local))
