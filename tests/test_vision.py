"""Vision: image loading, the ViT image processor and image-to-text, against transformers'
references written by tests/fixtures/make_vision.py (vitgpt2-optimum)."""

from __future__ import annotations

import io
import json
import pathlib
import shutil

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from transmuter_jax import vision  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "vitgpt2-optimum"
REF = json.loads((FIXTURE / "reference.json").read_text())
NPZ = np.load(FIXTURE / "reference.npz")
IMAGES = [c["file"] for c in REF["images"]]


@pytest.fixture(scope="module")
def pipe():
    return vision.image_to_text(FIXTURE)


def _case(name):
    return next(c for c in REF["images"] if c["file"] == name)


# --- loading -------------------------------------------------------------------------------


def test_the_fixture_covers_the_image_modes():
    assert {"RGB", "L", "RGBA", "P"} <= {c["mode"] for c in REF["images"]}
    assert "grace_hopper.jpg" in IMAGES  # a real photo


@pytest.mark.parametrize("name", ["gradient.png", "gray.png", "rgba.png"])
def test_path_bytes_pil_and_array_load_alike(name):
    path = FIXTURE / name
    expected = np.asarray(vision.load_image(path))
    assert expected.ndim == 3 and expected.shape[-1] == 3
    assert np.array_equal(np.asarray(vision.load_image(str(path))), expected)
    assert np.array_equal(np.asarray(vision.load_image(path.read_bytes())), expected)
    assert np.array_equal(np.asarray(vision.load_image(Image.open(path))), expected)
    assert np.array_equal(np.asarray(vision.load_image(np.asarray(Image.open(path)))), expected)


def test_a_corrupt_file_is_refused(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes((FIXTURE / "gradient.png").read_bytes()[:20])
    with pytest.raises(vision.ImageError, match="bad.png"):
        vision.load_image(bad)
    with pytest.raises(vision.ImageError, match="not a readable image"):
        vision.load_image(b"not an image at all")
    with pytest.raises(vision.ImageError, match="no image file"):
        vision.load_image(tmp_path / "missing.png")


def test_an_empty_image_is_refused():
    with pytest.raises(vision.ImageError, match="no pixels"):
        vision.load_image(Image.new("RGB", (0, 0)))
    with pytest.raises(vision.ImageError, match="no pixels"):
        vision.load_image(np.zeros((0, 0, 3), np.uint8))
    assert issubclass(vision.ImageError, ValueError)


def test_bad_arrays_and_types_are_refused():
    with pytest.raises(vision.ImageError, match="uint8"):
        vision.load_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(vision.ImageError, match="shape"):
        vision.load_image(np.zeros((4, 4, 2), np.uint8))
    with pytest.raises(TypeError, match="not int"):
        vision.load_image(3)


# --- the image processor --------------------------------------------------------------------


@pytest.mark.parametrize("name", IMAGES)
def test_pixel_values_equal_transformers(pipe, name):
    expected = NPZ[_case(name)["pixel_values"]]
    got = pipe.pixel_values([FIXTURE / name])[0]
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert np.array_equal(got, expected)  # the same float32 operations: bit-equal


def test_pixel_values_under_other_filters_and_sizes_equal_transformers(pipe):
    cases = REF["pixel_cases"]
    assert {c["options"]["resample"] for c in cases} == {0, 1, 2, 3, 4, 5}
    for c in cases:
        got = pipe.pixel_values([FIXTURE / c["file"]], **c["options"])[0]
        expected = NPZ[c["pixel_values"]]
        assert got.shape == expected.shape, c
        assert np.array_equal(got, expected), c


def test_pixel_values_of_an_array_equal_transformers(pipe):
    array = np.asarray(Image.open(FIXTURE / REF["array"]["file"]).convert("RGB"))
    assert np.array_equal(pipe.pixel_values([array])[0], NPZ[REF["array"]["pixel_values"]])


def test_unknown_processor_options_are_refused(pipe):
    with pytest.raises(TypeError, match="do_image_splitting"):
        pipe.pixel_values([FIXTURE / IMAGES[0]], do_image_splitting=False)
    with pytest.raises(ValueError, match="resample"):
        pipe.pixel_values([FIXTURE / IMAGES[0]], resample=9)


# --- generation -----------------------------------------------------------------------------


def test_greedy_tokens_text_and_logprobs_equal_transformers(pipe):
    n = REF["max_new_tokens"]
    for name in IMAGES:
        c = _case(name)
        result = pipe.generate([FIXTURE / name], max_new_tokens=n, token_logprobs=True)[0]
        assert result.token_ids == c["tokens"], name
        assert result.token_ids[:1] != [REF["decoder_start_token_id"]] or not c["tokens"]
        assert result.text == c["text"], name
        assert result.finish_reason == ("length" if len(c["tokens"]) == n else "eos")
        np.testing.assert_allclose(result.logprobs, c["logprobs"], atol=2e-4, rtol=0)


def test_a_batch_equals_transformers_batch(pipe):
    batch = REF["batch"]
    results = pipe.generate(
        [FIXTURE / f for f in batch["files"]], max_new_tokens=REF["max_new_tokens"]
    )
    assert [r.token_ids for r in results] == batch["tokens"]
    texts = pipe([FIXTURE / f for f in batch["files"]], max_new_tokens=REF["max_new_tokens"])
    assert texts == [r.text for r in results]


def test_call_and_stream_give_the_text(pipe):
    name = "grace_hopper.jpg"
    n = REF["max_new_tokens"]
    assert pipe(FIXTURE / name, max_new_tokens=n) == _case(name)["text"]
    assert pipe(Image.open(FIXTURE / name), max_new_tokens=n) == _case(name)["text"]
    pieces = list(
        pipe.stream(io.BytesIO((FIXTURE / name).read_bytes()).getvalue(), max_new_tokens=n)
    )
    assert len(pieces) > 1 and "".join(pieces) == _case(name)["text"]


def test_a_text_only_model_is_refused():
    with pytest.raises(ValueError, match="image encoder"):
        vision.image_to_text(FIXTURE.parent / "gpt2-optimum")


def test_the_onnx_community_layout_runs_the_same(tmp_path):
    (tmp_path / "onnx").mkdir()
    for path in FIXTURE.iterdir():
        # copies: links out of a model's folder are refused (untrusted input)
        shutil.copy(path, tmp_path / ("onnx" if path.suffix == ".onnx" else "") / path.name)
    pipe = vision.image_to_text(tmp_path)
    assert pipe.files.family == "transformers.js" and pipe.files.encoder.endswith(
        "onnx/encoder_model.onnx"
    )
    c = REF["images"][0]
    assert np.array_equal(pipe.pixel_values([FIXTURE / c["file"]])[0], NPZ[c["pixel_values"]])
    assert pipe.generate([FIXTURE / c["file"]], max_new_tokens=4)[0].token_ids == c["tokens"][:4]


def test_beam_search_equals_transformers(pipe):
    beam = REF["beam"]
    for c in beam["cases"]:
        result = pipe.generate(
            [FIXTURE / c["file"]],
            num_beams=beam["num_beams"],
            max_new_tokens=beam["max_new_tokens"],
        )[0]
        assert result.token_ids == c["tokens"], c["file"]
    greedy = _case(beam["cases"][0]["file"])["tokens"][: beam["max_new_tokens"]]
    assert beam["cases"][0]["tokens"] != greedy  # the search changes the answer
