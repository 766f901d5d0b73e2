"""Chat templates: a model's own Jinja template, rendered by the rules of transformers'
`apply_chat_template` (transformers 5), so the same messages give the same text.

Those rules: an immutable sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, a `tojson` filter that does not escape HTML (`ensure_ascii=False`), the
globals `raise_exception`, `strftime_now`, a `dict` constructor and a namespace that refuses
underscore names; the template sees `messages` (keys whose value is None dropped, a reasoning
field copied to `reasoning_content` and `thinking`), `tools` and `documents` (None),
`add_generation_prompt` and the named special tokens (`bos_token`, `eos_token`, ...). The
`{% generation %}` tag (assistant masks, a training feature) renders its body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body, unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` inside a template, without the class's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A Jinja namespace that refuses underscore names (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any, where: str) -> Any:
    """JSON data only reaches the template: a rich object could carry methods the sandbox trusts."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{where} is a {type(value).__name__}; chat messages hold JSON values only")


def _message(raw: Mapping[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"messages[{index}] must be an object with role and content, "
                         f"got {type(raw).__name__}")
    # Templates handle a missing key but render a None (OpenAI clients send content=None).
    message = {k: _plain(v, f"messages[{index}].{k}") for k, v in raw.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    """One compiled template; `render` raises ValueError naming what the template refused."""

    __slots__ = ("_template", "source")

    def __init__(self, source: str) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not parse: {exc.message} "
                             f"(line {exc.lineno})") from exc
        self.source = source

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               special_tokens: Mapping[str, str]) -> str:
        if not messages:
            raise ValueError("messages is empty; a chat needs at least one message")
        chat = [_message(m, i) for i, m in enumerate(messages)]
        try:
            return self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception() in the template (e.g. "roles must alternate"), an undefined
            # attribute, a sandbox refusal: all are about these messages, so a 4xx.
            raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"the model's chat template failed on these messages: "
                             f"{type(exc).__name__}: {exc}") from exc
