"""SmolVLM whose vision encoder is transformers' own ``get_image_features`` (tests/fixtures/
make_vision.py, smolvlm-features): the graph drops the all-zero padding frames with
``pixel_values[real_images_inds]`` (NonZero + GatherND), so its output has one row per real image
frame, a value-dependent shape. It equals onnxruntime, and generation equals transformers' greedy
``generate``, for single images and for left-padded batches that carry padding frames."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("PIL")
ort = pytest.importorskip("onnxruntime")

from transmuter_jax import vision  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "smolvlm-features"
REF = json.loads((FIXTURE / "features.json").read_text())
FEATURES = np.load(FIXTURE / "features.npz")
CASES = {c["key"]: c for c in REF["cases"]}
ENCODER = FIXTURE / "onnx" / "vision_encoder.onnx"


@pytest.fixture(scope="module")
def pipe():
    return vision.image_text_to_text(FIXTURE, max_new_tokens=REF["max_new_tokens"])


def _conversations(case) -> list[list[dict]]:
    out = []
    for files, question in zip(case["files"], case["question"], strict=True):
        content = [{"type": "image", "image": str(FIXTURE / f)} for f in files]
        out.append([{"role": "user", "content": [*content, {"type": "text", "text": question}]}])
    return out


def _processed(pipe, case):
    conversations = _conversations(case)
    texts = [pipe.processor.chat_text(c) for c in conversations]
    images = [pipe.processor.images_of(c) for c in conversations]
    _, processed = pipe.processor.encode(
        texts, images, do_image_splitting=case["do_image_splitting"]
    )
    return processed


def test_the_encoder_has_a_value_dependent_shape(pipe):
    assert pipe.encoder.host_split is not None
    assert "NonZero" in pipe.encoder.host_split.label


@pytest.mark.parametrize("key", sorted(CASES))
def test_encoder_equals_onnxruntime_and_transformers(pipe, key):
    case = CASES[key]
    processed = _processed(pipe, case)
    feed = {
        "pixel_values": processed.pixel_values,
        "pixel_attention_mask": processed.pixel_attention_mask,
    }
    assert processed.pixel_values.shape[0] * processed.pixel_values.shape[1] == case["frames"]
    got = np.asarray(pipe.encoder(feed)["image_features"])
    theirs = ort.InferenceSession(str(ENCODER)).run(None, feed)[0]
    assert got.shape == theirs.shape == FEATURES[case["features"]].shape
    assert got.shape[0] == case["real_frames"]  # the padding frames are dropped
    np.testing.assert_allclose(got, theirs, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got, FEATURES[case["features"]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key", sorted(CASES))
def test_generation_equals_transformers(pipe, key):
    case = CASES[key]
    conversations = _conversations(case)
    split = case["do_image_splitting"]
    ids, features = pipe.inputs(conversations, do_image_splitting=split)
    assert ids == case["input_ids"]
    assert features.shape[0] == sum(row.count(REF["image_token_id"]) for row in ids)
    out = pipe.generate(conversations, do_image_splitting=split)
    assert [r.token_ids for r in out] == case["tokens"]


def test_batches_carry_padding_frames():
    """The references' batches are what the tests claim: rows of different frame counts (so
    padding frames) and prompts of different lengths (so left padding)."""
    batches = [c for c in REF["cases"] if len(c["files"]) > 1]
    assert len(batches) == 2
    for case in batches:
        assert case["real_frames"] < case["frames"]
        assert len({len(p) for p in case["input_ids"]}) == 2
