"""image_text_to_text on SmolVLM in the onnx-community layout against transformers' greedy
generate (tests/fixtures/make_vision.py, smolvlm-community): each image with and without image
splitting, and a left-padded batch of two conversations of one image each."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("PIL")

from transmuter_jax import vision  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "smolvlm-community"
TEXT_ONLY = pathlib.Path(__file__).parent / "fixtures" / "smolvlm-torch"
REF = json.loads((FIXTURE / "vlm.json").read_text())
SINGLE = [c for c in REF["cases"] if not c.get("batch")]
BATCH = [c for c in REF["cases"] if c.get("batch")]


@pytest.fixture(scope="module")
def pipe():
    return vision.image_text_to_text(FIXTURE, max_new_tokens=REF["max_new_tokens"])


def _chat(file: str, question: str) -> list[dict]:
    content = [{"type": "image", "image": str(FIXTURE / file)}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def _conversations(case) -> list[list[dict]]:
    return [_chat(fs[0], q) for fs, q in zip(case["files"], case["question"], strict=True)]


@pytest.mark.parametrize(
    "case", SINGLE, ids=lambda c: f"{c['files'][0][0]}-split{c['do_image_splitting']}"
)
def test_prompt_ids_and_tokens_equal_transformers(pipe, case):
    split = case["do_image_splitting"]
    conversations = _conversations(case)
    ids, features = pipe.inputs(conversations, do_image_splitting=split)
    assert ids == case["input_ids"]
    assert features.shape[0] == ids[0].count(REF["image_token_id"])
    out = pipe.generate(conversations, do_image_splitting=split, token_logprobs=True)
    assert [r.token_ids for r in out] == case["tokens"]
    assert len(out[0].logprobs) == len(case["tokens"][0])
    assert out[0].finish_reason == ("length" if len(case["tokens"][0]) == REF["max_new_tokens"]
                                    else "eos")  # fmt: skip


def test_left_padded_batch_equals_transformers(pipe):
    (case,) = BATCH
    assert len({len(p) for p in case["input_ids"]}) == 2  # the shorter prompt is padded
    out = pipe.generate(_conversations(case), do_image_splitting=case["do_image_splitting"])
    assert [r.token_ids for r in out] == case["tokens"]


def test_shorthand_stream_and_call_agree(pipe):
    case = SINGLE[0]
    file, question = case["files"][0][0], case["question"][0]
    split = case["do_image_splitting"]
    (result,) = pipe.generate([_chat(file, question)], do_image_splitting=split)
    assert result.token_ids == case["tokens"][0]
    assert pipe(str(FIXTURE / file), question, do_image_splitting=split) == result.text
    assert pipe(_chat(file, question), do_image_splitting=split) == result.text
    pieces = list(pipe.stream(str(FIXTURE / file), question, do_image_splitting=split))
    assert "".join(pieces) == result.text


def test_more_image_tokens_than_images(pipe):
    content = [{"type": "image", "image": str(FIXTURE / "wide.png")},
               {"type": "text", "text": "and <image> here"}]  # fmt: skip
    with pytest.raises(ValueError, match="2 <image> tokens for 1 images"):
        pipe.generate([[{"role": "user", "content": content}]])
    text_only = [{"role": "user", "content": [{"type": "text", "text": "<image> what?"}]}]
    with pytest.raises(ValueError, match="1 <image> tokens for 0 images"):
        pipe.generate([text_only])


def test_an_image_given_to_a_text_only_model():
    with pytest.raises(ValueError, match="no vision encoder .*vision_encoder.onnx"):
        vision.image_text_to_text(TEXT_ONLY)


def test_messages_or_image_and_question(pipe):
    with pytest.raises(TypeError, match="chat messages, or an image and a question"):
        pipe("just text")
    assert np.isfinite(pipe.inputs([_chat("tall.png", "Hi")])[1]).all()
