"""Structured output on a tiny random-weight decoder, where only the constraint makes the output
valid: json_schema, json_object, regex, grammar, choice; the masks against llguidance's own
matcher; the device table against the host path; bad constraints; the CLI flags."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import jsonschema
import lark
import llguidance
import llguidance.numpy
import numpy as np
import pytest

import transmuter_jax
from transmuter_jax import cli, text
from transmuter_jax import generation as gen
from transmuter_jax.cli.options import generation_options
from transmuter_jax.generation import GenerationError
from transmuter_jax.generation import constraints as cs

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "llama-optimum"
TOKENIZER = str(FIXTURE / "tokenizer.json")
VOCAB, EOS = 512, (3,)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        "day": {"type": "string", "format": "date"},
        "ok": {"type": "boolean"},
        "none": {"type": "null"},
        "color": {"enum": ["red", "green", 7]},
        "version": {"const": 2},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 2},
        "either": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
        "one": {"oneOf": [{"type": "boolean"}, {"enum": ["x"]}]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["id", "name", "code", "day", "ok", "none", "color", "version", "tags"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "maxLength": 3}},
}
GRAMMAR = r"""
start: greeting " " name ("!" | ".")
greeting: "hi" | "hello" | "hey"
name: NAME
NAME: /[a-z]{1,5}/
"""
REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no), [A-Z][a-z]{0,3}", r"\d{4}-\d{2}-\d{2}"]


@pytest.fixture(scope="module")
def pipe():
    return text.generation(str(FIXTURE))


def _run(pipe, prompts, **options):
    return pipe.generate(prompts, chat=False, max_new_tokens=options.pop("max_new_tokens", 80),
                         **options)  # fmt: skip


@pytest.mark.parametrize("sample", [False, True])
def test_regex_outputs_fully_match(pipe, sample):
    extra = {"do_sample": True, "seed": 7} if sample else {}
    for pattern in REGEXES:
        results = _run(pipe, ["hello", "the fox", "a b c"], regex=pattern, **extra)
        for r in results:
            assert r.finish_reason == "eos", (pattern, r)
            assert re.fullmatch(pattern, r.text), (pattern, r.text)


@pytest.mark.parametrize("sample", [False, True])
def test_json_schema_outputs_validate(pipe, sample):
    extra = {"do_sample": True, "seed": 3} if sample else {}
    for schema in (SCHEMA, json.dumps(SCHEMA)):
        results = _run(pipe, ["hello", "the fox"], json_schema=schema, max_new_tokens=200, **extra)
        for r in results:
            assert r.finish_reason == "eos", r
            document = json.loads(r.text)
            jsonschema.validate(document, SCHEMA, format_checker=jsonschema.FormatChecker())
            outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', r.text)  # the text outside strings
            assert not re.search(r"\s", outside), r.text  # compact by default


def test_json_object_and_whitespace(pipe):
    obj = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}})
    brace = llguidance.LLTokenizer(TOKENIZER, n_vocab=VOCAB).tokenize_str("{")
    space = [t for t in range(VOCAB) if pipe.tokenizer.decode([t]).isspace()]
    for flexible in (False, True):
        host = cs.HostMatcher(cs.Constraint("json_schema", obj, flexible), TOKENIZER, VOCAB, EOS)
        mask = np.asarray(cs.allowed(host.state({"prompt": [], "generated": brace}), VOCAB))
        assert mask[space].any() == flexible  # whitespace after "{" only with json_whitespace
    for r in _run(pipe, ["hello"], json_object=True, max_new_tokens=40):
        if r.finish_reason == "eos":  # any object: a random model may nest until the limit
            assert isinstance(json.loads(r.text), dict)
        else:
            assert r.finish_reason == "length"
            assert r.text.startswith("{")


@pytest.mark.parametrize("sample", [False, True])
def test_grammar_outputs_parse_with_lark(pipe, sample):
    extra = {"do_sample": True, "seed": 11} if sample else {}
    parser = lark.Lark(GRAMMAR)
    for r in _run(pipe, ["hello", "the fox", "zz"], grammar=GRAMMAR, **extra):
        assert r.finish_reason == "eos", r
        parser.parse(r.text)


@pytest.mark.parametrize("sample", [False, True])
def test_a_choice_output_is_one_of_the_choices(pipe, sample):
    choices = ["positive", "negative", "neutral", "a long label with spaces"]
    extra = {"do_sample": True, "seed": 5} if sample else {}
    for r in _run(pipe, ["good", "bad", "so so", "x"], choice=choices, **extra):
        assert r.text in choices and r.finish_reason == "eos"


def test_eos_is_forced_at_completion_and_the_limit_is_length(pipe):
    (r,) = _run(pipe, ["hello"], choice=["ok"])
    assert r.text == "ok" and r.finish_reason == "eos"
    free = _run(pipe, ["hello"], max_new_tokens=20)[0]
    assert free.finish_reason == "length"  # the model alone would not stop
    (cut,) = _run(pipe, ["hello"], regex="[a-z]{40}", max_new_tokens=5)
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    host = cs.HostMatcher(cs.Constraint("regex", "abc"), TOKENIZER, VOCAB, EOS)
    tokens = llguidance.LLTokenizer(TOKENIZER, n_vocab=VOCAB).tokenize_str("abc")
    mask = np.asarray(cs.allowed(host.state({"prompt": [1], "generated": tokens[::-1]}), VOCAB))
    assert np.flatnonzero(mask).tolist() == list(EOS)


def _reference(matcher) -> np.ndarray:
    """The tokens llguidance's own matcher allows next (its numpy API), each checked to be one
    it accepts."""
    mask = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask)
    ok = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
    for t in np.flatnonzero(ok):
        if t not in EOS:
            assert matcher.deep_copy().try_consume_tokens([int(t)]) == 1
    assert ok[list(EOS)].all() == matcher.is_accepting()
    return ok


@pytest.mark.parametrize(
    "constraint",
    [
        cs.Constraint("regex", r"[a-z ]{0,400}\."),
        cs.Constraint("json_schema", json.dumps(SCHEMA)),
        cs.Constraint("grammar", GRAMMAR),
    ],
    ids=["regex", "json", "grammar"],
)
def test_each_mask_is_the_reference_matchers_allowed_set(constraint):
    host = cs.HostMatcher(constraint, TOKENIZER, VOCAB, EOS)
    reference = cs.compile_matcher(constraint, TOKENIZER, VOCAB, EOS)
    rng, tokens, steps = np.random.default_rng(0), [], 0
    while steps < 300:
        mask = np.asarray(cs.allowed(host.state({"prompt": [5], "generated": tokens[::-1]}), VOCAB))
        expect = _reference(reference)
        np.testing.assert_array_equal(mask, expect, err_msg=f"step {steps}")
        steps += 1
        choices = np.flatnonzero(expect & ~np.isin(np.arange(VOCAB), EOS))
        if not len(choices):  # complete: start another document
            tokens, reference = [], cs.compile_matcher(constraint, TOKENIZER, VOCAB, EOS)
            continue
        token = int(rng.choice(choices))
        assert reference.consume_token(token)
        tokens.append(token)


@pytest.mark.parametrize(
    "constraint",
    [cs.Constraint("json_schema", json.dumps(SCHEMA)), cs.Constraint("grammar", GRAMMAR)],
    ids=["json", "grammar"],
)
def test_host_rows_masks_are_the_reference_matchers_allowed_set(constraint):
    """Host rows (the matcher called back from a compiled step): at each of 300 steps the mask
    :func:`restrict` applies equals llguidance's own matcher's; a free row beside it keeps
    every token; :func:`advance` hands the token to the host row only."""
    mask = cs.HostMask(constraint, TOKENIZER, VOCAB, EOS)
    restrict = jax.jit(lambda state: cs.restrict(jnp.zeros((2, VOCAB)), mask.table, state))
    advance = jax.jit(lambda state, token: cs.advance(mask.table, state, token, token >= 0))
    rng, steps, before = np.random.default_rng(3), 0, cs.live_rows()
    while steps < 300:
        state = jnp.asarray([mask.start([([5], [])])[0], -1])
        reference = cs.compile_matcher(constraint, TOKENIZER, VOCAB, EOS)
        while True:
            allowed = np.asarray(restrict(state)) > cs.LOWEST
            np.testing.assert_array_equal(allowed[0], _reference(reference), f"step {steps}")
            assert allowed[1].all()
            steps += 1
            choices = np.flatnonzero(allowed[0] & ~np.isin(np.arange(VOCAB), EOS))
            if not len(choices) or steps >= 300:
                break
            token = int(rng.choice(choices))
            assert reference.consume_token(token)
            after = advance(state, jnp.asarray([token, 7], jnp.int32))
            np.testing.assert_array_equal(np.asarray(after), np.asarray(state))  # handles kept
        mask.release(np.asarray(state))
    assert cs.live_rows() == before


def _host_decode(constraint, logits: np.ndarray, free: list[bool]) -> np.ndarray:
    """Greedy tokens [B, T] of the host path on fixed logits [T, B, V] (-1 after eos)."""
    host = cs.HostMatcher(constraint, TOKENIZER, VOCAB, EOS)
    steps, batch, _ = logits.shape
    out = np.full((batch, steps), -1, np.int32)
    for b in range(batch):
        tokens: list[int] = []
        for t in range(steps):
            scores = jnp.asarray(logits[t, b])
            if not free[b]:
                scores = cs.apply_mask(
                    scores, host.state({"prompt": [b], "generated": tokens[::-1]})
                )
            token = int(jnp.argmax(scores))
            out[b, t] = token
            if token in EOS:
                break
            tokens.append(token)
    return out


@jax.jit
def _device_decode(table: cs.TokenTable, state: jax.Array, logits: jax.Array) -> jax.Array:
    """Greedy tokens [B, T] of the device table inside one lax.scan (no host step)."""

    def step(carry, scores):
        state, done = carry
        token = jnp.argmax(cs.apply_mask(scores, cs.table_bitmask(table, state)), axis=-1)
        token = jnp.where(done, -1, token).astype(jnp.int32)
        done = done | jnp.isin(token, jnp.asarray(EOS))
        return (cs.next_state(table, state, token), done), token

    start = (state, jnp.zeros(state.shape, bool))
    return jax.lax.scan(step, start, logits)[1].T


CLOSED = {  # closed objects of booleans, enums and integers: the device path
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", 7]},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "minItems": 1, "maxItems": 2},
        "code": {"type": "string", "pattern": "^[A-C][0-9]{1,2}$"},  # anchored: a device table
    },
    "required": ["ok", "color", "tags", "code"],
    "additionalProperties": False,
}

VALUES = {  # strings, numbers, bounded integers, a $ref, type lists, oneOf, closed: on the device
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 4},
        "id": {"type": "integer", "minimum": -5, "maximum": 120},
        "note": {"$ref": "#/$defs/text"},
        "score": {"type": "number"},
        "maybe": {"type": ["string", "null"], "maxLength": 2},
        "day": {"type": "string", "format": "date"},
        "pick": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]},
    },
    "required": ["name", "id", "maybe"],
    "additionalProperties": False,
    "$defs": {"text": {"type": "string"}},
}

DEVICE = [
    cs.Constraint("regex", r"[0-9]{2,5}(-[a-z]{1,4}){1,3}"),  # moves out of states that may end
    cs.Constraint("regex", r"(true|false|maybe)!?"),
    cs.Constraint("regex", r"[a-c]{1,6}( [0-9]{1,3})?"),
    cs.Constraint("choice", json.dumps(["alpha", "beta gamma", "b", "delta."])),
    cs.Constraint("choice", json.dumps(["positive", "negative", "neutral"])),  # forced tokens
    cs.Constraint("json_schema", json.dumps(VALUES)),
]
DEVICE_IDS = ["regex", "alternation", "optional", "choice", "labels", "values"]


@pytest.mark.parametrize("constraint", DEVICE, ids=DEVICE_IDS)
def test_the_device_table_equals_the_host_path_token_for_token(constraint):
    table = cs.token_table(constraint, TOKENIZER, VOCAB, EOS)
    free = [False, True, False, False, True, False]  # constrained and free rows in one batch
    logits = np.random.default_rng(1).normal(size=(90, len(free), VOCAB)).astype(np.float32)
    logits[:, :, list(EOS)] -= 3.0  # eos only where the constraint makes it win
    state = jnp.asarray([-1 if f else 0 for f in free], jnp.int32)
    device = np.asarray(_device_decode(table, state, jnp.asarray(logits)))
    host = _host_decode(constraint, logits, free)
    np.testing.assert_array_equal(device, host)
    decode = llguidance.LLTokenizer(TOKENIZER, n_vocab=VOCAB).decode_str
    pattern = constraint.text if constraint.kind == "regex" else cs.pattern_of(constraint)
    ended = 0
    for row, f in zip(device, free, strict=True):  # every ended output is valid
        if not f and EOS[0] in row:
            ended += 1
            text = decode([int(t) for t in row[: list(row).index(EOS[0])]])
            assert re.fullmatch(pattern, text), text
    assert ended >= 2


@pytest.mark.parametrize(
    "constraint",
    [*DEVICE, cs.Constraint("json_schema", json.dumps(CLOSED))],
    ids=[*DEVICE_IDS, "closed-schema"],
)
def test_device_masks_equal_llguidances_along_random_walks(constraint):
    """The table's mask (device and host) equals llguidance's own matcher's at every step of
    random token walks (300 steps)."""
    table = cs.token_table(constraint, TOKENIZER, VOCAB, EOS)
    mask = cs.DeviceMask(constraint, TOKENIZER, VOCAB, EOS)
    rng, steps = np.random.default_rng(2), 0
    while steps < 300:
        state, tokens = jnp.zeros(1, jnp.int32), []
        reference = cs.compile_matcher(constraint, TOKENIZER, VOCAB, EOS)
        for _ in range(30):
            device = np.asarray(cs.table_bitmask(table, state))[0]
            expect = _reference(reference)
            np.testing.assert_array_equal(np.asarray(cs.allowed(device, VOCAB)), expect)
            host = mask.state({"prompt": [], "generated": tokens[::-1]})
            np.testing.assert_array_equal(host, device)
            steps += 1
            token = int(rng.choice(np.flatnonzero(expect)))
            if token in EOS:
                break
            assert reference.consume_token(token)
            tokens.append(token)
            state = cs.next_state(table, state, jnp.asarray([token]))


def test_which_constraints_take_the_device_path(monkeypatch):
    device = lambda c: isinstance(  # noqa: E731
        cs.processor(c, TOKENIZER, VOCAB, EOS), cs.DeviceMask
    )
    assert all(device(c) for c in DEVICE)
    assert not device(cs.Constraint("grammar", GRAMMAR))  # llguidance on the host
    assert not device(cs.Constraint("json_schema", '{"type": "object"}'))  # open
    # finite, but llguidance allows more than outlines-core's regex of it (other properties)
    closed = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert not device(cs.Constraint("json_schema", json.dumps(closed)))
    with pytest.raises(cs.NotExact):
        cs.token_table(cs.Constraint("json_schema", json.dumps(closed)), TOKENIZER, VOCAB, EOS)
    closed["additionalProperties"] = False  # closed, of booleans, enums and integers: exact
    closed["properties"] |= {"color": {"enum": ["red", 7]}, "n": {"type": "integer"}}
    assert device(cs.Constraint("json_schema", json.dumps(closed)))
    closed["properties"]["name"] = {"type": "string", "maxLength": 3}  # llguidance's strings
    assert device(cs.Constraint("json_schema", json.dumps(closed)))
    assert not device(cs.Constraint("json_schema", json.dumps(closed), whitespace=True))
    closed["properties"]["name"] = {"type": "string", "pattern": "^[a-c]{1,4}$"}  # anchored
    assert device(cs.Constraint("json_schema", json.dumps(closed)))
    search = {"type": "string", "pattern": "[a-c]{1,4}"}
    email = {"type": "string", "format": "email"}
    for host in [search, email, {"type": "number", "maximum": 2}]:  # and a bounded number
        closed["properties"]["name"] = host
        assert not device(cs.Constraint("json_schema", json.dumps(closed)))
    recursive = {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
    recursive["$ref"] = "#/$defs/n"
    assert not cs.Constraint("json_schema", json.dumps(recursive)).finite
    assert not device(cs.Constraint("json_schema", json.dumps(recursive)))
    monkeypatch.setattr(cs, "TABLE_LIMIT", 64 * VOCAB)  # a table of 64 states at most
    big = cs.Constraint("regex", "[a-z]{1,80}")  # its 81 states: a host row
    assert not device(big)
    with pytest.raises(cs.NotExact, match="too many states"):
        cs.token_table(big, TOKENIZER, VOCAB, EOS)
    for hostile in ["[a-z]{1,100000}", "(a{0,300}){0,300}", "(x[0-9]{9}){1,99}"]:  # no index built
        assert not device(cs.Constraint("regex", hostile))
    estimates = [cs._estimated_states(p) for p in ["ab", "a{3}b", r"(a{0,9}){0,9}", r"\p{L}{2}"]]
    assert estimates == [2, 4, 81, 2]  # (a{0,9}){0,9}: 9 x 9


@pytest.fixture(scope="module")
def model():
    return transmuter_jax.load(str(FIXTURE / "model.onnx"))


def _host_engine(model, constraint, **options):
    """An engine whose constraint is llguidance's matcher on the host (a task processor)."""
    host = cs.HostMatcher(constraint, TOKENIZER, VOCAB, EOS).processor
    spec = gen.context(str(FIXTURE), model, processors=(host,), **options)
    return gen.compile(spec, 4)


