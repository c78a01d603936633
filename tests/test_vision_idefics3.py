"""The Idefics3 / SmolVLM processor against transformers' references (tests/fixtures/make_vision.py,
smolvlm-processor): pixel values, pixel_attention_mask, tile rows and columns, and prompt ids,
with and without image splitting, alone and in a padded batch."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("PIL")

from transmuter_jax.text.tokenizer import Tokenizer  # noqa: E402
from transmuter_jax.vision import idefics3  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "smolvlm-processor"
REF = json.loads((FIXTURE / "reference.json").read_text())
NPZ = np.load(FIXTURE / "reference.npz")
SINGLE = [c for c in REF["cases"] if len(c["files"]) == 1]
BATCH = [c for c in REF["cases"] if len(c["files"]) > 1]


@pytest.fixture(scope="module")
def processor():
    return idefics3.Idefics3Processor(FIXTURE, Tokenizer.from_folder(FIXTURE))


def _with_images(case):
    """The case's conversations with each image part carrying its file."""
    out = []
    for messages, files in zip(case["messages"], case["files"], strict=True):
        paths = iter(FIXTURE / f for f in files)
        out.append(
            [
                {
                    **m,
                    "content": [
                        {**p, "image": next(paths)} if p["type"] == "image" else p
                        for p in m["content"]
                    ],
                }  # fmt: skip
                for m in messages
            ]
        )
    return out


def _check(processor, case):
    options = {"do_image_splitting": case["do_image_splitting"]}
    ids, images = processor(_with_images(case), **options)
    assert ids == case["input_ids"]
    expected = NPZ[case["pixel_values"]]
    assert images.pixel_values.shape == expected.shape
    assert np.array_equal(images.pixel_values, expected)
    assert np.array_equal(images.pixel_attention_mask, NPZ[case["pixel_attention_mask"]])
    if "rows" in case:
        assert (images.rows, images.cols) == (case["rows"], case["cols"])


def test_the_cases_cover_splitting_shapes():
    split = [c for c in SINGLE if c["do_image_splitting"]]
    assert {tuple(c["rows"][0] + c["cols"][0]) for c in split} >= {(2, 2), (1, 2), (2, 1)}


@pytest.mark.parametrize(
    "case", SINGLE, ids=[f"{c['files'][0][0]}-{c['do_image_splitting']}" for c in SINGLE]
)
def test_one_image_equals_transformers(processor, case):
    assert processor.image_seq_len == REF["image_seq_len"]
    assert [processor.chat_text(m) for m in case["messages"]] == case["text"]
    _check(processor, case)


@pytest.mark.parametrize("case", BATCH, ids=[str(c["do_image_splitting"]) for c in BATCH])
def test_a_padded_batch_equals_transformers(processor, case):
    _check(processor, case)
    mask = NPZ[case["pixel_attention_mask"]]
    assert mask[0].sum() < mask[1].sum()  # the first row has fewer images: zero images after


def test_image_token_count_must_match(processor):
    with pytest.raises(ValueError, match="2 <image> tokens for 1 images"):
        processor.encode(["<image><image>two"], [[FIXTURE / "gray.png"]])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(ValueError, match="needs its image"):
        processor([messages])
