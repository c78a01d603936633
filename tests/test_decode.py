"""Decode chunks on the device give the tokens, log-probabilities and events of the per-step loop
and of transformers, in every cache mode and fixture family."""

from __future__ import annotations

import dataclasses
import gc

import jax
import numpy as np
import pytest
from generation_cases import FIXTURES, case, context, encoder_inputs, reference, tiered

from transmuter_jax import generation

# One fixture of each family and cache mode (test_generation.py runs every fixture with the
# default decode_steps; these run chunks shorter than max_new_tokens and compare with steps).
FAMILIES = {
    "llama-optimum": "append",
    "gpt2-optimum": "append",
    "llama-genai-fp32": "in_place",
    "qwen2-genai-fp32": "in_place",
    "gemma3-optimum": "grow",
    "whisper-optimum": "grow",
    "marian-optimum": "grow",
    "smolvlm-torch": "append",
    "qwen25vl-genai-fp32": "in_place",
}
SLOW = {
    "gpt2-optimum", "qwen2-genai-fp32", "smolvlm-torch", "qwen25vl-genai-fp32", "gemma3-optimum",
    "marian-optimum",
}  # fmt: skip


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("decode")


def _run(name, workdir, the_case, *, steps, batch=None, prompts=None, seeds=None, **options):
    prompts = the_case["prompts"] if prompts is None else prompts
    rows = list(range(len(prompts)))
    given, inputs = encoder_inputs(name, the_case, rows)
    options.setdefault("max_new_tokens", the_case["options"]["max_new_tokens"])
    ctx = context(name, workdir, given=given, decode_steps=steps, **options)
    ctx = generation.compile(ctx, batch or len(prompts))
    assert generation.on_device(ctx) == (steps > 1 and ctx.compiled.cache.on_device)
    # the slots' step wherever the cache keeps its shape: in chunks, or with a limit of one
    decoder = ctx.compiled.decoder
    assert (decoder is not None and decoder.size == steps) == ctx.compiled.cache.on_device
    events = []
    seeds = list(range(len(prompts))) if seeds is None else seeds
    out = generation.generate(ctx, prompts, seeds, inputs, on_token=events.append)
    return out, events


def _same_events(a, b, logprobs=False):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["token"], y["token"])
        np.testing.assert_array_equal(x["finished"], y["finished"])
        if logprobs:
            np.testing.assert_allclose(x["logprob"], y["logprob"], atol=1e-5)


def _params():
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(FAMILIES)]


@pytest.mark.parametrize("name", _params())
def test_chunks_equal_steps_and_transformers(name, workdir):
    """Greedy with log-probabilities, 16 new tokens in chunks of 3 (not a multiple), rows of
    prompts of different lengths, and an empty prompt as a padding row."""
    the_case = case(name, "batch")
    prompts = the_case["prompts"] + [[]]
    given, inputs = encoder_inputs(name, the_case, list(range(len(prompts) - 1)))
    inputs = {k: np.concatenate([v, v[:1]]) for k, v in inputs.items()}
    results = {}
    for steps in (1, 3):
        ctx = context(
            name,
            workdir,
            given=given,
            max_new_tokens=the_case["options"]["max_new_tokens"],
            token_logprobs=True,
            decode_steps=steps,
        )
        ctx = generation.compile(ctx, len(prompts))
        events = []
        out = generation.generate(ctx, prompts, list(range(len(prompts))), inputs, events.append)
        results[steps] = out, events
    (steps_out, steps_events), (chunk_out, chunk_events) = results[1], results[3]
    tokens = [[t for t, _ in row] for row in chunk_out]
    assert tokens[:-1] == the_case["tokens"] and tokens[-1] == []
    assert tokens == [[t for t, _ in row] for row in steps_out]
    for a, b in zip(steps_out, chunk_out, strict=True):
        np.testing.assert_allclose([p for _, p in a], [p for _, p in b], atol=1e-5)
    _same_events(steps_events, chunk_events, logprobs=True)