PROMPTS = [[1, 5, 9], [1, 7], [1, 8, 8, 2], [1, 4]]


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize(
    "option",
    [{"regex": r"[0-9]{2,5}(-[a-z]{1,4}){1,3}"}, {"choice": ["positive", "negative", "b"]},
     {"json_schema": VALUES}],
    ids=["regex", "choice", "values"],
)  # fmt: skip
def test_generate_runs_the_table_in_the_decode_chunk_as_the_host_path(model, option, sample):
    options = {"max_new_tokens": 30, "do_sample": sample, "eos_token_id": list(EOS)}
    spec = gen.context(str(FIXTURE), model, **options, **option)
    engine = gen.compile(spec, 4)
    assert gen.on_device(engine) and isinstance(engine.compiled.decoder.mask, cs.DeviceMask)
    seeds = [3, 4, 5, 6]
    device = gen.generate(engine, PROMPTS, seeds)
    constraint = cs.from_options(spec.options)
    host_engine = _host_engine(model, constraint, **options)
    assert not gen.on_device(host_engine)  # llguidance's matcher: one step at a time
    assert device == gen.generate(host_engine, PROMPTS, seeds)


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize(
    "option",
    [{"json_schema": SCHEMA}, {"grammar": GRAMMAR}, {"json_object": True}],
    ids=["schema", "grammar", "object"],
)
def test_host_matchers_run_in_the_decode_chunk_as_the_host_step(model, option, sample):
    """A constraint llguidance runs on the host (strings, bounds, $ref, a grammar, an open
    object) decodes in the device chunk, called back for each mask, token for token as the
    one-step-at-a-time host path; every live matcher is released after the call."""
    options = {"max_new_tokens": 40, "do_sample": sample, "eos_token_id": list(EOS)}
    spec = gen.context(str(FIXTURE), model, **options, **option)
    engine = gen.compile(spec, 4)
    assert gen.on_device(engine) and isinstance(engine.compiled.decoder.mask, cs.HostMask)
    seeds = [3, 4, 5, 6]
    device = gen.generate(engine, PROMPTS, seeds)
    assert cs.live_rows() == 0
    host_engine = _host_engine(model, cs.from_options(spec.options), **options)
    assert not gen.on_device(host_engine)
    assert device == gen.generate(host_engine, PROMPTS, seeds)
    if "grammar" in option:  # short sentences: eos at their end, through the callbacks
        assert all(len(tokens) < 40 for tokens in device)


