"""Beam search equals transformers 4.57.6 generate(num_beams=...) on the fixtures.

Each case's prompts (of different lengths) run in ONE batch; the references were made with each
prompt alone. Tokens are exact; sequences_scores and the log-probabilities of the chosen beam
(compute_transition_scores with beam_indices) agree within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
from generation_cases import case, context, encoder_inputs, reference

from transmuter_jax import generation

FAST = ["llama-optimum", "llama-genai-fp32"]  # append and in_place
GROW = ["whisper-optimum", "marian-optimum"]  # grow, encoder-decoder: one length per group
EMBEDS = ["smolvlm-torch", "qwen25vl-genai-fp32"]  # decoders of embeddings: their "beam" case


def _cases():
    params = []
    for name in FAST + GROW + EMBEDS:
        for c in reference(name)[0]["cases"]:
            if not c["name"].startswith("beam") or (name in EMBEDS and c["name"] != "beam"):
                continue
            if c["options"].get("num_return_sequences", 1) > 1:
                continue  # test_returns.py
            if name in GROW and c["name"] not in (
                "beam_4_lp2.0_early_never",
                "beam_3_lp1.0_early_true_eos_list",
            ):
                continue  # each decode step of grow compiles: two cases cover it
            params.append(pytest.param(name, c["name"], id=f"{name}/{c['name']}"))
    return params


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("beam")


@pytest.mark.parametrize(("name", "case_name"), _cases())
def test_beam_search_equals_transformers(name, case_name, workdir):
    the_case = case(name, case_name)
    prompts = the_case["prompts"]
    given, inputs = encoder_inputs(name, the_case, list(range(len(prompts))))
    skip = ("do_sample", "num_return_sequences")
    options = {k: v for k, v in the_case["options"].items() if k not in skip}
    ctx = context(name, workdir, given=given, token_logprobs="logprobs" in the_case, **options)
    ctx = generation.compile(ctx, len(prompts))
    events = []
    out = generation.generate(ctx, prompts, [0] * len(prompts), inputs, on_token=events.append)
    pairs = out if "logprobs" in the_case else [[(t, 0.0) for t in row] for row in out]
    assert [[t for t, _ in row] for row in pairs] == the_case["tokens"]
    np.testing.assert_allclose(events[-1]["score"], the_case["sequences_scores"], atol=1e-4)
    for row, logprobs in zip(pairs, the_case.get("logprobs", []), strict=False):
        np.testing.assert_allclose([lp for _, lp in row], logprobs[: len(row)], atol=1e-4)


def test_one_beam_is_greedy(workdir):
    batch = case("llama-optimum", "batch")
    ctx = context(
        "llama-optimum", workdir, num_beams=1, max_new_tokens=batch["options"]["max_new_tokens"]
    )
    ctx = generation.compile(ctx, len(batch["prompts"]))
    assert (
        generation.generate(ctx, batch["prompts"], [0] * len(batch["prompts"])) == batch["tokens"]
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(num_beams=0), "num_beams must be a positive integer"),
        (dict(num_beams=600), "more than the vocabulary"),
        (dict(num_beams=2, num_return_sequences=3), "more than num_beams"),
    ],
)
def test_bad_beam_options_get_clear_errors(options, message, workdir):
    with pytest.raises(ValueError, match=message):
        context("llama-optimum", workdir, **options)
