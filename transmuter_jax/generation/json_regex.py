"""The regex of a closed JSON schema as llguidance reads it, for a device table.

outlines-core compiles the schema's structure (closed objects, arrays, enums, consts, anyOf,
booleans, nulls); the values it reads otherwise than llguidance 1.9 are put in as llguidance
takes them (docs/structured-output.md): a string of any characters but ``"``, ``\\``, U+0000 to
U+001F and U+007F, with the escapes ``\\" \\\\ \\b \\f \\n \\r \\t`` and ``\\u00XX`` of those
control characters, lengths counted in characters; a date (``format: date``); a number with
an exponent sign optional; an integer's bounds. Local ``$ref`` s without cycles are inlined first.

A ``oneOf`` is written as an ``anyOf`` (llguidance refuses one whose schemas overlap), a list
of types as an ``anyOf`` of one schema per type. A schema this module cannot write exactly
(open objects, formats but date, unanchored patterns, bounded numbers, ``allOf``, recursion)
gives None: it runs on the host.
"""

from __future__ import annotations

import json
import math
from typing import Any

CHAR = r'(?:[^"\\\x00-\x1F\x7F]|\\["\\bfnrt]|\\u00(?:[01][0-9a-fA-F]|7[fF]))'
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
DATE = (  # format "date": llguidance checks each month's days (February's up to 29)
    r'"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])'
    r'|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|[12][0-9]))"'
)
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
     "readOnly", "writeOnly"}
)  # fmt: skip
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_NODES = 20_000  # schemas once $refs are inlined (a DAG of $refs may double at each level)
MAX_BOUND = 2**53  # integer bounds beyond this are left to llguidance (host rows)
MARK = "tjm{}x"  # a const outlines-core writes as is; each is replaced by a value's regex
_KEYWORDS = {  # the keywords that apply to each type (for a list of types)
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": (*BOUNDS, "multipleOf"),
    "integer": (*BOUNDS, "multipleOf"),
    "object": ("properties", "required", "additionalProperties", "minProperties",
               "maxProperties", "patternProperties", "propertyNames"),
    "array": ("items", "minItems", "maxItems", "prefixItems", "uniqueItems", "contains"),
}  # fmt: skip


class Recursive(ValueError):
    """A schema whose references form a cycle (or leave the document)."""


