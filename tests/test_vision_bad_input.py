"""Bad input to the vision tasks: an image for a text-only model, a model of another task, more
image tokens than images, a corrupt file and an image with no pixels, through the pipelines;
grayscale and RGBA arrays converted as the images themselves (transformers' pipelines: Pillow's
convert("RGB"), alpha dropped)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from transmuter_jax import text, vision  # noqa: E402
from transmuter_jax.text.tokenizer import Tokenizer  # noqa: E402
from transmuter_jax.vision import idefics3  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
VITGPT2 = FIXTURES / "vitgpt2-optimum"
SMOLVLM = FIXTURES / "smolvlm-community"


@pytest.fixture(scope="module")
def caption():
    return vision.image_to_text(VITGPT2, max_new_tokens=2)


@pytest.fixture(scope="module")
def vlm():
    return vision.image_text_to_text(SMOLVLM, max_new_tokens=2)


def _chat(image, question="What is it?"):
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": question}]}]  # fmt: skip


@pytest.fixture
def corrupt(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes((VITGPT2 / "gradient.png").read_bytes()[:30])
    return path


# --- a model of another task ----------------------------------------------------------------


def test_an_image_for_the_text_decoder_of_a_vision_model_names_the_vision_task():
    pipe = text.generation(SMOLVLM)  # its text decoder alone runs text prompts
    with pytest.raises(ValueError, match="only the text decoder.*vision.image_text_to_text"):
        pipe.generate([_chat(str(SMOLVLM / "wide.png"))])


def test_an_image_to_text_model_given_to_the_text_tasks():
    for task in (text.generation, text.text_to_text):
        with pytest.raises(text.WrongTask, match="image-to-text model.*vision.image_to_text") as e:
            task(VITGPT2)
        assert e.value.task == "image_to_text"


def test_each_vision_task_names_the_other():
    with pytest.raises(ValueError, match="no vision encoder.*use vision.image_to_text"):
        vision.image_text_to_text(VITGPT2)
    with pytest.raises(ValueError, match="no image encoder.*use vision.image_text_to_text"):
        vision.image_to_text(SMOLVLM)
    with pytest.raises(ValueError, match="takes no pixel_values"):
        vision.image_to_text(FIXTURES / "marian-optimum")  # a text encoder


# --- images ---------------------------------------------------------------------------------


def test_a_corrupt_file_is_named_by_both_pipelines(caption, vlm, corrupt):
    with pytest.raises(vision.ImageError, match="cut.png.* not a readable image file"):
        caption(corrupt)
    with pytest.raises(vision.ImageError, match="cut.png.* not a readable image file"):
        vlm(str(corrupt), "What is it?")
    with pytest.raises(vision.ImageError, match="bytes given are not a readable image"):
        caption(corrupt.read_bytes())


def test_an_image_without_pixels_is_refused_by_both_pipelines(caption, vlm):
    for empty in (Image.new("RGB", (0, 0)), Image.new("L", (5, 0)), np.zeros((0, 0, 3), np.uint8)):
        with pytest.raises(vision.ImageError, match="no pixels"):
            caption(empty)
        with pytest.raises(vision.ImageError, match="no pixels"):
            vlm.generate([_chat(empty)])


def test_an_empty_or_wrong_image_list(caption):
    with pytest.raises(TypeError, match="non-empty list of images"):
        caption.generate([])
    with pytest.raises(TypeError, match="not dict"):
        caption([{"role": "user", "content": "a chat message is not an image"}])
    with pytest.raises(vision.ImageError, match="no image file 'a photo of a cat'"):
        caption("a photo of a cat")


def test_more_image_tokens_than_images(vlm):
    with pytest.raises(ValueError, match="3 <image> tokens for 1 images"):
        vlm.generate([_chat(str(SMOLVLM / "tall.png"), "<image> and <image>?")])


# --- grayscale and RGBA, as arrays and as images ----------------------------------------------


def test_idefics3_reads_rgba_and_grayscale_arrays_as_their_images():
    """transformers' Idefics3ImageProcessor given an RGBA image itself (array or PIL) blends it
    over white; its pipelines load images with convert("RGB"), which drops alpha, and so does
    this library for an image and for its array: both equal the reference of the file."""
    folder = FIXTURES / "smolvlm-processor"
    ref = json.loads((folder / "reference.json").read_text())
    npz = np.load(folder / "reference.npz")
    processor = idefics3.Idefics3Processor(folder, Tokenizer.from_folder(folder))
    for name in ("rgba.png", "gray.png"):
        case = next(c for c in ref["cases"] if c["files"] == [[name]] and c["do_image_splitting"])
        expected = npz[case["pixel_values"]]
        pil = Image.open(folder / name)
        assert pil.mode in ("RGBA", "L")
        for image in (pil, np.asarray(pil)):
            got = processor.images([[image]], do_image_splitting=True).pixel_values
            assert np.array_equal(got, expected), (name, type(image).__name__)
