"""Chat templates: render a model's Jinja chat template as transformers 4.57 does, in a sandbox.

A chat template comes from a model repository, so it is untrusted code. It is compiled in
`jinja2.sandbox.ImmutableSandboxedEnvironment`, with the environment of transformers'
`apply_chat_template`: `trim_blocks`, `lstrip_blocks`, the loop-controls extension
(`{% break %}`, `{% continue %}`), a `{% generation %}` block (rendered as its body), the
`tojson` filter without HTML escaping, and the globals `raise_exception` and `strftime_now`.
The sandbox refuses access to private attributes (`__class__`, ...) and mutation of the
variables (`list.append`, ...) with `jinja2.exceptions.SecurityError`.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "check_messages", "compile_template", "render"]

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A chat template does not compile, or it called `raise_exception`."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text; renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: object) -> None:
    raise ChatTemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@functools.lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    return _ENV.from_string(template)


def compile_template(template: str, template_name: str = "chat template") -> jinja2.Template:
    """The compiled (and cached) template.

    Raises:
        ChatTemplateError: the template has a syntax error.
    """
    if not isinstance(template, str):
        raise TypeError(f"{template_name} must be a str, got {type(template).__name__}")
    try:
        return _compile(template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"{template_name} has a syntax error on line {error.lineno}: {error.message}"
        ) from error


def check_messages(messages: object) -> None:
    """Check that `messages` is a non-empty list of dicts with a str "role" and a "content".

    "content" may be a str, a list of content blocks or None; it may be left out of a message
    that has "tool_calls".

    Raises:
        TypeError: `messages` or a message or a field has the wrong type.
        ValueError: `messages` is empty, or a message lacks "role" or "content".
    """
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of dicts with 'role' and 'content', got "
            f"{type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(
                f"messages[{index}] must be a dict with 'role' and 'content', got "
                f"{type(message).__name__}"
            )
        if "role" not in message:
            raise ValueError(
                f"messages[{index}] has no 'role' (its keys: {sorted(map(str, message))})"
            )
        role = message["role"]
        if not isinstance(role, str):
            raise TypeError(f"messages[{index}]['role'] must be a str, got {type(role).__name__}")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"messages[{index}] (role {role!r}) has no 'content'")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list | tuple):
            raise TypeError(
                f"messages[{index}]['content'] must be a str, a list of content blocks or None, "
                f"got {type(content).__name__}"
            )


def _check_dicts(values: object, what: str) -> None:
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a list of dicts, got {type(values).__name__}")
    for index, value in enumerate(values):
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}[{index}] must be a dict, got {type(value).__name__}")


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_name: str = "chat template",
    **extra: Any,
) -> str:
    """Render one conversation as transformers' `apply_chat_template(..., tokenize=False)`.

    The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the special
    tokens (`bos_token`, `eos_token`, ...) and `extra`; `extra` overrides a special token of the
    same name. `tools` are JSON schemas (dicts); transformers' conversion of Python functions is
    not done. With `continue_final_message`, the text ends with the last message's content (the
    template's end-of-turn markup after it is cut), so the model continues that message.

    Raises:
        TypeError, ValueError: malformed `messages`, `tools` or `documents` (see `check_messages`).
        ChatTemplateError: the template has a syntax error or called `raise_exception`.
        jinja2.exceptions.SecurityError: the template tried an unsafe operation.
    """
    check_messages(messages)
    if tools is not None:
        _check_dicts(tools, "tools")
    if documents is not None:
        _check_dicts(documents, "documents")
    compiled = compile_template(template, template_name)

    final_text: str | None = None
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible; "
                "pass add_generation_prompt=False to continue the last message"
            )
        messages, final_text = _tag_final_message(messages)

    variables = {**special_tokens, **extra}
    try:
        text = compiled.render(
            messages=messages,
            tools=list(tools) if tools is not None else None,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except ChatTemplateError as error:
        raise ChatTemplateError(f"{template_name} raised an error: {error.message}") from error

    if final_text is not None:
        text = _cut_after_final_message(text, final_text)
    return text


def _tag_final_message(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[Mapping[str, Any]], str]:
    """A copy of `messages` whose last text ends with a marker, and that text."""
    tagged = copy.deepcopy(list(messages))
    final = tagged[-1]
    content = final.get("content")
    if isinstance(content, list | tuple):
        for block in reversed(content):
            if isinstance(block, Mapping) and "text" in block:
                text = str(block["text"])
                block["text"] = text + _CONTINUE_TAG
                return tagged, text
        raise ValueError(
            "continue_final_message is set but the last message has no text block to continue"
        )
    if not isinstance(content, str):
        raise ValueError("continue_final_message is set but the last message has no text content")
    final["content"] = content + _CONTINUE_TAG
    return tagged, content


def _cut_after_final_message(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the chat template did not render the last "
            "message unchanged, so the text cannot end with it"
        )
    where = text.rindex(tag)
    if text[where : where + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:where]
    # The template trimmed the space after the marker, so it may have trimmed the content too.
    return text[:where].rstrip()