@pytest.mark.parametrize("schema", [CLOSED, VALUES], ids=["closed", "values"])
@pytest.mark.parametrize("sample", [False, True])
def test_a_closed_schema_runs_on_the_device_and_validates(model, sample, schema):
    options = {"max_new_tokens": 60, "do_sample": sample, "eos_token_id": list(EOS)}
    spec = gen.context(str(FIXTURE), model, json_schema=schema, **options)
    engine = gen.compile(spec, 4)
    assert isinstance(engine.compiled.decoder.mask, cs.DeviceMask)
    decode = llguidance.LLTokenizer(TOKENIZER, n_vocab=VOCAB).decode_str
    ended = 0
    for tokens in gen.generate(engine, PROMPTS, [1, 2, 3, 4]):
        if len(tokens) < 60:  # ended by eos: a complete document
            ended += 1
            jsonschema.validate(json.loads(decode(tokens)), schema)
    assert ended >= 1


def _drain(engine, state, out):
    while state.live_slots:
        state, tokens = engine.generate(state, 4)
        for t in tokens:
            out.setdefault(t.slot, []).append(t)
    return state


def test_slots_mix_constrained_and_free_requests(model):
    spec = gen.context(str(FIXTURE), model, max_new_tokens=30)
    engine = gen.compile(spec, 4, capacity=128, top_logprobs=0)
    pattern = r"(yes|no) [A-Z][a-z]{0,3}"
    requests = [
        gen.Request(PROMPTS[0], constraint={"regex": r"[0-9]{2,5}(-[a-z]{1,4}){1,3}"}),
        gen.Request(PROMPTS[1], max_new_tokens=12, do_sample=True, seed=1),  # free
        gen.Request(
            PROMPTS[2], constraint={"choice": ["alpha", "beta gamma", "b"]}, do_sample=True, seed=3
        ),  # fmt: skip
        gen.Request(
            PROMPTS[3], constraint=cs.Constraint("regex", pattern), do_sample=True, seed=9
        ),  # fmt: skip
    ]
    state, out = engine.init_state(), {}
    for slot, request in enumerate(requests):  # each joins a running batch
        prefix = engine.prefill(request)
        state = engine.insert(prefix, state, slot)
        out[slot] = [prefix.first]
        state, tokens = engine.generate(state, 2 + slot)
        for t in tokens:
            out[t.slot].append(t)
    _drain(engine, state, out)
    decode = llguidance.LLTokenizer(TOKENIZER, n_vocab=VOCAB).decode_str
    for slot, request in enumerate(requests):
        ids = [t.token for t in out[slot] if not t.eos]
        alone, solo = engine.init_state(), {0: [engine.prefill(request).first]}
        _drain(engine, engine.insert(engine.prefill(request), alone, 0), solo)
        assert [t.token for t in solo[0]] == [t.token for t in out[slot]]  # as alone
        if request.constraint is None:
            assert out[slot][-1].finish_reason == "length"
            continue
        assert out[slot][-1].finish_reason == "stop" and out[slot][-1].eos  # eos at the end
        text = decode(ids)
        if request.constraint.kind == "choice":
            assert text in json.loads(request.constraint.text)
        else:
            assert re.fullmatch(request.constraint.text, text), text
        options = {"max_new_tokens": 30, "do_sample": bool(request.do_sample)}
        host = _host_engine(model, request.constraint, **options)  # generate()'s host path
        assert gen.generate(host, [list(request.prompt)], [request.seed])[0] == ids


