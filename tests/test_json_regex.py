"""json_regex writes the JSON values llguidance takes: each regex's strings equal llguidance's
own matcher's on many candidates (integer bounds, strings, numbers), and the schemas it cannot
write exactly give None."""

import json
import pathlib
import random
import re

import pytest

from transmuter_jax.generation import json_regex as jr

llguidance = pytest.importorskip("llguidance")

TOKENIZER = str(pathlib.Path(__file__).parent / "fixtures" / "llama-optimum" / "tokenizer.json")
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
VALUES = [None, -1000, -120, -100, -99, -10, -9, -5, -2, -1, -0.5, 0, 0.5, 1, 2, 9, 10, 11, 99,
          100, 120, 999, 1000]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return llguidance.LLTokenizer(TOKENIZER, n_vocab=512, eos_token=[3])


def _takes(tok, schema: dict, texts: list[str]) -> set[str] | None:
    """The texts llguidance's matcher of ``schema`` takes as a whole document (None: it
    refuses the schema)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=COMPACT)
    start = llguidance.LLMatcher(tok, grammar, log_level=0)
    if start.is_error():
        return None
    taken = set()
    for text in texts:
        matcher = start.deep_copy()
        tokens = tok.tokenize_bytes(text.encode())
        if matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting():
            taken.add(text)
    return taken


def _integers(bounds: dict) -> list[str]:
    near = {0, 1, 9, 10, 99, 100, 999, 1000, 1001}
    for v in bounds.values():
        near |= {int(v) + d for d in range(-3, 4)}
    near |= {-n for n in near}
    return sorted(str(n) for n in near) + ["-0", "00", "01", "-01", "1.0", "1e2", "", "-"]


def _bounds(count: int, seed: int) -> list[dict]:
    rng, out = random.Random(seed), [{}]
    while len(out) < count:
        picked = {k: rng.choice(VALUES) for k in jr.BOUNDS if rng.random() < 0.45}
        out.append({k: v for k, v in picked.items() if v is not None})
    return out


def _check_integers(tok, bounds: dict):
    node = {"type": "integer", **bounds}
    texts = _integers(bounds)
    want = _takes(tok, node, texts)
    regex = jr._integer(node)
    if want is None:  # llguidance refuses bounds no integer meets: no regex either
        assert regex is None, bounds
        return
    have = set() if regex is None else {t for t in texts if re.fullmatch(regex, t)}
    assert have == want, (bounds, sorted(have - want), sorted(want - have))


@pytest.mark.parametrize("bounds", _bounds(40, 0), ids=str)
def test_integer_bounds_take_llguidances_integers(tok, bounds):
    _check_integers(tok, bounds)


def test_integer_bounds_sweep(tok):
    for bounds in _bounds(400, 1):
        _check_integers(tok, bounds)


STRINGS = ["", "a", "ab", "abc", "abcd", "\\u0041", "\\u001f", "\\u001F", "\\u007f", "\\u007F",
           "\\u0000", "\\u00e9", "\\u0020", "\\/", "\\b", "\\f", "\\n\\r\\t", '\\"', "\\\\", "\\",
           '"', "\x7f", "\x1f", "\u0085", "\u00a0", "é", "😀", "😀😀😀", "é\\n\\u0001",
           "\\ud83d", "\\x41", "a\\", "\t"]  # fmt: skip


@pytest.mark.parametrize(
    "node",
    [{"type": "string"}, {"type": "string", "minLength": 1, "maxLength": 3},
     {"type": "string", "maxLength": 0}, {"type": "string", "minLength": 2}],
    ids=["any", "1-3", "empty", "2-"],
)  # fmt: skip
def test_strings_are_llguidances_strings(tok, node):
    texts = [f'"{s}"' for s in STRINGS] + ["a", '"', '"a', 'a"']
    want = _takes(tok, node, texts)
    have = {t for t in texts if re.fullmatch(jr._string(node), t)}
    assert have == want
    assert want  # the candidates hold strings each side of the rule


def test_dates_are_llguidances_dates(tok):
    node = {"type": "string", "format": "date"}
    days = [f"{m:02d}-{d:02d}" for m in range(14) for d in range(33)]
    texts = [f'"{y}-{md}"' for y in ("2024", "2023", "0000") for md in days]
    texts += ['"2024-1-01"', '"10000-01-01"', '"+2024-01-01"', '"2024-01-01T00:00"', "2024-01-01"]
    want = _takes(tok, node, texts)
    assert len(want) == 3 * 366  # every year's days, February's 29th too
    node = jr.pattern(json.dumps(node))
    assert {t for t in texts if re.fullmatch(node, t)} == want


def test_numbers_are_llguidances_numbers(tok):
    texts = "1 -0 01 1. 1.0 1e5 1E+5 1e-05 -1.5e3 0.0e0 1.50 .5 - 1e 1.5E-0 -01.0 0e+0 +1 1.5.5"
    texts = texts.split() + ["123456789012345"]
    want = _takes(tok, {"type": "number"}, texts)
    assert {t for t in texts if re.fullmatch(jr.NUMBER, t)} == want


def test_a_schema_pattern_takes_what_llguidance_takes(tok):
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "name": {"$ref": "#/$defs/name"},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/name"}, "maxItems": 2},
        },
        "required": ["id", "name"],
        "additionalProperties": False,
        "$defs": {"name": {"type": "string", "maxLength": 3}},
    }
    regex = jr.pattern(json.dumps(schema))
    texts = ['{"id":1,"name":"ab"}', '{"id":0,"name":"ab"}', '{"id":99,"name":"a\\nb"}',
             '{"id":5,"name":"abcd"}', '{"id":5,"name":"","score":1e5}',
             '{"id":5,"name":"","score":-0.5,"tags":["x","\\u0007"]}',
             '{"id":5,"name":"","tags":["x","y","z"]}', '{"name":"","id":5}',
             '{"id":5,"name":"","extra":1}', '{"id":5, "name":""}']  # fmt: skip
    want = _takes(tok, schema, texts)
    assert {t for t in texts if re.fullmatch(regex, t)} == want
    assert len(want) == 4


@pytest.mark.parametrize(
    "schema",
    [
        {"type": ["string", "null"], "maxLength": 3},
        {"type": ["integer", "boolean"], "minimum": 0},  # the bound is the integer's
        {"type": ["integer", "number"]},
        {"oneOf": [{"type": "string", "minLength": 2}, {"type": "null"}]},  # disjoint: an anyOf
    ],
    ids=["string-null", "integer-boolean", "integer-number", "oneOf"],
)
def test_type_lists_and_one_of_take_llguidances_values(tok, schema):
    regex = jr.pattern(json.dumps(schema))
    texts = ["1", "-0", "1.5", "true", "null", '""', '"a"', '"abc"', '"abcd"', "[]", "{}"]
    want = _takes(tok, schema, texts)
    assert want and {t for t in texts if re.fullmatch(regex, t)} == want


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}},  # open: other properties
        {"type": "string", "format": "date-time"},
        {"type": "string", "format": "date", "maxLength": 10},
        {"type": "string", "pattern": "[a-z]+"},  # a search
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        {"type": "number", "minimum": 0},
        {"type": "integer", "multipleOf": 2},
        {"allOf": [{"type": "integer"}, {"minimum": 2}]},
        {"type": ["string", "null"], "uniqueItems": True},  # a keyword of no listed type
        {"type": "array"},
        {"$ref": "#/$defs/n", "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}},
        {"$ref": "https://example.com/schema"},
    ],
    ids=[
        "open",
        "format",
        "date-length",
        "search",
        "pattern-length",
        "number-bound",
        "multiple",
        "oneOf",
        "type-list",
        "open-array",
        "recursive",
        "remote",
    ],  # fmt: skip
)
def test_schemas_it_cannot_write_exactly_give_none(schema):
    assert jr.pattern(json.dumps(schema)) is None


def test_huge_or_deep_schemas_are_refused_quickly():
    ref = lambda i: {"$ref": f"#/$defs/d{i}"}  # noqa: E731
    defs = {f"d{i}": {"anyOf": [ref(i + 1), ref(i + 1)]} for i in range(59)}
    defs["d59"] = {"type": "integer"}  # each level names the next twice: 2**59 once inlined
    dag = {"$defs": defs, "$ref": "#/$defs/d0"}
    with pytest.raises(jr.Recursive, match="inlined"):
        jr.inline(dag)
    assert jr.pattern(json.dumps(dag)) is None
    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(jr.Recursive, match="deeply"):
        jr.inline(deep)
    assert jr.pattern(json.dumps({"type": "integer", "maximum": 1e300})) is None
    small = {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}  # a root $ref beside $defs
    assert jr.inline(small) == {"type": "integer"}


def test_refs_are_inlined_and_cycles_refused():
    schema = {"$defs": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/a"}},
              "type": "array", "items": {"$ref": "#/$defs/b"}}  # fmt: skip
    assert jr.inline(schema) == {"type": "array", "items": {"type": "integer"}}
    assert jr.inline({"enum": [{"$ref": "#/x"}]}) == {"enum": [{"$ref": "#/x"}]}  # a value
    with pytest.raises(jr.Recursive):
        jr.inline({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                   "$ref": "#/$defs/a"})  # fmt: skip
