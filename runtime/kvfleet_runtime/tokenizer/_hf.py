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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as _Backend

from kvfleet_runtime.tokenizer._chat import ChatTemplate

__all__ = ["HFStreamDecoder", "HFTokenizer"]

_REPLACEMENT = "\ufffd"


class HFTokenizer:
    """A model folder's tokenizer; built by `load_tokenizer`, which checks the folder."""

    __slots__ = ("_backend", "_chat", "bos_token", "chat_templates", "eos_token", "name",
                 "special_tokens", "stop_ids", "vocab_size")

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

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """`bos=True` applies the tokenizer's post-processor (its BOS/EOS rules), as transformers'
        `encode` does by default; False encodes the bare text."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=bos).ids
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=True))

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self)

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

    __slots__ = ("_ids", "_prefix", "_read", "_tok")

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the window decoded for context (its first token's text is never emitted
        again: decoders that strip a leading space do so on both decodes alike)."""
        self._read = 0
        """End of what has been emitted."""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        now = self._tok.decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]

    def flush(self) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read])
        now = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):]
