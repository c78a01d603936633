"""image_to_text on a TrOCR-style model (DeiT encoder, TrOCRForCausalLM decoder) in the
onnx-community layout, fp32 and ``_quantized`` (onnxruntime's quantize_dynamic), against
transformers' pixel values, greedy ids and pipeline text, and onnxruntime's greedy ids on the
quantized files (tests/fixtures/make_vision.py, trocr-community)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("PIL")

from transmuter_jax import vision  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "trocr-community"
REF = json.loads((FIXTURE / "trocr.json").read_text())
NPZ = np.load(FIXTURE / "trocr.npz")
N = REF["max_new_tokens"]


@pytest.fixture(scope="module")
def pipe():
    return vision.image_to_text(FIXTURE)


def test_the_layout_and_the_processor(pipe):
    assert pipe.files.family == "transformers.js"
    assert pipe.files.encoder.endswith("onnx/encoder_model.onnx")
    assert pipe.files.decoder.endswith("onnx/decoder_model_merged.onnx")
    assert type(pipe.processor).__name__ == "DeiTImageProcessor"
    for case in REF["images"]:
        got = pipe.pixel_values([FIXTURE / case["file"]])[0]
        assert np.array_equal(got, NPZ[case["pixel_values"]]), case["file"]


def test_greedy_tokens_and_text_equal_transformers(pipe):
    for case in REF["images"]:
        result = pipe.generate([FIXTURE / case["file"]], max_new_tokens=N)[0]
        assert result.token_ids == case["tokens"], case["file"]
        assert result.text == case["text"], case["file"]
        assert result.finish_reason == ("length" if len(case["tokens"]) == N else "eos")


@pytest.mark.slow  # vitgpt2-optimum's batch test covers batching by default
def test_a_batch_equals_transformers_batch(pipe):
    batch = REF["batch"]
    results = pipe.generate([FIXTURE / f for f in batch["files"]], max_new_tokens=N)
    assert [r.token_ids for r in results] == batch["tokens"]


QUANTIZED = [c for c in REF["images"] if c["quantized_tokens"] != c["tokens"]]


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[] if i == 0 else pytest.mark.slow) for i, c in enumerate(QUANTIZED)],
    ids=lambda c: c["file"],
)
def test_the_quantized_variant_equals_onnxruntime(case):
    """dtype="quantized" picks onnx/*_quantized.onnx (MatMulInteger, ConvInteger,
    DynamicQuantizeLinear): its greedy ids are onnxruntime's on the same files, which differ
    from the fp32 ones on these images."""
    pipe = _quantized()
    assert pipe.files.dtype == "quantized"
    assert pipe.files.encoder.endswith("encoder_model_quantized.onnx")
    result = pipe.generate([FIXTURE / case["file"]], max_new_tokens=N)[0]
    assert result.token_ids == case["quantized_tokens"]


_PIPES: dict[str, vision.ImageToText] = {}


def _quantized() -> vision.ImageToText:
    if "q" not in _PIPES:
        _PIPES["q"] = vision.image_to_text(FIXTURE, dtype="q8")  # transformers.js' name
    return _PIPES["q"]
