"""generation.Options: transformers' names and defaults, validation, unsupported fields."""

from __future__ import annotations

import json

import numpy as np
import pytest
from generation_cases import FIXTURES, case, context

from transmuter_jax import generation
from transmuter_jax.generation.options import DEFAULTS, merge


def test_defaults_are_generation_config_defaults_where_transformers_has_them():
    ref = json.loads((FIXTURES / "processors" / "cases.json").read_text())
    assert ref  # the vectors' options all load
    assert DEFAULTS["top_k"] == 50 and DEFAULTS["typical_p"] == 1.0 and DEFAULTS["min_p"] is None
    assert DEFAULTS["max_length"] == 20 and DEFAULTS["eos_token_id"] == ()
    assert "min_tokens_to_keep" not in DEFAULTS  # transformers' generate reads no such option


@pytest.mark.parametrize(
    ("file", "options", "message"),
    [
        ({"guidance_scale": 1.5}, {}, "guidance_scale=1.5, which is not supported"),
        ({"num_beam_groups": 2, "diversity_penalty": 0.5}, {}, "not supported"),
        ({"watermarking_config": {"bias": 2.0}}, {}, "watermarking_config"),
        ({}, {"diversity_penalty": 1.0}, "'diversity_penalty' is not supported"),
        ({}, {"top_k": -2, "do_sample": True}, "top_k must be a non-negative integer"),
        ({}, {"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({}, {"typical_p": 0.0}, r"typical_p must be in \(0, 1\]"),
        ({}, {"eta_cutoff": 1.0}, r"eta_cutoff must be in \[0, 1\)"),
        ({}, {"sequence_bias": []}, "sequence_bias must not be empty"),
        ({}, {"sequence_bias": [[[-1], 1.0]]}, "ids must be non-negative"),
        ({}, {"exponential_decay_length_penalty": (3,)}, "start index, decay factor"),
        ({}, {"num_beams": True}, "num_beams must be an integer"),
    ],
)
def test_bad_or_unsupported_options_are_named(file, options, message):
    with pytest.raises(ValueError, match=message):
        merge({}, file, options)


def test_harmless_values_of_unsupported_fields_load_and_the_caller_can_clear_one():
    file = {"guidance_scale": 1.0, "diversity_penalty": 0.0, "use_cache": True, "max_time": None}
    assert merge({}, file, {}).top_k == 50
    assert merge({}, {"max_time": 5.0}, {"max_time": None}).top_k == 50


def test_sequence_bias_takes_transformers_forms():
    as_list = merge({}, {}, {"sequence_bias": [[[5], 2.0], [[9, 10], -3]]}).sequence_bias
    as_dict = merge({}, {}, {"sequence_bias": {(5,): 2.0, (9, 10): -3.0}}).sequence_bias
    assert as_list == as_dict == (((5,), 2.0), ((9, 10), -3.0))
    hash(merge({}, {}, {"sequence_bias": [[[5], 2.0]], "bad_words_ids": [[1, 2]]}))


def test_token_ids_outside_the_vocabulary_are_named(tmp_path):
    for options, name in (
        ({"sequence_bias": [[[3, 900], 1.0]]}, "sequence_bias"),
        ({"bad_words_ids": [[3, 900]]}, "bad_words_ids"),
        ({"forced_bos_token_id": 900}, "forced_bos_token_id"),
    ):
        with pytest.raises(ValueError, match=f"{name}.*outside the vocabulary"):
            context("llama-optimum", tmp_path, **options)


NEW = dict(
    sequence_bias=[[[11], 1.5], [[40, 7], -2.0]],
    bad_words_ids=[[12, 40], [7, 33, 21]],
    exponential_decay_length_penalty=(4, 1.4),
    remove_invalid_values=True,
)
WARPERS = dict(do_sample=True, min_p=0.05, typical_p=0.9, epsilon_cutoff=0.001, eta_cutoff=0.002)


@pytest.mark.parametrize("options", [NEW, dict(NEW, **WARPERS)], ids=["greedy", "sample"])
@pytest.mark.parametrize("name", ["llama-optimum", "llama-genai-fp32"])
def test_the_new_processors_run_in_the_chunks_with_the_tokens_of_steps(name, options, tmp_path):
    the_case = case(name, "batch")
    out = {}
    for steps in (1, 4):
        ctx = context(name, tmp_path, max_new_tokens=16, decode_steps=steps, **options)
        ctx = generation.compile(ctx, len(the_case["prompts"]))
        assert generation.on_device(ctx) == (steps > 1)
        out[steps] = generation.generate(ctx, the_case["prompts"], [3, 4, 5, 6])
    assert out[1] == out[4]
    assert out[1] != the_case["tokens"]  # the options changed something
    for row in out[1]:  # a banned pair never completes
        pairs = set(zip(row, row[1:], strict=False))
        assert (12, 40) not in pairs
    assert all(np.asarray(row).min() >= 0 for row in out[1] if row)


@pytest.mark.parametrize("name", ["llama-optimum", "whisper-optimum"])
def test_top_logprobs_are_the_best_of_the_log_softmax_and_the_same_in_chunks(name, tmp_path):
    from generation_cases import encoder_inputs

    the_case = case(name, "batch")
    given, inputs = encoder_inputs(name, the_case, list(range(len(the_case["prompts"]))))
    out, events = {}, {}
    for steps in (1, 4):
        ctx = context(name, tmp_path, given=given, max_new_tokens=9, top_logprobs=3,
                      decode_steps=steps)  # fmt: skip
        ctx = generation.compile(ctx, len(the_case["prompts"]))
        seen = []
        out[steps] = generation.generate(ctx, the_case["prompts"], [0] * 4, inputs, seen.append)
        events[steps] = seen
    tokens = [[t for t, _, _ in row] for row in out[1]]
    assert tokens == [row[:9] for row in the_case["tokens"]]  # transformers' greedy tokens
    for a, b in zip(out[1], out[4], strict=True):
        assert [t for t, _, _ in a] == [t for t, _, _ in b]
        for (_, lp_a, top_a), (_, lp_b, top_b) in zip(a, b, strict=True):
            np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            np.testing.assert_allclose([v for _, v in top_a], [v for _, v in top_b], atol=1e-5)
    for row in out[1]:
        for token, logprob, top in row:
            assert len(top) == 3 and top[0][0] == token  # greedy: the best is the token
            np.testing.assert_allclose(top[0][1], logprob, atol=1e-6)
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and np.exp(values).sum() <= 1 + 1e-5
    last = [e for e in events[4] if (e["token"] >= 0).any()][-1]
    assert last["top_ids"].shape == (4, 3) and last["top_logprobs"].shape == (4, 3)


def test_top_logprobs_with_sampling_match_the_processed_scores(tmp_path):
    from transmuter_jax.generation.processors import LOWEST, Rows
    from transmuter_jax.generation.select import selection

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 40)).astype(np.float32) * 2
    options = generation.Options(do_sample=True, temperature=0.7, top_k=5, top_logprobs=4)
    select = selection(options, (), {})
    rows = Rows(np.full((2, 4), -1, np.int32), np.ones(2, np.int32), np.ones(2, np.int32),
                np.full(2, 9, np.int32))  # fmt: skip
    out = np.asarray(select(logits, np.array([1, 2], np.int32), np.zeros(2, np.int32), rows, ()))
    assert out.shape == (2, 2 + 2 * 4)
    scores = logits / np.float32(0.7)
    kth = np.sort(scores, axis=1)[:, -5:-4]
    scores = np.where(scores < kth, LOWEST, scores)
    peak = scores.max(1, keepdims=True)
    logp = scores - (peak + np.log(np.exp(scores - peak).sum(1, keepdims=True)))  # log-softmax
    for b in range(2):
        pairs = out[b, 2:].reshape(4, 2)
        best = np.argsort(-logp[b])[:4]
        assert list(pairs[:, 0]) == list(best)
        np.testing.assert_allclose(pairs[:, 1].view(np.float32), logp[b, best], atol=1e-5)
        assert out[b, 0] in best[:5]
        np.testing.assert_allclose(out[b, 1:2].view(np.float32), logp[b, out[b, 0]], atol=1e-5)
