"""Issue 29's decoder architectures (tests/fixtures/make_archs.py): the cache mode of sliding-window
graphs, and the padded grow cache on the graphs that reach it.

Their graphs against onnxruntime, their greedy and batch tokens and their processor references are
tested with every fixture's (test_fixtures.py, test_golden.py, test_generation.py,
test_generation_processors.py).
"""

from __future__ import annotations

import json

import pytest
from generation_cases import FIXTURES, case, context, decoder
from test_grow_padding import _compare, _padded

from transmuter_jax import generation, hub
from transmuter_jax.generation import cache as cache_modes
from transmuter_jax.onnx.window import hidden_rows_matter

WINDOW = 16  # the sliding window of the fixtures that have one
WINDOWED = ["phi3-optimum", "mistral-window-optimum"]  # optimum graphs with position_ids
UNWINDOWED = ["mistral-optimum", "qwen3-optimum", "llama-optimum", "gpt2-optimum"]
PADDED = ["phi3-optimum", "mistral-window-optimum", "gemma2-optimum", "bloom-optimum"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("architectures")


def test_the_windowed_fixtures_have_a_window_the_prompts_cross():
    for name in WINDOWED:
        config = json.loads((FIXTURES / name / "config.json").read_text())
        assert config["sliding_window"] == WINDOW
        longest = max(len(p) for p in case(name, "batch")["prompts"])
        assert longest + case(name, "batch")["options"]["max_new_tokens"] > 3 * WINDOW
    assert json.loads((FIXTURES / "mistral-optimum" / "config.json").read_text())[
        "sliding_window"
    ] in (None, 0)


@pytest.mark.parametrize("name", WINDOWED)
def test_a_sliding_window_is_found_and_keeps_the_graph_out_of_append(name):
    reason = hidden_rows_matter(decoder(name))
    assert "Softmax" in reason and "hidden rows" in reason
    assert generation.cache_mode(decoder(name)) == "grow"


@pytest.mark.parametrize("name", UNWINDOWED)
def test_graphs_without_a_window_keep_append(name):
    assert hidden_rows_matter(decoder(name)) == ""
    assert generation.cache_mode(decoder(name)) == "append"


@pytest.mark.parametrize("name", PADDED)
def test_the_padded_rewrite_takes_the_grow_graphs(name):
    """Sliding windows with position_ids (Phi-3, Mistral), final soft-capping (Gemma 2), ALiBi
    through a ScatterND mask (Bloom): the padded graph equals the graph at exact lengths."""
    model = decoder(name)
    layout = cache_modes.layout(model, hub.read_json(FIXTURES / name, "config.json"))
    padded = _padded(model, layout)
    assert len(padded.masked) == 2  # both layers' self-attention
    for valid, rows, step in [(5, 12, 1), (1, 64, 1), (17, 64, 8), (40, 64, 1)]:
        diff = _compare(model, layout, padded, valid, rows, step)
        assert diff["logits"] < 1e-4 and diff["present"] < 1e-4, (valid, rows, step, diff)


@pytest.mark.parametrize("name", PADDED)
def test_grow_graphs_run_padded_with_the_transformers_tokens(name, workdir):
    """The batch's prompts (5, 1, 40 and 9 tokens, 16 new: past the window of 16) on a padded
    cache, every row as transformers generates it alone."""
    the_case = case(name, "batch")
    prompts = the_case["prompts"]
    ctx = context(name, workdir, max_new_tokens=the_case["options"]["max_new_tokens"])
    ctx = generation.compile(ctx, len(prompts))
    assert ctx.compiled.padded, ctx.compiled.unpadded
    assert generation.generate(ctx, prompts, list(range(len(prompts))), {}) == the_case["tokens"]
