"""Token selection: bits, option checks, sampling rules and custom processors."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from generation_cases import case, context

from transmuter_jax import generation
from transmuter_jax.generation.processors import LOWEST, Rows
from transmuter_jax.generation.select import selection

LLAMA = "llama-optimum"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("selection")


@pytest.mark.parametrize(
    "value",
    [
        0.0,
        -0.0,
        1.5,
        -2.25,
        math.inf,
        -math.inf,
        LOWEST,
        1.401298464324817e-45,
        3.4028234663852886e38,
    ],
)
def test_bits_round_trip(value):
    bits = generation.to_bits(value)
    assert isinstance(bits, int) and -(2**31) <= bits < 2**31
    back = generation.from_bits(bits)
    assert back == value and math.copysign(1, back) == math.copysign(1, value)


def test_nan_is_the_quiet_nan_and_lists_work_element_wise():
    assert generation.to_bits(float("nan")) == 0x7FC00000
    assert math.isnan(generation.from_bits(0x7FC00000))
    assert math.isnan(generation.from_bits(-0x400000))  # a negative NaN reads as NaN too
    values = [1.0, -math.inf, 0.5]
    assert generation.from_bits(generation.to_bits(values)) == values
    bits = np.asarray(generation.to_bits(values), np.int32)
    np.testing.assert_array_equal(bits.view(np.float32), values)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(do_sample=True, top_p=0.0), "top_p"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, top_k=-1), "top_k"),
        (dict(bad_words_ids=[[600]]), "outside the vocabulary"),
        (dict(suppress_tokens=[9999]), "outside the vocabulary"),
    ],
)
def test_bad_options_fail_before_any_compile(options, message, workdir):
    with pytest.raises(ValueError, match=message):
        context(LLAMA, workdir, **options)


def _scores(logits, **options):
    select = selection(generation.Options(**options), (), {})
    b = logits.shape[0]
    rows = Rows(
        np.full((b, 8), -1, np.int32),
        np.ones(b, np.int32),
        np.ones(b, np.int32),
        np.full(b, 9, np.int32),
    )
    return select, rows


def test_top_k_one_equals_greedy(workdir):
    prompts = case(LLAMA, "batch")["prompts"][:3]
    greedy = generation.compile(context(LLAMA, workdir, max_new_tokens=8), 3)
    sampled = generation.compile(
        context(LLAMA, workdir, max_new_tokens=8, do_sample=True, top_k=1, temperature=0.7), 3
    )
    assert generation.generate(sampled, prompts, [5, 6, 7]) == generation.generate(
        greedy, prompts, [0, 0, 0]
    )


def test_samples_follow_the_softmax_of_the_processed_scores():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 6)).astype(np.float32) * 2
    select, rows = _scores(logits, do_sample=True, temperature=0.8, top_k=4)
    draws = 4000
    tokens = np.array(
        [
            int(select(logits, np.array([s], np.int32), np.zeros(1, np.int32), rows, ())[0])
            for s in range(draws)
        ]
    )
    kept = np.argsort(logits[0])[-4:]
    probs = np.zeros(6)
    z = np.exp(logits[0, kept] / 0.8)
    probs[kept] = z / z.sum()
    counts = np.bincount(tokens, minlength=6)
    assert counts[probs == 0].sum() == 0
    expected = probs[kept] * draws
    chi2 = float((((counts[kept] - expected) ** 2) / expected).sum())
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = np.log(probs)[None].astype(np.float32)
    select, rows = _scores(logits, do_sample=True, top_p=0.85, top_k=0)
    seen = {
        int(select(logits, np.array([s], np.int32), np.zeros(1, np.int32), rows, ())[0])
        for s in range(300)
    }
    assert seen == {0, 1, 2}  # 0.4 + 0.3 < 0.85 <= 0.4 + 0.3 + 0.2


def test_a_custom_processor_bans_a_token_in_rows_of_different_lengths(workdir):
    batch = case(LLAMA, "batch")
    prompts, expected = batch["prompts"], batch["tokens"]
    banned = expected[0][0]  # the first token greedy gives the first row

    def state(row):
        return np.asarray(len(row["generated"]), np.int32)

    def ban(logits, count):
        del count
        return logits.at[banned].set(LOWEST)

    ctx = context(LLAMA, workdir, max_new_tokens=6)
    ctx = dataclasses.replace(ctx, processors=(*ctx.processors, (state, ban)))
    ctx = generation.compile(ctx, len(prompts))
    out = generation.generate(ctx, prompts, [0] * len(prompts))
    assert all(banned not in row for row in out)
    assert out[0][0] != expected[0][0]


def test_log_probabilities_are_the_log_softmax_at_the_token(workdir):
    greedy = case(LLAMA, "greedy")
    seen = []
    ctx = generation.compile(context(LLAMA, workdir, max_new_tokens=5, token_logprobs=True), 1)
    out = generation.generate(ctx, greedy["prompts"], [0], on_token=seen.append)[0]
    assert [t for t, _ in out] == greedy["tokens"][0][:5]
    assert all(lp <= 0 for _, lp in out)
    np.testing.assert_allclose([e["logprob"][0] for e in seen], [lp for _, lp in out])


def test_argmax_is_jnp_argmax():
    """The selection's argmax (two plain reductions) picks what jnp.argmax picks: the first
    maximum, the first NaN where a row has one, over ties, infinities and signed zeros."""
    from transmuter_jax.generation.select import argmax

    rng = np.random.default_rng(0)
    rows = rng.integers(-3, 4, (64, 37)).astype(np.float32)  # many ties
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    picks = rng.random(rows.shape) < 0.15
    rows[picks] = rng.choice(special, picks.sum())
    rows[0] = -np.inf
    rows[1] = np.nan
    rows[2, :2] = [-0.0, 0.0]
    rows[2, 2:] = -1.0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(rows)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)))