def test_slots_run_host_matchers_beside_tables_and_free_rows(model):
    """Requests whose constraints llguidance runs on the host (a schema with strings and
    bounds, a grammar) share a batch with a device table's and a free one, each as alone and
    as generate()'s host path; their outputs validate; freeing releases their matchers."""
    spec = gen.context(str(FIXTURE), model, max_new_tokens=40)
    engine = gen.compile(spec, 4, capacity=128, top_logprobs=0)
    requests = [
        gen.Request(PROMPTS[0], constraint={"json_schema": SCHEMA}),
        gen.Request(PROMPTS[1], max_new_tokens=12, do_sample=True, seed=1),  # free
        gen.Request(PROMPTS[2], constraint={"grammar": GRAMMAR}, do_sample=True, seed=3),
        gen.Request(PROMPTS[3], constraint={"regex": r"(yes|no) [A-Z][a-z]{0,3}"}),  # a table
    ]
    before = cs.live_rows()
    state, out = engine.init_state(), {}
    for slot, prefix in enumerate(engine.prefill_many(requests[:2])):
        state = engine.insert(prefix, state, slot)
        out[slot] = [prefix.first]
    state, tokens = engine.generate(state, 3)
    for t in tokens:
        out[t.slot].append(t)
    for slot in (2, 3):  # join a running batch
        prefix = engine.prefill(requests[slot])
        state = engine.insert(prefix, state, slot)
        out[slot] = [prefix.first]
    state = _drain(engine, state, out)
    assert cs.live_rows() == before + 2
    for slot in range(4):
        state = engine.free(state, slot)
    assert cs.live_rows() == before
    decode = llguidance.LLTokenizer(TOKENIZER, n_vocab=VOCAB).decode_str
    for slot, request in enumerate(requests):
        ids = [t.token for t in out[slot] if not t.eos]
        alone, solo = engine.init_state(), {}
        prefix = engine.prefill(request)
        solo[0] = [prefix.first]
        alone = _drain(engine, engine.insert(prefix, alone, 0), solo)
        engine.free(alone, 0)
        assert [t.token for t in solo[0]] == [t.token for t in out[slot]]  # as alone
        if request.constraint is None:
            continue
        options = {"max_new_tokens": 40, "do_sample": bool(request.do_sample)}
        host = _host_engine(model, request.constraint, **options)  # generate()'s host path
        assert gen.generate(host, [list(request.prompt)], [request.seed])[0] == ids
        if out[slot][-1].eos:  # complete: it validates
            if request.constraint.kind == "json_schema":
                jsonschema.validate(json.loads(decode(ids)), SCHEMA)
            elif request.constraint.kind == "grammar":
                lark.Lark(GRAMMAR).parse(decode(ids))
    assert cs.live_rows() == before


