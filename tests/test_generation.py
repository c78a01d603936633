"""Generation: greedy tokens equal transformers 4.57.6 generate() for every fixture and mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
from generation_cases import FIXTURES, case, context, decoder, encoder_inputs, reference, tiered

from transmuter_jax import generation

EXACT = sorted(
    p.parent.name
    for p in FIXTURES.glob("*/reference.json")
    if json.loads(p.read_text()).get("exact")
)
MODES = {
    "gpt2-optimum": "append",
    "llama-optimum": "append",
    "qwen2-optimum": "append",
    "gemma3-optimum": "grow",
    "whisper-optimum": "grow",
    "marian-optimum": "grow",
    "smolvlm-torch": "append",
    "llama-genai-fp32": "in_place",
    "qwen2-genai-fp32": "in_place",
    "gemma3-genai-fp32": "in_place",
    "qwen25vl-genai-fp32": "in_place",
    # issue 29's architectures (tests/fixtures/make_archs.py): a sliding window, or no
    # position_ids, gives grow
    "qwen3-optimum": "append",
    "phi3-optimum": "grow",
    "mistral-optimum": "append",
    "mistral-window-optimum": "grow",
    "granite-optimum": "append",
    "olmo2-optimum": "append",
    "gemma2-optimum": "grow",
    "cohere-optimum": "append",
    "stablelm-optimum": "append",
    "falcon-optimum": "append",
    "gpt-neox-optimum": "append",
    "opt-optimum": "append",
    "bloom-optimum": "grow",
    "smollm3-optimum": "append",
    "qwen3-genai-fp32": "in_place",
    "phi3-genai-fp32": "in_place",
    "mistral-genai-fp32": "in_place",
    "mistral-window-genai-fp32": "in_place",
    "granite-genai-fp32": "in_place",
}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("generation")


def test_every_exact_fixture_has_a_known_mode():
    assert sorted(MODES) == EXACT


@pytest.mark.parametrize("name", sorted(MODES))
def test_cache_mode_is_detected_from_the_graph(name):
    assert generation.cache_mode(decoder(name)) == MODES[name]


# The quick tier runs the batch case (its prompts in one batch, a padding row after them) on every
# family, and the one-prompt greedy case on one family of each exporter and cache mode; the rest
# is in the slow sweep.
GREEDY_QUICK = (
    "llama-optimum", "llama-genai-fp32", "gemma3-optimum", "whisper-optimum", "marian-optimum",
    "smolvlm-torch", "qwen25vl-genai-fp32", "bloom-optimum",
)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "case_name"),
    [
        tiered(
            name,
            case_name,
            id=f"{case_name}-{name}",
            quick=case_name == "batch" or name in GREEDY_QUICK,
        )  # fmt: skip
        for case_name in ("greedy", "batch")
        for name in EXACT
    ],
)
def test_greedy_tokens_equal_transformers(name, case_name, workdir):
    """The prompts of a case in ONE batch, with an empty padding row after them."""
    the_case = case(name, case_name)
    prompts = the_case["prompts"]
    given, inputs = encoder_inputs(name, the_case, list(range(len(prompts))))
    inputs = {k: np.concatenate([v, v[:1]]) for k, v in inputs.items()}  # the padding row's
    ctx = context(name, workdir, given=given, max_new_tokens=the_case["options"]["max_new_tokens"])
    ctx = generation.compile(ctx, len(prompts) + 1)
    out = generation.generate(ctx, prompts + [[]], list(range(len(prompts) + 1)), inputs)
    assert out[:-1] == the_case["tokens"]
    assert out[-1] == []


@pytest.mark.parametrize("name", ["smolvlm-torch", "qwen25vl-genai-fp32"])
def test_image_features_replace_the_image_tokens(name, workdir):
    the_case = case(name, "image")
    _, arrays = reference(name)
    inputs = {"image_features": arrays[the_case["image_features"][0]]}
    if "position_ids" in the_case:  # M-RoPE positions of the prompt, one list per axis
        inputs["position_ids"] = [arrays[the_case["position_ids"][0]][:, 0].tolist()]
    ctx = context(
        name,
        workdir,
        image_token=the_case["image_token_id"],
        max_new_tokens=the_case["options"]["max_new_tokens"],
    )
    ctx = generation.compile(ctx, 1)
    assert generation.generate(ctx, the_case["prompts"], [0], inputs) == the_case["tokens"]
