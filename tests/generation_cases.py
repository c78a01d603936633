"""Loads fixtures for generation tests: decoder, embed, encoder outputs and references."""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import transmuter_jax as tj
from transmuter_jax import generation

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def tiered(*values, quick: bool, id: str | None = None):
    """A test parameter of the quick tier when ``quick``, else marked slow (the full sweep)."""
    return pytest.param(*values, id=id, marks=() if quick else (pytest.mark.slow,))


@functools.cache
def reference(name: str) -> tuple[dict, dict]:
    folder = FIXTURES / name
    return json.loads((folder / "reference.json").read_text()), dict(
        np.load(folder / "reference.npz")
    )


def case(name: str, case_name: str) -> dict:
    return next(c for c in reference(name)[0]["cases"] if c["name"] == case_name)


@functools.cache
def load(path: pathlib.Path, outputs: tuple[str, ...] | None = None) -> tj.Model:
    return tj.load(path, outputs=outputs)


@functools.cache
def decoder(name: str) -> tj.Model:
    ref = reference(name)[0]
    return load(FIXTURES / name / ref["files"]["decoder"])


@functools.cache
def embed(name: str, tmp: pathlib.Path) -> tj.Model | None:
    """The embedding model: embed_tokens.onnx, or a Gather over the stored table."""
    ref, arrays = reference(name)
    if ref["files"].get("embed"):
        return load(FIXTURES / name / ref["files"]["embed"])
    if "embed_table" not in ref:
        return None
    table = arrays[ref["embed_table"]]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["inputs_embeds"])],
        "embed",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [
            helper.make_tensor_value_info(
                "inputs_embeds", TensorProto.FLOAT, ["b", "s", table.shape[1]]
            )
        ],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    path = tmp / f"{name}-embed.onnx"
    onnx.save(model, path)
    return tj.load(path)


def encoder_inputs(name: str, the_case: dict, rows: list[int]) -> tuple[tuple[str, ...], dict]:
    """The given inputs of an encoder-decoder for the prompts ``rows`` of a case, padded to one
    length with a zero attention mask where the decoder takes one."""
    ref, arrays = reference(name)
    if not ref["files"].get("encoder"):
        return (), {}
    encoder = load(FIXTURES / name / ref["files"]["encoder"])
    states, masks = [], []
    for i in rows:
        feeds = {k: arrays[v] for k, v in the_case["encoder_inputs"][i].items()}
        states.append(np.asarray(encoder(feeds)["last_hidden_state"])[0])
        masks.append(np.ones(len(states[-1]), np.int64))
    longest = max(len(s) for s in states)
    hidden = np.zeros((len(rows), longest, states[0].shape[1]), np.float32)
    mask = np.zeros((len(rows), longest), np.int64)
    for r, (s, m) in enumerate(zip(states, masks, strict=True)):
        hidden[r, : len(s)], mask[r, : len(m)] = s, m
    given = {"encoder_hidden_states": hidden}
    if "encoder_attention_mask" in {i.name for i in decoder(name).inputs}:
        given["encoder_attention_mask"] = mask
    elif longest != min(len(s) for s in states):
        raise ValueError("encoder outputs of different lengths need an encoder_attention_mask")
    return tuple(given), given


def context(name: str, tmp: pathlib.Path, *, given=(), image_token=None, **options):
    return generation.context(
        FIXTURES / name,
        decoder(name),
        given=given,
        embed=embed(name, tmp),
        image_token=image_token,
        **options,
    )


def swap_two_tokens(folder: pathlib.Path, into: pathlib.Path) -> None:
    """Writes ``into``/tokenizer.json: ``folder``'s, with the ids of two tokens swapped (a model
    of the same vocabulary size but other token texts)."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (into / "tokenizer.json").write_text(json.dumps(tokenizer))