@pytest.mark.parametrize(
    "name", ["llama-optimum", tiered("llama-genai-fp32", quick=False), "whisper-optimum"]
)
def test_eos_in_the_middle_of_a_chunk_stops_rows_at_different_steps(name, workdir):
    the_case = case(name, "batch")
    free, _ = _run(name, workdir, the_case, steps=1, eos_token_id=[])
    # An eos that row 0 meets at its 6th token: the other rows stop elsewhere or never.
    eos = free[0][5]
    expected = [row[: row.index(eos)] if eos in row else row for row in free]
    assert len({len(row) for row in expected}) > 1
    for steps in (1, 4, 32):
        out, events = _run(name, workdir, the_case, steps=steps, eos_token_id=[eos])
        assert out == expected, steps
        if steps == 1:
            reference_events = events
        else:
            _same_events(reference_events, events)
    # finished flags: a row stops in the event that brings its eos or its last token
    finished = np.array([e["finished"] for e in reference_events])
    for row, tokens in enumerate(expected):
        first = int(np.argmax(finished[:, row]))
        shown = [int(e["token"][row]) for e in reference_events[: first + 1]]
        assert [t for t in shown if t >= 0 and t != eos] == tokens


@pytest.mark.parametrize(
    "name", ["llama-optimum", tiered("llama-genai-fp32", quick=False), "marian-optimum"]
)
def test_sampled_chunks_equal_steps_and_rows_stay_independent(name, workdir):
    the_case = case(name, "batch")
    options = dict(do_sample=True, temperature=1.3, top_k=30, top_p=0.9, eos_token_id=[])
    seeds = [11, 12, 13, 2**40 + 14]
    steps, _ = _run(name, workdir, the_case, steps=1, seeds=seeds, **options)
    chunks, _ = _run(name, workdir, the_case, steps=5, seeds=seeds, **options)
    assert chunks == steps
    if the_case.get("encoder_inputs") is None:  # a row alone, padded to a batch of 4
        prompts = [the_case["prompts"][2]]
        alone, _ = _run(name, workdir, the_case, steps=5, batch=4, prompts=prompts,
                        seeds=[13], **options)  # fmt: skip
        assert alone[0] == chunks[2]


def _processor_cases():
    ref = reference("llama-optimum")[0]
    return [c["name"] for c in ref["cases"] if c["name"].startswith("processors_")]


@pytest.mark.parametrize("case_name", _processor_cases())
def test_every_builtin_processor_runs_in_the_chunk(case_name, workdir):
    name = "llama-optimum"
    the_case = case(name, case_name)
    options = {k: v for k, v in the_case["options"].items() if k != "num_beams"}
    out, _ = _run(name, workdir, the_case, steps=4, **options)
    assert out == the_case["tokens"]


def test_a_custom_processor_falls_back_to_steps(workdir):
    ctx = context("llama-optimum", workdir, max_new_tokens=4, decode_steps=8)
    custom = (lambda row: np.zeros((), np.int32), lambda logits, state: logits)
    ctx = dataclasses.replace(ctx, processors=(*ctx.processors, custom))
    ctx = generation.compile(ctx, 1)
    assert not generation.on_device(ctx)
    prompt = case("llama-optimum", "greedy")["prompts"]
    assert generation.generate(ctx, prompt, [0]) == [
        case("llama-optimum", "greedy")["tokens"][0][:4]
    ]


def test_beam_search_and_exact_grow_run_on_the_host(workdir):
    beams = generation.compile(context("llama-optimum", workdir, num_beams=2), 1)
    assert not generation.on_device(beams)
    exact = generation.compile(context("gemma3-optimum", workdir), 1, grow_cache="exact")
    assert not generation.on_device(exact)
    assert beams.compiled.decoder is None and exact.compiled.decoder is None  # host steps
    padded = generation.compile(context("gemma3-optimum", workdir), 1)
    assert generation.on_device(padded)


