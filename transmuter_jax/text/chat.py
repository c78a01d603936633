"""Chat templates: render a model's Jinja chat template as transformers 4.57 does, in a sandbox.

A chat template comes from a model repository, so it is untrusted code. It is compiled in
`jinja2.sandbox.ImmutableSandboxedEnvironment`, with the environment of transformers'
`apply_chat_template`: `trim_blocks`, `lstrip_blocks`, the loop-controls extension
(`{% break %}`, `{% continue %}`), a `{% generation %}` block (rendered as its body), the
`tojson` filter without HTML escaping, and the globals `raise_exception` and `strftime_now`.
The sandbox refuses access to private attributes (`__class__`, ...) and mutation of the
variables (`list.append`, ...) with `jinja2.exceptions.SecurityError`.

A render is also limited, so that a hostile template fails fast with `ChatTemplateLimitError`
instead of hanging or filling the memory: at most `MAX_STEPS` loop iterations and calls, at most
`TIME_LIMIT` seconds, and no string or list (nor the output) longer than `MAX_CHARS`: checked
before the operators `*`, `**`, `+`, `%` and `~` and the calls that build long strings
(`replace`, `join`, `expandtabs`, padding to a width), and after every other filter and call.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplateError",
    "ChatTemplateLimitError",
    "check_messages",
    "compile_template",
    "render",
]

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

MAX_CHARS = 10_000_000  # the longest string or list a template may build, and its output
MAX_STEPS = 1_000_000  # loop iterations, calls and operators in one render
TIME_LIMIT = 5.0  # seconds for one render
MAX_POWER_BITS = 1 << 16  # the largest integer ** may build, in bits


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A chat template does not compile, or it called `raise_exception`."""


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template went past a limit of a render (time, steps or size)."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text; renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Budget:
    """What one render may still spend: steps and time."""

    def __init__(self, name: str):
        self.name = name
        self.steps = 0
        self.deadline = time.monotonic() + TIME_LIMIT

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise ChatTemplateLimitError(
                f"it ran more than {MAX_STEPS:,} loop iterations and calls"
            )
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(f"it took more than {TIME_LIMIT} s")


_active = threading.local()


def _budget() -> _Budget | None:
    return getattr(_active, "budget", None)


def _step() -> None:
    budget = _budget()
    if budget is not None:
        budget.step()


def _too_long(length: int, what: str) -> None:
    if length > MAX_CHARS:
        raise ChatTemplateLimitError(
            f"it builds {what} of {length:,} items, more than the limit of {MAX_CHARS:,}"
        )


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


# A width or precision of eight digits or more in a format string: "%99999999d", "{:>99999999}".
_WIDE_FORMAT = re.compile(r"%[-+ #0]*\d{8,}|%[-+ #0]*\d*\.\d{8,}|\{[^{}]*:[^{}]*\d{8,}[^{}]*\}")
_INDENT_LIMIT = 1000  # the widest indent tojson and indent may take


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_call(value: Any, name: str, args: tuple, kwargs: dict) -> None:
    """Refuses a call ``name`` on the string ``value`` (a method, a filter or ``%``) that would
    build one past MAX_CHARS; what other calls build is checked after them."""
    if not isinstance(value, str):
        return
    given = (*args, *kwargs.values())
    if any(_integer(a) and a > MAX_CHARS for a in given):
        _too_long(max(a for a in given if _integer(a)), "a string")
    if name in ("%", "format", "format_map") and _WIDE_FORMAT.search(value):
        raise ChatTemplateLimitError(f"it formats a value to a width of {MAX_CHARS:,} or more")
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str):
        old, new = args[0], args[1]
        times = value.count(old) if old else len(value) + 1
        _too_long(len(value) + times * max(0, _size(new) - len(old)), "a string (with replace)")
    elif name == "expandtabs":
        width = args[0] if args else kwargs.get("tabsize", 8)
        if _integer(width):
            _too_long(len(value) + value.count("\t") * width, "a string (with expandtabs)")
    elif name in ("indent", "tojson", "wordwrap"):
        for width in given:
            if _integer(width) and width > _INDENT_LIMIT or _size(width) > _INDENT_LIMIT:
                raise ChatTemplateLimitError(
                    f"it calls {name} with an argument of more than {_INDENT_LIMIT} (characters)"
                )


