"""Qwen2-VL / Qwen2.5-VL against transformers (tests/fixtures/make_qwen2vl.py,
qwen25vl-community): Qwen2VLImageProcessor pixel values and grids, Qwen2_5_VLProcessor prompt
ids, get_rope_index positions and rope deltas (Qwen2.5-VL and Qwen2-VL, left-padded batches),
and greedy generate of image_text_to_text on the onnx-community layout."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

pytest.importorskip("PIL")

from transmuter_jax import vision  # noqa: E402
from transmuter_jax.text.tokenizer import Tokenizer  # noqa: E402
from transmuter_jax.vision import qwen2vl  # noqa: E402
from transmuter_jax.vision.qwen2vl_pipeline import VisionEncoderError  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "qwen25vl-community"
REF = json.loads((FIXTURE / "qwen2vl.json").read_text())
ARRAYS = np.load(FIXTURE / "qwen2vl.npz")
SINGLE = [c for c in REF["generate"] if not c.get("batch")]
BATCH = [c for c in REF["generate"] if c.get("batch")]


@pytest.fixture(scope="module")
def processor():
    return qwen2vl.Qwen2VLProcessor(FIXTURE, Tokenizer.from_folder(FIXTURE))


@pytest.fixture(scope="module")
def pipe():
    return vision.image_text_to_text(FIXTURE, max_new_tokens=REF["max_new_tokens"])


def _with_images(conversation: list[dict], files: list[str]) -> list[dict]:
    """The reference's messages with the image parts carrying the fixture's image files."""
    files = iter(files)
    out = []
    for message in conversation:
        content = message["content"]
        if not isinstance(content, str):
            content = [
                dict(part, image=str(FIXTURE / next(files))) if part["type"] == "image" else part
                for part in content
            ]
        out.append(dict(message, content=content))
    return out


@pytest.mark.parametrize(
    "case", REF["pixels"], ids=lambda c: f"{c['file']}-{'-'.join(map(str, c['options'].values()))}"
)
def test_pixel_values_and_grid_equal_transformers(processor, case):
    out = processor.images([FIXTURE / case["file"]], **case["options"])
    assert out.image_grid_thw.tolist() == case["image_grid_thw"]
    np.testing.assert_array_equal(out.pixel_values, ARRAYS[case["pixel_values"]])


def test_a_batch_of_images_is_their_patches_in_order(processor):
    case = REF["pixel_batch"]
    out = processor.images([FIXTURE / f for f in case["files"]])
    assert out.image_grid_thw.tolist() == case["image_grid_thw"]
    np.testing.assert_array_equal(out.pixel_values, ARRAYS[case["pixel_values"]])
    assert out.tokens() == [t * h * w // 4 for t, h, w in case["image_grid_thw"]]


def test_smart_resize_keeps_the_pixels_in_bounds_and_refuses_a_thin_image():
    h, w = qwen2vl.smart_resize(240, 320, 28, 3136, 12544)
    assert (h % 28, w % 28) == (0, 0) and 3136 <= h * w <= 12544
    with pytest.raises(ValueError, match="aspect ratio"):
        qwen2vl.smart_resize(2, 500, 28, 3136, 12544)


@pytest.mark.parametrize("case", REF["prompts"], ids=lambda c: f"{len(c['input_ids'])}x")
def test_prompt_ids_and_positions_equal_transformers(processor, case):
    conversations = [
        _with_images(c, f) for c, f in zip(case["messages"], case["files"], strict=True)
    ]
    ids, images, positions = processor(conversations)
    assert ids == case["input_ids"]
    grids = [] if images is None else images.image_grid_thw.tolist()
    assert grids == case["image_grid_thw"]
    padded, deltas = qwen2vl.batch_rope_index(ids, grids, processor.rope)
    np.testing.assert_array_equal(padded, ARRAYS[case["position_ids"]])
    assert deltas.tolist() == case["rope_deltas"]
    width = padded.shape[2]  # each prompt's own positions are those of its tokens in the batch
    for i, row in enumerate(ids):
        np.testing.assert_array_equal(positions[i], padded[:, i, width - len(row) :])
    qwen2 = dataclasses.replace(processor.rope, model_type="qwen2_vl")
    padded, deltas = qwen2vl.batch_rope_index(ids, grids, qwen2)
    np.testing.assert_array_equal(padded, ARRAYS[case["qwen2_position_ids"]])
    assert deltas.tolist() == case["qwen2_rope_deltas"]


def test_image_count_mismatches_and_videos_are_refused(processor):
    text = processor.chat_text([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ValueError, match="1 <\\|image_pad\\|> tokens for 0 images"):
        processor.encode([text], [[]])
    with pytest.raises(ValueError, match="1 <\\|image_pad\\|> tokens for 2 images"):
        processor.encode([text], [[FIXTURE / "small.png", FIXTURE / "small.png"]])
    rope = processor.rope
    video = [1, rope.vision_start_token_id, rope.video_token_id, 2]
    with pytest.raises(ValueError, match="videos are not supported"):
        qwen2vl.rope_index(video, [], rope)
    with pytest.raises(ValueError, match="1 images for 0 image grids"):
        qwen2vl.rope_index([rope.vision_start_token_id, rope.image_token_id], [], rope)


def _conversations(case) -> list[list[dict]]:
    return [
        [{"role": "user", "content": [*({"type": "image", "image": str(FIXTURE / f)} for f in fs),
                                      {"type": "text", "text": q}]}]
        for fs, q in zip(case["files"], case["question"], strict=True)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [SINGLE[0], *(pytest.param(c, marks=pytest.mark.slow) for c in SINGLE[1:])],
    ids=lambda c: c["files"][0][0],
)
def test_tokens_equal_transformers(pipe, case):
    conversations = _conversations(case)
    ids, features = pipe.inputs(conversations)
    assert features.shape[0] == ids[0].count(REF["image_token_id"])
    out = pipe.generate(conversations, token_logprobs=True)
    assert [r.token_ids for r in out] == case["tokens"]
    assert len(out[0].logprobs) == len(case["tokens"][0])


@pytest.mark.parametrize(
    "case",
    [BATCH[0], *(pytest.param(c, marks=pytest.mark.slow) for c in BATCH[1:])],
    ids=lambda c: "+".join(str(len(f)) for f in c["files"]),
)
def test_left_padded_batch_equals_transformers(pipe, case):
    """Two conversations of other lengths in one batch: of one and two images, and of one
    image and none (text positions only)."""
    out = pipe.generate(_conversations(case))
    assert [r.token_ids for r in out] == case["tokens"]


def test_call_and_stream_give_the_text_of_generate(pipe):
    (one,) = _conversations(SINGLE[0])
    text = pipe(one)
    assert text == pipe.tokenizer.decode(SINGLE[0]["tokens"][0], skip_special_tokens=True)
    assert "".join(pipe.stream(one)) == text


def test_a_vision_encoder_of_other_inputs_is_refused_naming_the_file(tmp_path):
    """A layout whose vision encoder this engine cannot feed gets a clear error."""
    folder = tmp_path / "model"
    shutil.copytree(FIXTURE, folder)
    other = pathlib.Path(__file__).parent / "fixtures" / "smolvlm-community" / "onnx"
    shutil.copy(other / "vision_encoder.onnx", folder / "onnx" / "vision_encoder.onnx")
    with pytest.raises(VisionEncoderError, match=r"vision_encoder\.onnx.*pixel_attention_mask"):
        vision.image_text_to_text(folder)


def _range_over_the_grid(path: pathlib.Path) -> None:
    """A vision encoder whose output length is read from the values of grid_thw (as in an
    export that loops over the images): Range(0, max(grid_thw)) -> image_features."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("ReduceMax", ["grid_thw"], ["top"], keepdims=0),
        helper.make_node("Range", ["zero", "top", "one"], ["steps"]),
        helper.make_node("Cast", ["steps"], ["steps_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["steps_f", "axes"], ["column"]),
        helper.make_node("Expand", ["column", "shape"], ["image_features"]),
    ]
    graph = helper.make_graph(
        nodes,
        "range_over_the_grid",
        [
            helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["patches", 1176]),
            helper.make_tensor_value_info("grid_thw", TensorProto.INT64, ["images", 3]),
        ],
        [helper.make_tensor_value_info("image_features", TensorProto.FLOAT, ["tokens", 64])],
        initializer=[
            helper.make_tensor("zero", TensorProto.INT64, [], [0]),
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
            helper.make_tensor("shape", TensorProto.INT64, [2], [1, 64]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))


def test_a_vision_encoder_that_reads_shapes_from_the_grid_runs_as_onnxruntime(tmp_path):
    """Its output length comes from the values of grid_thw: the tracer runs that part on the
    host (docs/tracer.md), and the encoder equals onnxruntime for each grid."""
    import onnxruntime as ort

    import transmuter_jax as tj

    path = tmp_path / "vision_encoder.onnx"
    _range_over_the_grid(path)
    model = tj.load(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pixels = np.zeros((4, 1176), np.float32)
    for grid in ([[1, 2, 2]], [[1, 4, 6]], [[1, 2, 2], [1, 2, 8]]):
        inputs = {"pixel_values": pixels, "grid_thw": np.array(grid, np.int64)}
        ours = np.asarray(model(inputs)["image_features"])
        theirs = session.run(["image_features"], inputs)[0]
        assert ours.shape == theirs.shape == (max(max(g) for g in grid), 64)
        np.testing.assert_array_equal(ours, theirs)


def test_a_genai_folder_without_a_vision_section_is_refused_naming_the_key():
    genai = pathlib.Path(__file__).parent / "fixtures" / "qwen25vl-genai-fp32"
    with pytest.raises(ValueError, match=r"genai_config\.json.*no model\.vision\.filename"):
        vision.image_text_to_text(genai)


def test_a_vision_encoder_with_an_unknown_op_is_refused_naming_the_file(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    folder = tmp_path / "model"
    shutil.copytree(FIXTURE, folder)
    node = helper.make_node("PatchMagic", ["pixel_values", "grid_thw"], ["image_features"],
                            domain="example.custom")  # fmt: skip
    graph = helper.make_graph(
        [node],
        "unknown_op",
        [
            helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["patches", 1176]),
            helper.make_tensor_value_info("grid_thw", TensorProto.INT64, ["images", 3]),
        ],
        [helper.make_tensor_value_info("image_features", TensorProto.FLOAT, ["tokens", 64])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    onnx.save(
        helper.make_model(graph, opset_imports=opsets), str(folder / "onnx" / "vision_encoder.onnx")
    )
    with pytest.raises(VisionEncoderError, match=r"vision_encoder\.onnx.*PatchMagic"):
        vision.image_text_to_text(folder)


QWEN2 = pathlib.Path(__file__).parent / "fixtures" / "qwen2vl-community"
QWEN2_REF = json.loads((QWEN2 / "qwen2vl.json").read_text())


@pytest.mark.parametrize(
    "case",
    [QWEN2_REF["generate"][0], *(pytest.param(c, marks=pytest.mark.slow)
                                 for c in QWEN2_REF["generate"][1:])],
    ids=lambda c: "+".join(f[0] if len(f) == 1 else str(len(f)) for f in c["files"]),
)  # fmt: skip
def test_qwen2vl_tokens_equal_transformers(case):
    """Qwen2-VL (its own vision tower: layer norms, no windows) in the same layout."""
    pipe = vision.image_text_to_text(QWEN2, max_new_tokens=QWEN2_REF["max_new_tokens"])
    assert pipe.processor.rope.model_type == "qwen2_vl"
    out = pipe.generate(_conversations(case))
    assert [r.token_ids for r in out] == case["tokens"]
