"""The frozen specification and engine: no mutation, per-call options as new specifications,
programs shared through one cache, and a pipeline's shape count with its decode programs."""

from __future__ import annotations

import dataclasses

import pytest
from generation_cases import FIXTURES, case, context

from transmuter_jax import generation, text
from transmuter_jax.generation import programs

LLAMA = "llama-optimum"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine")


def test_the_specification_and_the_engine_cannot_be_mutated(workdir):
    spec = context(LLAMA, workdir, max_new_tokens=4)
    engine = generation.compile(spec, 2)
    for obj, name in [(spec, "options"), (spec, "processors"), (engine, "compiled"),
                      (engine, "batch_size"), (engine.compiled, "decoder")]:  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    assert isinstance(spec.processors, tuple) and engine.spec is spec
    assert engine.options is spec.options and engine.batch_size == 2


def test_per_call_options_make_a_new_specification(workdir):
    spec = context(LLAMA, workdir, max_new_tokens=4)
    other = spec.with_options(repetition_penalty=1.3, max_new_tokens=6)
    assert other is not spec and spec.options.max_new_tokens == 4
    assert other.options.max_new_tokens == 6 and "repetition_penalty" in other.processors
    assert "repetition_penalty" not in spec.processors
    with pytest.raises(ValueError, match="temprature"):
        spec.with_options(temprature=2.0)


def test_engines_that_agree_share_their_programs(workdir):
    greedy = case(LLAMA, "greedy")
    a = generation.compile(context(LLAMA, workdir, max_new_tokens=5), 1)
    before = programs.count()
    b = generation.compile(context(LLAMA, workdir, max_new_tokens=5), 1)
    assert a is not b and a.compiled.select is b.compiled.select
    assert programs.count() == before  # nothing new to compile
    out_a = generation.generate(a, greedy["prompts"], [0])
    count = programs.count()
    assert generation.generate(b, greedy["prompts"], [0]) == out_a == [greedy["tokens"][0][:5]]
    assert programs.count() == count  # b ran a's step and decode programs
    c = generation.compile(context(LLAMA, workdir, max_new_tokens=5, top_logprobs=2), 1)
    assert c.compiled.select is not a.compiled.select


def test_stop_strings_take_token_texts_from_any_object(workdir):
    class Texts:
        token_texts = ("a", "b", None)

    spec = context(LLAMA, workdir, stop_strings=["b"], tokenizer=Texts())
    assert spec.token_texts == ("a", "b", None) and spec.stops.strings == ("b",)
    assert spec.with_options(stop_strings=["a"]).stops.strings == ("a",)


def test_a_pipelines_shape_count_includes_the_decode_programs_of_each_engine():
    pipe = text.generation(FIXTURES / LLAMA)
    prompt = case(LLAMA, "text")["texts"][0]
    pipe([prompt], max_new_tokens=20, decode_steps=8)
    first = pipe.compiled_shapes  # the prompt step and the decode chunk over one buffer
    engines = list(pipe.engines)
    assert first == len(engines[0].compiled.steps.shapes) == 2
    # other options and a longer run: a new engine, a bigger buffer: its own decode shape (the
    # prompt's step runs in a buffer of its own rows, the same shape as the first engine's)
    pipe([prompt], max_new_tokens=200, decode_steps=8, repetition_penalty=1.2)
    engines = list(pipe.engines)
    shapes = engines[0].compiled.steps.shapes | engines[1].compiled.steps.shapes
    decode = [{s[1] for s in e.compiled.steps.shapes if s[0] == 1} for e in engines]
    assert decode == [{64}, {256}] and len(shapes) == 3
    # each engine's decode programs count apart (their selection is its own): the same here
    assert pipe.compiled_shapes == 3


@pytest.mark.parametrize(
    "name",
    ["llama-optimum", "llama-genai-fp32", "qwen2-optimum", "gemma3-genai-fp32", "gpt2-optimum"],
)
def test_bucketed_prefill_equals_pow2_and_transformers(name, workdir):
    """The batch case (prompts of several lengths in one batch): a prompt in one padded step, in
    power-of-two parts and in one step of the longest prompt's own length give transformers'
    tokens; the bucket rule runs fewer prompt steps."""
    the_case = case(name, "batch")
    prompts = the_case["prompts"]
    shapes = {}
    for rule in generation.PREFILLS:
        spec = context(name, workdir, prefill=rule, **the_case["options"])
        engine = generation.compile(spec, len(prompts))
        assert generation.generate(engine, prompts, [0] * len(prompts)) == the_case["tokens"]
        shapes[rule] = {s for s in engine.compiled.steps.shapes if s[0] > 1}
    assert len(shapes["buckets"]) <= len(shapes["pow2"])
    assert all(s[0] % 16 == 0 and (s[0] <= 64 or s[0] % 64 == 0) for s in shapes["buckets"])
    assert {s[0] for s in shapes["exact"]} == {max(len(p) for p in prompts)}
    with pytest.raises(ValueError, match="prefill must be one of"):
        context(name, workdir, prefill="fixed")


def _flat(workdir, requests: int) -> None:
    """``requests`` requests, one at a time, through the slots of one engine: the live device
    arrays and the programs counted every tenth of the way stay the same."""
    import jax

    engine = generation.compile(context(LLAMA, workdir, max_new_tokens=3), 2, capacity=64)
    prompts = case(LLAMA, "batch")["prompts"]
    state = engine.init_state()
    counts = []
    for i in range(requests):
        request = generation.Request(prompts[i % len(prompts)], seed=i, do_sample=i % 2 == 1)
        state = engine.insert(engine.prefill(request), state, i % 2)
        state, _ = engine.generate(state, 4)
        if i % (requests // 6) == requests // 6 - 1:
            counts.append((len(jax.live_arrays()), programs.count()))
    assert len(counts) >= 6 and len(set(counts)) == 1, counts


def test_memory_stays_flat_over_many_requests(workdir):
    _flat(workdir, 300)


@pytest.mark.slow
def test_memory_stays_flat_over_thousands_of_requests(workdir):
    _flat(workdir, 3000)


def test_programs_go_with_the_last_engine_that_keeps_them(workdir):
    import gc

    greedy = case(LLAMA, "greedy")
    gc.collect()
    before = programs.count()
    options = dict(max_new_tokens=3, do_sample=True, temperature=0.61, decode_steps=4)
    engine = generation.compile(context(LLAMA, workdir, **options), 1)
    generation.generate(engine, greedy["prompts"], [0])
    assert programs.count() > before
    del engine
    gc.collect()
    assert programs.count() == before  # no weights kept alive by a cache of programs
