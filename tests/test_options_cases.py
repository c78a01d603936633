"""The generation options of transformers 4.57 end to end: token-exact with its generate().

The "options_*" cases of the fixtures (tests/fixtures/make_options.py: each prompt generated
alone by transformers; here the prompts of a case run in one batch): sequence_bias, multi-token
bad_words_ids, remove_invalid_values, exponential_decay_length_penalty, the encoder options
(a decoder-only model's encoder ids are its prompt), the min_p / typical_p / epsilon / eta
warpers where their warped scores keep one token per step (so torch's sampling draws it), beam
search with encoder_no_repeat_ngram_size, and beam search with stop strings. In the cache modes
append (llama-optimum), in_place (llama-genai-fp32), grow (gpt2-optimum) and an encoder-decoder
(marian-optimum, grow).
"""

from __future__ import annotations

import numpy as np
import pytest
from generation_cases import FIXTURES, context, encoder_inputs, reference, tiered

from transmuter_jax import generation

NAMES = ["llama-optimum", "llama-genai-fp32", "gpt2-optimum", "marian-optimum"]


def _cases() -> list:
    """Every case on every family; the quick tier runs each case on one family (turning from
    case to case, so each family runs a quarter of them), the rest is in the slow sweep."""
    params = []
    for f, name in enumerate(NAMES):
        cases = [c for c in reference(name)[0]["cases"] if c["name"].startswith("options_")]
        for j, c in enumerate(cases):
            quick = f == j % len(NAMES)
            params.append(tiered(name, c["name"], id=f"{name}/{c['name']}", quick=quick))
    return params


def _case(name: str, case_name: str) -> dict:
    return next(c for c in reference(name)[0]["cases"] if c["name"] == case_name)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("options-cases")


def _inputs(name: str, the_case: dict, rows: list[int]) -> tuple[tuple[str, ...], dict]:
    """The given encoder outputs of ``rows`` and, for an encoder-decoder, their encoder ids."""
    given, inputs = encoder_inputs(name, the_case, rows)
    if given:
        arrays = reference(name)[1]
        inputs["encoder_input_ids"] = [
            arrays[the_case["encoder_inputs"][i]["input_ids"]].reshape(-1).tolist() for i in rows
        ]
    return given, inputs


def test_every_fixture_has_the_options_cases():
    names = {}
    for param in _cases():
        names.setdefault(param.values[0], set()).add(param.values[1])
    assert set(names) == set(NAMES)
    must = {
        "options_sequence_bias",
        "options_bad_words_multi",
        "options_decay",
        "options_encoder_repetition_penalty",
        "options_encoder_no_repeat_ngram_2",
        "options_typical_p",
        "options_beam_encoder_no_repeat_ngram",
        "options_beam_stop_strings",
    }
    for name, cases in names.items():
        assert must <= cases, (name, must - cases)


def _run(name: str, the_case: dict, rows: list[int], workdir, **extra):
    given, inputs = _inputs(name, the_case, rows)
    options = dict(the_case["options"]) | extra
    beam = options.get("num_beams", 1) > 1
    if not beam:
        options.pop("num_beams", None)
    ctx = context(name, workdir, given=given, token_logprobs=True, **options)
    ctx = generation.compile(ctx, len(rows))
    events = []
    prompts = [the_case["prompts"][i] for i in rows]
    out = generation.generate(ctx, prompts, [0] * len(rows), inputs, on_token=events.append)
    return out, events


@pytest.mark.parametrize(("name", "case_name"), _cases())
def test_options_equal_transformers(name, case_name, workdir):
    the_case = _case(name, case_name)
    count = len(the_case["prompts"])
    beam = the_case["options"].get("num_beams", 1) > 1
    if "stop_strings" in the_case:  # each row has its own stop strings: one row at a time
        runs = [([i], {"stop_strings": the_case["stop_strings"][i]}) for i in range(count)]
    else:
        runs = [(list(range(count)), {})]
    for rows, extra in runs:
        out, events = _run(name, the_case, rows, workdir, **extra)
        for r, i in enumerate(rows):
            tokens = [t for t, _ in out[r]]
            assert tokens == the_case["tokens"][i], f"prompt {i}"
            if "logprobs" in the_case:
                want = the_case["logprobs"][i]
                np.testing.assert_allclose([lp for _, lp in out[r]], want[: len(tokens)], atol=1e-4)
        if beam:
            scores = [the_case["sequences_scores"][i] for i in rows]
            np.testing.assert_allclose(events[-1]["score"], scores, atol=1e-4)


def test_text_to_text_passes_the_encoder_ids():
    """The pipeline with encoder_repetition_penalty equals generate given the text's ids as
    transformers' tokenizer made them (the "text" case), and the option changes the tokens;
    generate refuses the option without the ids for an encoder-decoder."""
    from generation_cases import decoder, load

    from transmuter_jax import text

    the_case = _case("marian-optimum", "text")
    ref = reference("marian-optimum")[0]
    pipe = text.text_to_text(FIXTURES / "marian-optimum")
    encoder = load(FIXTURES / "marian-optimum" / ref["files"]["encoder"])
    names = {i.name for i in decoder("marian-optimum").inputs}
    changed = 0
    for source, ids in zip(the_case["texts"], the_case["input_ids"], strict=True):
        got = pipe.generate([source], max_new_tokens=8, encoder_repetition_penalty=1.5)[0]
        feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), int)}
        given = {"encoder_hidden_states": np.asarray(encoder(feeds)["last_hidden_state"])}
        if "encoder_attention_mask" in names:
            given["encoder_attention_mask"] = feeds["attention_mask"]
        ctx = context("marian-optimum", FIXTURES, given=tuple(given), max_new_tokens=8,
                      encoder_repetition_penalty=1.5)  # fmt: skip
        ctx = generation.compile(ctx, 1)
        start = [ref["decoder_start_token_id"]]
        want = generation.generate(ctx, [start], [0], given | {"encoder_input_ids": [ids]})[0]
        assert got.token_ids == want
        changed += got.token_ids != pipe.generate([source], max_new_tokens=8)[0].token_ids
        with pytest.raises(ValueError, match='pass inputs\\["encoder_input_ids"\\]'):
            generation.generate(ctx, [start], [0], given)
    assert changed  # the option changed the tokens of some text


def test_encoder_repetition_penalty_with_beams_or_several_sequences_is_refused():
    for extra in ({"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}):
        with pytest.raises(ValueError, match="applies it to the wrong rows"):
            generation.Options(encoder_repetition_penalty=1.5, **extra)
    generation.Options(encoder_no_repeat_ngram_size=2, num_beams=2)  # this one is per beam
