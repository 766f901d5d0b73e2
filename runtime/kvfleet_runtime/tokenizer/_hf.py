"""A Hugging Face tokenizer (`tokenizer.json`) run by the `tokenizers` library itself.

Encoding and decoding are the library's: the normalizer, pre-tokenizer, model, post-processor and
decoder all come from the file, so ids equal transformers' `AutoTokenizer` for the same folder
(the oracle tests check it). `decode` skips special tokens (the stop token is not text). Streams
are decoded the way serving engines do it (vLLM's incremental detokenizer): a window of recent
ids is decoded twice, with and without the newest one, and only text past the window's old end is
emitted, once it no longer ends in U+FFFD (an incomplete UTF-8 sequence, byte-level or byte
fallback). So a character split over several tokens comes out whole, and the concatenated stream
equals `decode` of all ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from typing import Any

from tokenizers import Tokenizer as _Backend

from kvfleet_runtime.tokenizer._chat import ChatTemplate

__all__ = ["HFStreamDecoder", "HFTokenizer"]

_REPLACEMENT = "\ufffd"
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


@cache
def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (the inverse of `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class HFTokenizer:
    """A model folder's tokenizer; built by `load_tokenizer`, which checks the folder."""

    __slots__ = ("_added", "_backend", "_byte_fallback", "_byte_level", "_chat", "_metaspace",
                 "bos_token", "chat_templates", "eos_token", "name", "special_tokens",
                 "stop_ids", "vocab_size")

    def __init__(self, backend: _Backend, *, name: str, stop_ids: frozenset[int],
                 special_tokens: Mapping[str, str],
                 chat_templates: Mapping[str, str] | None = None) -> None:
        self._backend = backend
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.stop_ids = stop_ids
        self.special_tokens = dict(special_tokens)
        """Named special tokens (`bos_token`, `eos_token`, ...) as the chat template sees them."""
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.chat_templates = dict(chat_templates or {})
        """Template sources by name; "default" is the one `encode_chat` uses."""
        default = self.chat_templates.get("default")
        self._chat = ChatTemplate(default) if default is not None else None
        spec = json.loads(backend.to_str())
        decoder = json.dumps(spec.get("decoder"), ensure_ascii=False)
        self._byte_level = '"ByteLevel"' in decoder
        self._metaspace = _METASPACE in decoder or '"Metaspace"' in decoder
        self._byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        self._added = {int(t["id"]) for t in spec.get("added_tokens", [])}

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """`bos=True` applies the tokenizer's post-processor (its BOS/EOS rules), as transformers'
        `encode` does by default; False encodes the bare text."""
        try:
            ids: list[int] = self._backend.encode(text, add_special_tokens=bos).ids
        except TypeError as exc:  # the library's answer to a lone surrogate
            raise ValueError(f"text is not valid Unicode (a lone surrogate?): {exc}") from exc
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def stream_decoder(self, *, skip_special_tokens: bool = True,
                       spaces_between_special_tokens: bool = True) -> HFStreamDecoder:
        return HFStreamDecoder(self, skip_special_tokens=skip_special_tokens,
                               join_specials=not (skip_special_tokens
                                                  or spaces_between_special_tokens))

    def token_text(self, token_id: int) -> str:
        return str(self._backend.id_to_token(token_id) or "")

    def added_token_text(self, token_id: int) -> str | None:
        """An added (special) token's text; None for the model's own vocabulary."""
        if token_id not in self._added:
            return None
        return str(self._backend.id_to_token(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, even when they are part of a character (a byte-level
        or byte-fallback piece); an added token is its text, an unknown id nothing."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return str(piece).encode()
        if self._byte_fallback and (m := _BYTE_FALLBACK_TOKEN.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self._byte_level:
            table = _byte_level_decoding()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if self._metaspace:
            return str(piece).replace(_METASPACE, " ").encode()
        return self.decode([token_id]).encode()

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> str:
        if self._chat is None:
            raise ValueError(f"tokenizer {self.name} has no chat template (no chat_template in "
                             "tokenizer_config.json, no chat_template.jinja); send a prompt to "
                             "/v1/completions instead")
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt,
                                 special_tokens=self.special_tokens)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> list[int]:
        """The template writes every special token itself (BOS included), so the text is
        encoded without the post-processor, as `apply_chat_template(tokenize=True)` does."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, bos=False)


class HFStreamDecoder:
    """Incremental text of a token stream (see the module docstring)."""

    __slots__ = ("_ids", "_join_specials", "_last_special", "_prefix", "_read", "_skip", "_tok")

    def __init__(self, tokenizer: HFTokenizer, *, skip_special_tokens: bool = True,
                 join_specials: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._join_specials = join_specials
        self._last_special = False
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the window decoded for context (its first token's text is never emitted
        again: decoders that strip a leading space do so on both decodes alike)."""
        self._read = 0
        """End of what has been emitted."""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        special = self._tok.added_token_text(token_id) if self._join_specials else None
        after_special, self._last_special = self._last_special, special is not None
        if special is not None and after_special and self._prefix == self._read == len(
                self._ids) - 1:
            self._prefix = self._read = len(self._ids)  # its bare text, no joining space
            return special
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)