def _check_join(joiner: Any, items: Any) -> None:
    if isinstance(items, list | tuple):
        total = sum(_size(i) for i in items) + len(items) * _size(joiner)
        _too_long(total, "a string (with join)")


def _limited_filter(name: str, fn: Any) -> Any:
    """``fn``, checked: before, its arguments; after, the size of its result."""

    @functools.wraps(fn)
    def limited(*args: Any, **kwargs: Any) -> Any:
        _step()
        # The value a filter works on follows the context, eval context or environment.
        skip = (jinja2.runtime.Context, jinja2.Environment, nodes.EvalContext)
        values = [a for a in args if not isinstance(a, skip)]
        if values:
            if name == "tojson":  # its value is data, not a string; its indent is checked
                _check_call("", name, tuple(values[1:]), kwargs)
            else:
                _check_call(values[0], name, tuple(values[1:]), kwargs)
            if name == "join":
                _check_join(values[1] if len(values) > 1 else kwargs.get("d", ""), values[0])
        result = fn(*args, **kwargs)
        _too_long(_size(result), f"a value (filter {name!r})")
        return result

    return limited


def _counted(iterable: Any) -> Any:
    """The items of a for loop, each counted as a step."""
    for item in iterable:
        _step()
        yield item


class _LimitedCodeGenerator(CodeGenerator):
    """Compiles `~` to a call that checks the length of the result before building it."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.limited_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the limits of one render (see the module's docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _LimitedCodeGenerator

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "counted_loop", [], [], None, None)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        if operator == "*":
            for value, times in ((left, right), (right, left)):
                if _size(value) and isinstance(times, int) and times > 1:
                    _too_long(_size(value) * times, "a string or list (with *)")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise ChatTemplateLimitError(
                        f"it computes {left} ** {right}, an integer of more than "
                        f"{MAX_POWER_BITS:,} bits"
                    )
        elif operator == "+" and _size(left) and _size(right):
            _too_long(_size(left) + _size(right), "a string or list (with +)")
        elif operator == "%":
            _check_call(left, "%", right if isinstance(right, tuple) else (right,), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _step()
        # A bound method, or the sandbox's wrapper of one (str.format).
        method = getattr(__obj, "__wrapped__", __obj)
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        _check_call(owner, name, args, kwargs)
        if name == "join" and isinstance(owner, str) and args:
            _check_join(owner, args[0])
        result = super().call(__context, __obj, *args, **kwargs)
        _too_long(_size(result), "a value (a call)")
        return result

    def limited_concat(self, values: tuple) -> str:
        pieces = [str(v) for v in values]
        _too_long(sum(len(p) for p in pieces), "a string (with ~)")
        return "".join(pieces)


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
    env = _LimitedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["counted_loop"] = _counted
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
    text = _render_limited(
        compiled,
        template_name,
        messages=messages,
        tools=list(tools) if tools is not None else None,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )

    if final_text is not None:
        text = _cut_after_final_message(text, final_text)
    return text


def _render_limited(compiled: jinja2.Template, template_name: str, **variables: Any) -> str:
    """``compiled`` rendered within the limits of one render (see the module's docstring)."""
    outer = _budget()
    _active.budget = _Budget(template_name)
    pieces: list[str] = []
    total = 0
    try:
        for piece in compiled.generate(**variables):
            total += len(piece)
            _too_long(total, "an output")
            pieces.append(piece)
    except ChatTemplateLimitError as error:
        raise ChatTemplateLimitError(
            f"{template_name} exceeds a limit of a render: {error.message}; a template that "
            "needs this much is broken or hostile (pass a chat template of your own)"
        ) from None
    except ChatTemplateError as error:
        raise ChatTemplateError(f"{template_name} raised an error: {error.message}") from error
    except (MemoryError, RecursionError) as error:
        raise ChatTemplateLimitError(
            f"{template_name} exceeds a limit of a render: {type(error).__name__} (too deep "
            "or too large); a template that needs this much is broken or hostile (pass a chat "
            "template of your own)"
        ) from None
    finally:
        _active.budget = outer
    return "".join(pieces)


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