def test_prefill_many_selects_each_first_token_with_its_own_table(model):
    spec = gen.context(str(FIXTURE), model, max_new_tokens=20)
    engine = gen.compile(spec, 4, capacity=128, top_logprobs=0)
    requests = [
        gen.Request(PROMPTS[0], constraint={"regex": r"[0-9]{2,5}(-[a-z]{1,4}){1,3}"}),
        gen.Request(PROMPTS[1], max_new_tokens=12, do_sample=True, seed=1),  # free
        gen.Request(
            PROMPTS[2], constraint={"choice": ["alpha", "beta gamma", "b"]}, do_sample=True, seed=3
        ),  # fmt: skip
    ]
    state, out = engine.init_state(), {}
    for slot, prefix in enumerate(engine.prefill_many(requests)):  # one prompt step, two tables
        state = engine.insert(prefix, state, slot)
        out[slot] = [prefix.first]
    _drain(engine, state, out)
    for slot, request in enumerate(requests):
        solo = {0: [engine.prefill(request).first]}
        _drain(engine, engine.insert(engine.prefill(request), engine.init_state(), 0), solo)
        assert [t.token for t in solo[0]] == [t.token for t in out[slot]]  # as alone


def test_slots_refuse_bad_constraints(model):
    spec = gen.context(str(FIXTURE), model, max_new_tokens=8)
    engine = gen.compile(spec, 2, capacity=128, top_logprobs=0)
    with pytest.raises(GenerationError, match="not a constraint option: regexp"):
        gen.Request([1, 2], constraint={"regexp": "a"})
    with pytest.raises(GenerationError, match="give one constraint"):
        gen.Request([1, 2], constraint={"regex": "a", "choice": ["a"]})
    with pytest.raises(GenerationError, match="invalid regex"):
        engine.prefill(gen.Request([1, 2], constraint={"regex": "(ab"}))
    constrained = gen.context(str(FIXTURE), model, max_new_tokens=8, regex="[0-9]+")
    with pytest.raises(GenerationError, match="slots take one per request"):
        gen.compile(constrained, 2).init_state()


