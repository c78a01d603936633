"""Each logits processor, alone and together, equals transformers' own on stored vectors.

tests/fixtures/processors holds random logits and histories with the scores that transformers
4.57.6's processor list (built by generate() for each row) gives; rows have different lengths, and
cases cover decoder-only and encoder-decoder prompts. transformers' -inf is the smallest finite
float32 here.
"""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import pytest

from transmuter_jax.generation.options import merge
from transmuter_jax.generation.processors import LOWEST, Rows, from_options, static_masks
from transmuter_jax.generation.select import processed

FOLDER = pathlib.Path(__file__).parent / "fixtures" / "processors"


@functools.cache
def _data():
    return json.loads((FOLDER / "cases.json").read_text()), dict(np.load(FOLDER / "cases.npz"))


def _cases():
    cases = _data()[0]["cases"]
    return [
        pytest.param(c["name"], id=c["name"]) for c in cases if not c.get("multi_token_bad_words")
    ]


def _case(name):
    return next(c for c in _data()[0]["cases"] if c["name"] == name)


def _encoder(case, row) -> np.ndarray:
    """[1, E] the encoder ids transformers read for ``row``: the stored source of an
    encoder-decoder, a decoder-only prompt; -1 after them."""
    ids = case.get("encoder_input_ids") or row["prompt"]
    out = np.full((1, len(ids) + 2), -1, np.int32)
    out[0, : len(ids)] = ids
    return out


def test_the_encoder_cases_are_stored():
    names = {c["name"] for c in _data()[0]["cases"]}
    assert {"encoder_all", "encoder_all_encdec", "encoder_no_repeat_ngram_3"} <= names


@pytest.mark.parametrize("name", _cases())
def test_scores_equal_transformers(name):
    case = _case(name)
    arrays = _data()[1]
    options = merge(
        {}, case["generation_config"], {"max_new_tokens": case["max_new_tokens"], **case["options"]}
    )
    masks = static_masks(options, case["vocab"])
    logits, want = arrays[case["logits"]], arrays[case["scores"]]
    width = max(len(r["prompt"]) + len(r["generated"]) for r in case["rows"]) + 3
    for i, row in enumerate(case["rows"]):
        tokens = row["prompt"] + row["generated"]
        history = np.full((1, width), -1, np.int32)
        history[0, : len(tokens)] = tokens
        rows = Rows(
            history,
            np.array([len(row["prompt"])], np.int32),
            np.array([len(tokens)], np.int32),
            np.array([len(row["prompt"]) + case["max_new_tokens"]], np.int32),
            _encoder(case, row) if options.encoder_ids else None,
        )
        got = np.asarray(
            processed(logits[i : i + 1], rows, from_options(options), (), options, masks)
        )
        expected = np.where(np.isneginf(want[i : i + 1]), LOWEST, want[i : i + 1])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
