"""A folder as the onnxruntime-genai builder writes it (genai_config.json, no config.json or
generation_config.json) loads and generates as the full folder does: the cache dimensions, token
ids, context length and search defaults come from genai_config.json."""

from __future__ import annotations

import json
import shutil

import pytest
from generation_cases import FIXTURES, case, decoder, embed

from transmuter_jax import generation, hub, text

# Every genai fixture with a decoder and references (the Whisper and VLM pipelines' folders,
# whose processors read config.json for more than generation, are not among them).
GENAI = sorted(p.name for p in FIXTURES.glob("*-genai-*") if (p / "reference.json").exists())
TRANSFORMERS_FILES = ("config.json", "generation_config.json")


def raw_copy(name: str, tmp_path):
    """The fixture's folder without its transformers files (and its references)."""
    folder = tmp_path / name
    ignore = shutil.ignore_patterns(*TRANSFORMERS_FILES, "reference.*")
    shutil.copytree(FIXTURES / name, folder, ignore=ignore)
    return folder


def test_the_fixtures_are_there():
    assert len(GENAI) >= 8, GENAI


@pytest.mark.parametrize("name", GENAI)
def test_raw_folder_generates_the_full_folders_tokens(name, tmp_path):
    raw = raw_copy(name, tmp_path)
    model, embeds = decoder(name), embed(name, tmp_path)
    full = generation.context(FIXTURES / name, model, embed=embeds, max_new_tokens=8)
    bare = generation.context(raw, model, embed=embeds, max_new_tokens=8)
    assert bare.cache == full.cache
    assert bare.eos == full.eos and bare.eos
    assert bare.options.pad_token_id == full.options.pad_token_id
    assert bare.options.bos_token_id == full.options.bos_token_id
    assert bare.position_limit == full.position_limit
    prompts = case(name, "batch")["prompts"]
    seeds = list(range(len(prompts)))
    want = generation.generate(generation.compile(full, len(prompts)), prompts, seeds)
    got = generation.generate(generation.compile(bare, len(prompts)), prompts, seeds)
    assert got == want and any(want)


@pytest.mark.parametrize("name", [n for n in GENAI if not n.startswith("qwen25vl")])
def test_text_generation_of_a_raw_folder(name, tmp_path):
    """text.generation on the folder as it is (the README's genai layout)."""
    raw = raw_copy(name, tmp_path)
    want = text.generation(str(FIXTURES / name))("The quiet river", max_new_tokens=6)
    assert text.generation(str(raw))("The quiet river", max_new_tokens=6) == want


def test_search_options_are_generation_defaults(tmp_path):
    raw = raw_copy("llama-genai-fp32", tmp_path)
    config = json.loads((raw / "genai_config.json").read_text())
    config["search"] |= {"do_sample": True, "top_k": 7, "temperature": 0.5, "max_length": 40}
    (raw / "genai_config.json").write_text(json.dumps(config))
    options = generation.context(raw, decoder("llama-genai-fp32")).options
    assert (options.do_sample, options.top_k, options.temperature) == (True, 7, 0.5)
    assert options.max_length == 40
    assert hub.read_json(raw, "config.json")["max_position_embeddings"] == 256
    # A folder with the transformers files reads them, not genai_config.json.
    assert hub.read_json(FIXTURES / "llama-genai-fp32", "generation_config.json") == json.loads(
        (FIXTURES / "llama-genai-fp32" / "generation_config.json").read_text()
    )


def test_a_folder_without_either_reads_nothing(tmp_path):
    assert hub.read_json(tmp_path, "config.json") == {}
    assert hub.read_json(tmp_path, "generation_config.json") == {}
