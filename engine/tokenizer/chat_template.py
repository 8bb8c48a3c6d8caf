"""Render a checkpoint's jinja chat template the way Hugging Face transformers does.

Templates ship inside checkpoints, so they are untrusted code: they run in
jinja's ``ImmutableSandboxedEnvironment``, with the same options and helpers
transformers provides (``trim_blocks``/``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now``, a non-escaping ``tojson`` and the
``{% generation %}`` block), so a prompt renders byte-identically to
``tokenizer.apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or fails while rendering."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc


class ChatTemplate:
    """A compiled chat template bound to a tokenizer's special tokens."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self._template = _compile(source)
        # Extra specials first so bos/eos always take the tokenizer's values.
        self._variables: dict[str, Any] = {
            **(special_tokens or {}),
            "bos_token": bos_token,
            "eos_token": eos_token,
        }

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt for ``messages``; ``variables`` (``tools``, ``enable_thinking``, ...) reach the template."""
        context = {
            **self._variables,
            **variables,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def render_chat_template(
    source: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **variables: Any,
) -> str:
    """Render ``source`` once; ``None`` (a model without a template) raises ChatTemplateError."""
    if source is None:
        raise ChatTemplateError(
            "this model has no chat template; send a plain prompt instead of chat messages"
        )
    template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
    return template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