def test_pack_and_allowed_round_trip():
    bits = np.random.default_rng(0).random((3, 70)) < 0.5
    assert cs.pack(bits).shape == (3, 3)
    np.testing.assert_array_equal(np.asarray(cs.allowed(cs.pack(bits), 70)), bits)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"regex": "(ab"}, "invalid regex"),
        ({"json_schema": {"type": "nonsense"}}, "invalid JSON schema"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": [1, 2]}, "json_schema must be a JSON object"),
        ({"grammar": "start: undefined_rule"}, "invalid grammar"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": "yes"}, "choice must be a non-empty list"),
        ({"regex": "a", "choice": ["a"]}, "give one constraint, not regex and choice"),
        ({"json_object": True, "json_schema": {"type": "object"}}, "give one constraint"),
        ({"json_object": "yes"}, "json_object must be a bool"),
    ],
)
def test_bad_constraints_are_refused_before_generation(pipe, options, message):
    calls = []
    with pytest.raises(GenerationError, match=re.escape(message)):
        pipe._runner.run(pipe.tokenizer, [[5, 6]], options, on_token=calls.append)
    assert not calls


def test_a_device_table_is_refused_for_a_grammar_and_compiles_are_cached():
    with pytest.raises(GenerationError, match="no device table"):
        cs.token_table(cs.Constraint("grammar", GRAMMAR), TOKENIZER, VOCAB, EOS)
    constraint = cs.Constraint("regex", "[0-9]+")
    assert cs.token_table(constraint, TOKENIZER, VOCAB, EOS) is cs.token_table(
        cs.Constraint("regex", "[0-9]+"), TOKENIZER, VOCAB, EOS
    )
    assert not cs.Constraint("json_schema", '{"type": "object"}').finite
    assert cs.Constraint("json_schema", json.dumps({"enum": [1, 2]})).finite


