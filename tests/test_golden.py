"""Golden tokens: each fixture's graphs reproduce transformers 4.57.6 greedy generation.

The fixtures' references are the greedy tokens and per-step logits of transformers `generate()`
on the torch models. Fed the prompt and the reference tokens at once (teacher forcing, empty
cache), the exported graph must predict each next token and give the same logits: this checks the
whole graph against transformers without a generation loop. int4 exports are different models
(re-quantized), so only the exact exports are checked here.
"""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import pytest
from generation_cases import tiered

import transmuter_jax as tj
from transmuter_jax.testing import example_inputs

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TOLERANCE = 1e-4


# The quick tier runs every prompt of these; each other fixture runs one prompt of each case
# there (which one turns from fixture to fixture); the rest is in the slow sweep.
EVERY_PROMPT = ("llama-optimum", "qwen25vl-genai-fp32")


def _cases():
    params = []
    for f, file in enumerate(sorted(FIXTURES.glob("*/reference.json"))):
        reference = json.loads(file.read_text())
        if not reference.get("exact"):  # the vision fixtures keep other references
            continue
        for case in reference["cases"]:
            if case["name"] == "beam" or "logits" not in case:
                continue
            count = len(case["prompts"])
            for i in range(count):
                name = f"{file.parent.name}/{case['name']}/{i}"
                quick = file.parent.name in EVERY_PROMPT or i == f % count
                params.append(tiered(file.parent, case["name"], i, id=name, quick=quick))
    return params


@functools.cache
def _reference(folder: pathlib.Path) -> tuple[dict, dict]:
    reference = json.loads((folder / "reference.json").read_text())
    return reference, dict(np.load(folder / "reference.npz"))


@functools.cache
def _model(path: pathlib.Path) -> tj.Model:
    return tj.load(path)


def _embed(folder: pathlib.Path, reference: dict, arrays: dict, ids: list[int]) -> np.ndarray:
    """The embeddings of ``ids``, (1, len, hidden), from embed_tokens.onnx or the stored table."""
    if reference["files"].get("embed"):
        embed = _model(folder / reference["files"]["embed"])
        return np.asarray(embed({"input_ids": np.array([ids], np.int64)})["inputs_embeds"])
    return arrays[reference["embed_table"]][np.array(ids)][None]


def _decoder_inputs(folder, reference, arrays, case, i) -> tuple[tj.Model, dict, int]:
    prompt, tokens = case["prompts"][i], case["tokens"][i]
    ids = prompt + tokens
    decoder = _model(folder / reference["files"]["decoder"])
    names = {info.name for info in decoder.inputs}
    encoder_outputs, encoder_mask = None, None
    if reference["files"].get("encoder"):
        encoder = _model(folder / reference["files"]["encoder"])
        feeds = {k: arrays[v] for k, v in case["encoder_inputs"][i].items()}
        encoder_outputs = np.asarray(encoder(feeds)["last_hidden_state"])
        encoder_mask = feeds.get("attention_mask")
    length = encoder_outputs.shape[1] if encoder_outputs is not None else 1
    inputs = example_inputs(decoder, length=len(ids), past=0, encoder_length=length)
    if "input_ids" in names:
        inputs["input_ids"] = np.array([ids], np.int64)
    else:
        embeds = _embed(folder, reference, arrays, ids)
        if "inputs_embeds" in case:  # the prompt's embeddings with the image features in
            prompt_embeds = arrays[case["inputs_embeds"][i]]
            embeds = np.concatenate([prompt_embeds, embeds[:, len(prompt) :]], axis=1)
        inputs["inputs_embeds"] = embeds.astype(np.float32)
    if "position_ids" in case:  # M-RoPE: stored for the prompt, then index + rope delta
        stored = arrays[case["position_ids"][i]]
        after = np.arange(len(prompt), len(ids)) + case["rope_deltas"][i]
        after = np.broadcast_to(after, (stored.shape[0], 1, len(tokens)))
        inputs["position_ids"] = np.concatenate([stored, after], axis=2).astype(np.int64)
    if encoder_outputs is not None:
        inputs["encoder_hidden_states"] = encoder_outputs
        if "encoder_attention_mask" in names:
            inputs["encoder_attention_mask"] = encoder_mask
    return decoder, inputs, len(prompt)


@pytest.mark.parametrize(("folder", "case_name", "i"), _cases())
def test_graph_reproduces_transformers_greedy_tokens(folder, case_name, i):
    reference, arrays = _reference(folder)
    case = next(c for c in reference["cases"] if c["name"] == case_name)
    decoder, inputs, prompt_length = _decoder_inputs(folder, reference, arrays, case, i)
    expected = arrays[case["logits"][i]]  # (steps, vocab)
    steps = len(expected)
    logits = np.asarray(decoder(inputs)["logits"])[0, prompt_length - 1 : prompt_length - 1 + steps]
    want = list(case["tokens"][i]) + (
        [reference["eos_token_id"]] if case["stopped_at_eos"][i] else []
    )
    assert logits.argmax(-1).tolist() == want
    diff = np.abs(logits - expected).max()
    assert diff <= TOLERANCE, f"logits differ from transformers by {diff:.3g}"
