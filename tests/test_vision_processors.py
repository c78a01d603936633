"""Image processors beyond ViT (DeiT, BEiT, TrOCR's ViT feature extractor, an untyped Swin
config) and image modes, against transformers' references written by
tests/fixtures/make_vision.py (vision-processors: no model, one folder per processor config)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from transmuter_jax import vision  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "vision-processors"
REF = json.loads((FIXTURE / "processors.json").read_text())
NPZ = np.load(FIXTURE / "processors.npz")
PROCESSORS = sorted({c["processor"] for c in REF["cases"]})


def test_the_fixture_covers_the_processors():
    assert {c["type"] for c in REF["cases"]} >= {
        "ViTImageProcessor",
        "DeiTImageProcessor",
        "BeitImageProcessor",
    }
    assert {c["file"] for c in REF["cases"]} >= {"grace_hopper.jpg", "rgba.png", "gray.png"}


@pytest.mark.parametrize("name", PROCESSORS)
def test_pixel_values_equal_transformers(name):
    processor = vision.image_processor(FIXTURE / name)
    for case in (c for c in REF["cases"] if c["processor"] == name):
        assert type(processor).__name__ == case["type"]
        got = processor([FIXTURE / case["file"]])[0]
        expected = NPZ[case["pixel_values"]]
        assert got.dtype == np.float32 and got.shape == expected.shape, case
        assert np.array_equal(got, expected), case  # bit for bit


def test_a_crop_larger_than_the_image_pads_with_zeros_as_transformers():
    processor = vision.image_processor(FIXTURE / "deit-pad")
    resized = processor.config["size"]
    crop = vision.processing.size_dict(processor.config["crop_size"])
    assert crop["height"] > resized["height"] and crop["width"] > resized["width"]
    got = processor([FIXTURE / "gradient.png"])[0]
    assert got.shape == (3, crop["height"], crop["width"])
    assert np.array_equal(got, NPZ["deit-pad/gradient.png"])


def test_options_override_the_config():
    processor = vision.image_processor(FIXTURE / "deit")
    got = processor([FIXTURE / "gradient.png"], do_center_crop=False)[0]
    assert got.shape[1:] == (processor.config["size"]["height"], processor.config["size"]["width"])
    with pytest.raises(TypeError, match="unknown DeiTImageProcessor options.*do_image_splitting"):
        processor([FIXTURE / "gradient.png"], do_image_splitting=True)
    with pytest.raises(TypeError, match="unknown ViTImageProcessor options.*crop_size"):
        vision.image_processor(FIXTURE / "trocr-vit")([FIXTURE / "gradient.png"], crop_size=8)


def test_an_unsupported_processor_type_is_named(tmp_path):
    config = {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 224}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'ConvNextImageProcessor': not implemented; implemented"):
        vision.image_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": 32}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "donut-swin"}))
    with pytest.raises(ValueError, match="no image processor type.*'donut-swin'"):
        vision.image_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        vision.image_processor(tmp_path)


def test_bad_sizes_are_refused(tmp_path):
    config = {"image_processor_type": "ViTImageProcessor", "size": {"shortest_edge": 224}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="size is .*shortest_edge"):
        vision.image_processor(tmp_path)([FIXTURE / "gradient.png"])


# --- image modes: grayscale and RGBA as transformers converts them ---------------------------


def _rgba_processor():
    return vision.ViTImageProcessor(
        {"image_processor_type": "ViTImageProcessor", **REF["rgba"]["settings"]}
    )


def test_rgba_as_an_array_or_an_image_drops_alpha_as_transformers_convert_rgb():
    """transformers' ViT/DeiT processors refuse an RGBA (or grayscale) image unless converted;
    do_convert_rgb=True (Pillow's convert("RGB"): alpha dropped) and the pipelines' load_image
    give the same pixels, and so does this library for the image and for its array."""
    rgba = REF["rgba"]
    assert all(rgba["vit_without_conversion"].values())  # transformers refuses them as they are
    image = Image.open(FIXTURE / rgba["file"])
    assert image.mode == "RGBA"
    expected = NPZ[rgba["do_convert_rgb"]]
    processor = _rgba_processor()
    assert np.array_equal(processor([image])[0], expected)
    assert np.array_equal(processor([np.asarray(image)])[0], expected)  # (H, W, 4) uint8


def test_grayscale_arrays_repeat_the_channel_as_the_image_does():
    processor = vision.image_processor(FIXTURE / "deit")
    gray = np.asarray(Image.open(FIXTURE / "gray.png"))
    assert gray.ndim == 2
    expected = NPZ["deit/gray.png"]
    assert np.array_equal(processor([gray])[0], expected)
    assert np.array_equal(processor([gray[..., None]])[0], expected)
    assert np.array_equal(processor([Image.open(FIXTURE / "gray.png")])[0], expected)


def test_a_fast_processor_type_is_read_as_the_pillow_one(tmp_path):
    config = json.loads((FIXTURE / "deit" / "preprocessor_config.json").read_text())
    config["image_processor_type"] = "DeiTImageProcessorFast"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    processor = vision.image_processor(tmp_path)
    assert isinstance(processor, vision.DeiTImageProcessor)
    got = processor([FIXTURE / "noise.jpg"])[0]
    assert np.array_equal(got, NPZ["deit/noise.jpg"])