def test_a_bucketed_grow_cache_runs_chunks_across_buckets(workdir):
    name = "gemma3-optimum"
    the_case = case(name, "greedy")
    expected = {}
    for steps in (1, 16):
        ctx = context(name, workdir, max_new_tokens=100, eos_token_id=[], decode_steps=steps)
        ctx = generation.compile(ctx, 1, grow_cache="buckets")
        expected[steps] = generation.generate(ctx, the_case["prompts"], [0])
        shapes = ctx.compiled.steps.shapes
    assert expected[1] == expected[16]
    reference_tokens = the_case["tokens"][0]  # transformers', which stopped at an eos
    assert expected[16][0][: len(reference_tokens)] == reference_tokens
    assert {key[3] for key in shapes} >= {64, 128}


def test_unknown_and_bad_options_are_refused_by_name(workdir):
    with pytest.raises(ValueError, match="'decode_step'; did you mean 'decode_steps'"):
        context("llama-optimum", workdir, decode_step=4)
    with pytest.raises(ValueError, match="'temprature'; did you mean 'temperature'"):
        context("llama-optimum", workdir, temprature=0.5)
    with pytest.raises(ValueError, match="decode_steps must be a positive integer"):
        context("llama-optimum", workdir, decode_steps=0)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative integer"):
        context("llama-optimum", workdir, max_new_tokens=-1)
    with pytest.raises(ValueError, match="repetition_penalty must be a positive"):
        context("llama-optimum", workdir, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        context("llama-optimum", workdir, length_penalty=float("nan"))
    with pytest.raises(AttributeError):  # frozen
        context("llama-optimum", workdir).options.do_sample = True


def test_a_pad_token_outside_the_vocabulary_pads_with_a_valid_token(workdir):
    the_case = case("llama-optimum", "batch")
    out, _ = _run("llama-optimum", workdir, the_case, steps=4, pad_token_id=10**6)
    assert out == the_case["tokens"]


def test_a_stream_closed_mid_chunk_stops_and_frees_the_cache():
    from transmuter_jax import text

    pipe = text.generation(FIXTURES / "llama-optimum", eos_token_id=[])
    full = pipe.generate(["The quiet river"], max_new_tokens=40, decode_steps=8)[0]
    assert len(full.token_ids) == 40
    before = _live_bytes()
    stream = pipe.stream("The quiet river", max_new_tokens=400, decode_steps=8)
    pieces = [next(stream) for _ in range(3)]
    stream.close()
    assert "".join(pieces) == full.text[: len("".join(pieces))]
    assert _live_bytes() - before < 1 << 16  # no cache left behind


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.parametrize("name", ["llama-genai-fp32", "llama-optimum"])
def test_rows_past_the_position_limit_are_refused_or_clamped(name, workdir):
    """The genai export's rotary cache has as many rows as max_position_embeddings (256)."""
    ctx = generation.compile(context(name, workdir, max_new_tokens=10**8, eos_token_id=[]), 1)
    assert ctx.position_limit == 256
    prompt = case(name, "greedy")["prompts"][0]
    with pytest.raises(
        ValueError, match=f"asks for 100000000 new ones.*at most {256 - len(prompt)}"
    ):
        generation.generate(ctx, [prompt], [0])
    out = generation.generate(ctx, [prompt], [0], clamp=True)
    assert len(out[0]) == 256 - len(prompt)


def test_the_pipeline_clamps_to_the_positions_left():
    from transmuter_jax import text

    pipe = text.generation(FIXTURES / "llama-optimum", eos_token_id=[])
    options = dict(max_new_tokens=10**8, token_logprobs=True)
    result = pipe.generate(["The quiet river"], chat=False, **options)[0]
    prompt = len(pipe.prompt_ids("The quiet river", chat=False))
    assert len(result.token_ids) == 256 - prompt
    assert result.finish_reason == "length"
    assert np.isfinite(result.logprobs).all()