def inline(schema: Any) -> Any:
    """``schema`` with every local ``$ref`` (``#/$defs/...``, ``#/definitions/...``) replaced by
    the schema it names, and ``$defs`` / ``definitions`` dropped.

    Raises:
        Recursive: for a cycle of references, one this function cannot follow, or a schema
            nested too deeply or too large once inlined.
    """

    def target(ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise Recursive(f"a $ref outside the document: {ref!r:.60}")
        node = schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise Recursive(f"a $ref to nothing: {ref!r:.60}")
            node = node[part]
        return node

    made = [0]

    def walk(node: Any, seen: tuple[str, ...]) -> Any:
        made[0] += 1
        if made[0] > MAX_NODES:
            raise Recursive(f"over {MAX_NODES} schemas once its $refs are inlined")
        if isinstance(node, list):
            return [walk(n, seen) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            ref = node["$ref"]
            if ref in seen:
                raise Recursive(f"a recursive $ref: {ref!r:.60}")
            if set(node) - ANNOTATIONS - {"$ref", "$defs", "definitions"}:
                raise Recursive("a $ref beside other keywords")
            return walk(target(ref), (*seen, ref))
        out = {}
        for key, value in node.items():
            if key in ("$defs", "definitions"):
                continue
            if key in ("properties", "enum", "const"):
                out[key] = (
                    value if key != "properties" or not isinstance(value, dict)
                    else {k: walk(v, seen) for k, v in value.items()}
                )  # fmt: skip
            else:
                out[key] = walk(value, seen)
        return out

    try:
        return walk(schema, ())
    except RecursionError:
        raise Recursive("nested too deeply") from None


def pattern(text: str) -> str | None:
    """The regex of the schema ``text`` (JSON) whose strings are llguidance's compact JSON
    documents valid under it (separators "," and ":"), or None where this module cannot write
    it exactly."""
    try:
        schema = inline(json.loads(text))
    except (Recursive, RecursionError):
        return None
    values: list[str] = []
    try:
        marked = _marked(schema, values)
    except RecursionError:
        return None
    if marked is None or any(MARK.format(i) in text for i in range(len(values))):
        return None
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(json.dumps(marked), whitespace_pattern="")
    for i, value in enumerate(values):
        quoted = f'"{MARK.format(i)}"'
        if quoted not in regex:
            return None
        regex = regex.replace(quoted, f"(?:{value})")
    return regex


def _marked(node: Any, values: list[str]) -> Any:
    """``node`` with each string, number and bounded integer a marked const (its regex appended
    to ``values``), or None where a node cannot be written exactly."""
    if not isinstance(node, dict):
        return None
    keys = set(node) - ANNOTATIONS
    if "enum" in node or "const" in node:
        return node if keys <= {"enum", "const", "type"} else None
    for key in ("anyOf", "oneOf"):  # llguidance takes a oneOf only where it is an anyOf
        if key in node:
            subs = node[key]
            if keys != {key} or not isinstance(subs, list) or not subs:
                return None
            marked = [_marked(sub, values) for sub in subs]
            return None if any(m is None for m in marked) else {"anyOf": marked}
    kind = node.get("type")
    if isinstance(kind, list):  # one schema per type, each with the keywords of its type
        applies = {k for t in kind for k in _KEYWORDS.get(str(t), ())}
        if not kind or len(set(map(str, kind))) < len(kind) or keys - {"type", *applies}:
            return None
        subs = [
            {"type": t, **{k: node[k] for k in _KEYWORDS.get(t, ()) if k in node}} for t in kind
        ]
        return _marked({"anyOf": subs}, values)
    if kind in ("boolean", "null"):
        return node if keys == {"type"} else None
    if kind == "string":
        if keys <= {"type", "minLength", "maxLength"}:
            return _value(values, _string(node))
        if keys == {"type", "format"} and node["format"] == "date":
            return _value(values, DATE)
        return node if keys == {"type", "pattern"} and _anchored(node["pattern"]) else None
    if kind == "number":
        return _value(values, NUMBER) if keys == {"type"} else None
    if kind == "integer":
        if keys == {"type"}:
            return node
        return _value(values, _integer(node)) if keys <= {"type", *BOUNDS} else None
    if kind == "object":
        props = node.get("properties", {})
        required = node.get("required", [])
        if (
            keys - {"type", "properties", "required", "additionalProperties"}
            or node.get("additionalProperties") is not False
            or not isinstance(props, dict)
            or not isinstance(required, list)
            or not set(required) <= set(props)
        ):
            return None
        marked = {k: _marked(v, values) for k, v in props.items()}
        if any(m is None for m in marked.values()):
            return None
        return {**node, "properties": marked}
    if kind == "array":
        if keys - {"type", "items", "minItems", "maxItems"} or not isinstance(
            node.get("items"), dict
        ):
            return None
        items = _marked(node["items"], values)
        return None if items is None else {**node, "items": items}
    return None


def _value(values: list[str], regex: str | None) -> dict | None:
    if regex is None:
        return None
    values.append(regex)
    return {"const": MARK.format(len(values) - 1)}


def _count(node: dict, key: str) -> int | None:
    value = node.get(key)
    return value if type(value) is int and value >= 0 else None


def _string(node: dict) -> str | None:
    """A JSON string of ``minLength`` to ``maxLength`` characters."""
    low, high = _count(node, "minLength"), _count(node, "maxLength")
    if ("minLength" in node and low is None) or ("maxLength" in node and high is None):
        return None
    low = low or 0
    if high is not None and high < low:
        return None
    if high is None:
        reps = "*" if low == 0 else f"{{{low},}}"
    else:
        reps = f"{{{low},{high}}}"
    return f'"{CHAR}{reps}"'


def _anchored(regex: Any) -> bool:
    """Whether a string's ``pattern`` is anchored at both ends (outlines-core and llguidance
    then take the same strings)."""
    if not isinstance(regex, str):
        return False
    body = regex[:-1]
    slashes = len(body) - len(body.rstrip("\\"))  # an odd count escapes the final "$"
    return regex.startswith("^") and regex.endswith("$") and slashes % 2 == 0


def _bound(node: dict, key: str) -> float | None:
    value = node.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or abs(value) > MAX_BOUND:
        raise ValueError(key)
    return value


def _integer(node: dict) -> str | None:
    """The canonical decimals of the integers within ``node``'s bounds, as llguidance takes
    them (it also takes "-0" without bounds, or where both are given and hold 0 and -1)."""
    try:
        low = [_bound(node, "minimum"), _bound(node, "exclusiveMinimum")]
        high = [_bound(node, "maximum"), _bound(node, "exclusiveMaximum")]
    except ValueError:
        return None
    lows = [math.ceil(low[0])] if low[0] is not None else []
    lows += [math.floor(low[1]) + 1] if low[1] is not None else []
    highs = [math.floor(high[0])] if high[0] is not None else []
    highs += [math.ceil(high[1]) - 1] if high[1] is not None else []
    lo, hi = max(lows, default=None), min(highs, default=None)
    if lo is not None and hi is not None and lo > hi:
        return None  # nothing valid: llguidance refuses the schema
    parts = []
    if lo is None or lo < 0:  # the negatives: "-" and the magnitudes
        top = None if lo is None else -lo
        bottom = 1 if hi is None or hi >= 0 else -hi
        parts.append(f"-(?:{_naturals(bottom, top)})")
    if hi is None or hi >= 0:
        parts.append(_naturals(max(lo or 0, 0), hi))
    if (lo is None and hi is None) or (lo is not None and hi is not None and lo < 0 <= hi):
        parts.append("-0")
    return "|".join(f"(?:{p})" for p in parts)


def _naturals(lo: int, hi: int | None) -> str:
    """The canonical decimals of ``lo`` to ``hi`` (None: no end), ``0 <= lo``."""
    digits = len(str(lo))
    if hi is None:
        rest = f"[1-9][0-9]{{{digits},}}"
        return f"{_naturals(lo, 10**digits - 1)}|{rest}"
    parts = []
    for n in range(digits, len(str(hi)) + 1):
        first = 10 ** (n - 1) if n > 1 else 0
        parts.append(_same_length(str(max(lo, first)), str(min(hi, 10**n - 1))))
    return "|".join(f"(?:{p})" for p in parts)


def _same_length(lo: str, hi: str) -> str:
    """A regex of the decimals from ``lo`` to ``hi``, strings of one length, ``lo <= hi``."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return lo[0] + f"(?:{_same_length(lo[1:], hi[1:])})"
    rest = len(lo) - 1
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        return f"[{lo[0]}-{hi[0]}][0-9]{{{rest}}}"
    parts = [lo[0] + f"(?:{_same_length(lo[1:], '9' * rest)})"]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{rest}}}")
    parts.append(hi[0] + f"(?:{_same_length('0' * rest, hi[1:])})")
    return "|".join(f"(?:{p})" for p in parts)
