"""Chat-template rendering with the Hugging Face conventions, in a Jinja2 sandbox.

Templates come from model files, i.e. from strangers, so they run in Jinja2's
``ImmutableSandboxedEnvironment``. The environment mirrors ``transformers``' own
(``chat_template_utils._compile_jinja_template``) so that a render here is byte-identical to
``tokenizer.apply_chat_template(..., tokenize=False)``: ``trim_blocks``/``lstrip_blocks``,
``loopcontrols``, a no-op ``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps key order and non-ASCII text and does not HTML-escape (Jinja2's built-in
filter sorts keys and escapes ``<``), and a ``namespace`` that refuses underscore attributes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateError", "render_chat_template", "template_mentions"]


class TemplateError(ValueError):
    """The template failed to compile or render (including its own ``raise_exception``)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: transformers tracks assistant spans; we render."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's declared class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses dunder/underscore attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # self in *args: namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: insertion order, non-ASCII kept, no HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _make_dict
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc


def _drop_none(message: Mapping[str, Any]) -> dict[str, Any]:
    # transformers drops None-valued keys: templates handle a missing key, not a literal None.
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = out.get("reasoning_content")
    if reasoning is not None:
        # transformers aliases replayed reasoning under ``thinking`` too (gpt-oss templates).
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def template_mentions(template: str, name: str) -> bool:
    """Return True when the template reads the context variable ``name`` (e.g. enable_thinking)."""
    return _mentions(template, name)


@lru_cache(maxsize=128)
def _mentions(template: str, name: str) -> bool:
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        return name in meta.find_undeclared_variables(env.parse(template))
    except jinja2.exceptions.TemplateSyntaxError:
        return False


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **template_kwargs: object,
) -> str:
    """Render a conversation the way ``transformers.apply_chat_template(tokenize=False)`` does.

    Args:
        template: The Jinja2 chat template source.
        messages: Hugging Face style message dicts (``role``, ``content``, ``tool_calls`` ...).
        tools: JSON-schema tool dicts (``{"type": "function", "function": {...}}``) or None.
        add_generation_prompt: Append the assistant turn header.
        bos_token: Exposed to the template as ``bos_token`` (omitted when None).
        eos_token: Exposed to the template as ``eos_token`` (omitted when None).
        **template_kwargs: Passed to the template untouched (``chat_template_kwargs``).

    Returns:
        The rendered prompt text.

    Raises:
        TemplateError: the template does not compile, raised an exception, or broke the sandbox.
    """
    compiled = _compile(template)
    context: dict[str, Any] = {}
    if bos_token is not None:
        context["bos_token"] = bos_token
    if eos_token is not None:
        context["eos_token"] = eos_token
    context.update(template_kwargs)
    try:
        return compiled.render(
            messages=[_drop_none(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateError(f"chat template failed: {exc}") from exc