def test_cli_flags_map_to_options(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "g.lark"
    grammar.write_text(GRAMMAR)
    parse = lambda *a: generation_options(cli.parse(["generate", "p", *a]))  # noqa: E731
    assert parse("--json-schema", str(schema)) == {"json_schema": SCHEMA}
    assert parse("--json-object", "--json-whitespace") == {"json_object": True,
                                                          "json_whitespace": True}  # fmt: skip
    assert parse("--regex", "[0-9]+") == {"regex": "[0-9]+"}
    assert parse("--grammar", str(grammar)) == {"grammar": GRAMMAR}
    assert parse("--choice", "yes", "--choice", "no") == {"choice": ["yes", "no"]}
    with pytest.raises(ValueError, match="is not JSON"):
        parse("--json-schema", str(grammar))


def test_cli_choice_end_to_end(capsys):
    args = ["generate", str(FIXTURE), "hello", "--choice", "red", "--choice", "blue", "--json"]
    assert cli.main(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] in ("red", "blue") and record["finish_reason"] == "eos"


def test_a_speculating_slot_beside_a_constrained_one_equals_its_solo_run(model):
    """A live constrained slot pauses speculation (plain steps): both requests get their solo
    tokens, the constrained one still valid."""
    spec = gen.context(str(FIXTURE), model, max_new_tokens=20)
    engine = gen.compile(spec, 2, capacity=128, top_logprobs=0)
    pattern = r"[0-9]{2,5}(-[a-z]{1,4}){1,3}"
    requests = [
        gen.Request(PROMPTS[0], constraint={"regex": pattern}),
        gen.Request(PROMPTS[1], max_new_tokens=16, prompt_lookup_num_tokens=3),
    ]
    state, out = engine.init_state(), {}
    for slot, request in enumerate(requests):
        prefix = engine.prefill(request)
        state = engine.insert(prefix, state, slot)
        out[slot] = [prefix.first]
    _drain(engine, state, out)
    for slot, request in enumerate(requests):
        solo = {0: [engine.prefill(request).first]}
        _drain(engine, engine.insert(engine.prefill(request), engine.init_state(), 0), solo)
        assert [t.token for t in solo[0]] == [t.token for t in out[slot]], slot
    decode = llguidance.LLTokenizer(TOKENIZER, n_vocab=VOCAB).decode_str
    assert re.fullmatch(pattern, decode([t.token for t in out[0] if not t.eos]))
