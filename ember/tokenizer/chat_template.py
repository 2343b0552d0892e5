"""Render a model's Jinja chat template into a prompt string, exactly as transformers does.

The environment (sandbox, trim/lstrip blocks, loop controls, `tojson`, `raise_exception`,
`strftime_now`) mirrors transformers.utils.chat_template_utils so prompts match byte for byte.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers copies a message's reasoning under each of these names; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _RaisedByTemplate(jinja2.exceptions.TemplateError):
    """The template itself called raise_exception(message)."""


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render `template` over `messages`; extra kwargs (special tokens, flags) become variables."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    compiled = compile_chat_template(template)
    try:
        return compiled.render(
            messages=_prepare_messages(messages),
            tools=tools,
            documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except _RaisedByTemplate as e:
        raise ValueError(e.message) from e
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template failed to render: {e}") from e


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text; raises ValueError on a syntax error."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from e


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # As transformers does: drop None values (OpenAI clients send content=None with tool calls,
    # which templates would print as "None"), and copy reasoning under every name templates read.
    prepared = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>` and `&`, which would corrupt prompts.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts transformers' {% generation %} tag, which marks assistant text for training masks.

    Some hub templates use it; we only serve, so the block renders its body and marks nothing.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, as in transformers, so `set` inside the block stays scoped to it.
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Dict:
    """`dict` for templates, without the class attributes a template could use for type tricks."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick, so that namespace(self=...) still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed names on a namespace, got {name!r}"
        )
