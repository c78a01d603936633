"""Image processors: images to the pixel values a vision encoder takes, as transformers makes them.

The steps and their order are those of transformers' image processors: resize with Pillow
(``Image.resize`` with the configured filter and no reducing gap), rescale (in float64, then
float32), normalize (in float32). Their settings come from ``preprocessor_config.json`` with
transformers' names, and a call may override them by the same names.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import hub
from .images import ImageInput, load_image

RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
"""Pillow's filters by the numbers transformers' ``resample`` uses (PILImageResampling)."""


def resize(image: Any, height: int, width: int, resample: int) -> np.ndarray:
    """``image`` (RGB PIL) resized by Pillow to height x width: uint8 [height, width, 3]."""
    if resample not in RESAMPLE:
        raise ValueError(
            f"resample must be one of {sorted(RESAMPLE)} (Pillow's filters), not {resample!r}"
        )
    if height < 1 or width < 1:
        raise ValueError(f"cannot resize to {height}x{width}")
    return np.asarray(image.resize((int(width), int(height)), resample=resample, reducing_gap=None))


def rescale(pixels: np.ndarray, factor: float) -> np.ndarray:
    """``pixels`` times ``factor``: in float64, then rounded to float32 (as transformers does)."""
    return (pixels.astype(np.float64) * factor).astype(np.float32)


def normalize(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(pixels - mean) / std per channel (the last axis), in float32."""
    pixels = pixels.astype(np.float32, copy=False)
    channels = pixels.shape[-1]
    mean = np.asarray(_per_channel(mean, channels, "image_mean"), np.float32)
    std = np.asarray(_per_channel(std, channels, "image_std"), np.float32)
    return (pixels - mean) / std


def _per_channel(value: float | Sequence[float], channels: int, name: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * channels
    if len(value) != channels:
        raise ValueError(f"{name} has {len(value)} values for {channels} channels")
    return [float(v) for v in value]


def size_dict(value: Any, name: str = "size") -> dict[str, int]:
    """``{"height", "width"}`` of a size as transformers' ``get_size_dict`` reads a fixed size:
    an int is a square, a pair is (height, width), a dict names both."""
    if isinstance(value, bool):
        raise ValueError(f"{name} is {{'height': H, 'width': W}} or an int, not {value!r}")
    if isinstance(value, int):
        return {"height": value, "width": value}
    if isinstance(value, list | tuple) and len(value) == 2:
        return {"height": int(value[0]), "width": int(value[1])}
    if isinstance(value, Mapping) and set(value) == {"height", "width"}:
        return {"height": int(value["height"]), "width": int(value["width"])}
    raise ValueError(f"{name} is {{'height': H, 'width': W}} or an int, not {value!r}")


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre ``height`` x ``width`` of ``pixels`` [H, W, C], as transformers'
    ``center_crop``: the top-left corner at ((H - height) // 2, (W - width) // 2); an image
    smaller than the crop is first padded with zeros, centred (the extra pixel after)."""
    h, w = pixels.shape[:2]
    if height < 1 or width < 1:
        raise ValueError(f"cannot crop to {height}x{width}")
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)  # ceil
    padded = np.zeros((new_h, new_w) + pixels.shape[2:], pixels.dtype)
    padded[pad_top : pad_top + h, pad_left : pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]


MAX_SIDE = 8192
"""The largest height or width a processor resizes or crops to."""


def check_settings(s: Mapping[str, Any], processor: str) -> None:
    """Refuses, by name, settings that are zero, huge or degenerate: sizes outside
    1..:data:`MAX_SIDE`, a non-finite rescale factor, non-finite means, zero or non-finite stds.

    Raises:
        ValueError: naming the setting and its value.
    """

    def bad(name: str, value: Any, rule: str) -> ValueError:
        return ValueError(f"{processor}: {name} is {value!r}; {rule}")

    for name in ("size", "crop_size"):
        if name not in s or (name == "crop_size" and not s.get("do_center_crop")):
            continue
        for side, value in size_dict(s[name], name).items():
            if not 1 <= value <= MAX_SIDE:
                raise bad(f"{name}[{side!r}]", value, f"it must be from 1 to {MAX_SIDE}")
    check_values(s, processor)


def whole(value: Any, name: str, least: int, most: int, processor: str) -> int:
    """``value`` as an int when it is a whole number from ``least`` to ``most``.

    Raises:
        ValueError: naming the processor, the setting and its value.
    """
    number = isinstance(value, int | float | np.number) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value != int(value):
        raise ValueError(f"{processor}: {name} is {value!r}; it must be a whole number")
    if not least <= int(value) <= most:
        raise ValueError(f"{processor}: {name} is {value!r}; it must be from {least:,} to {most:,}")
    return int(value)


def check_values(s: Mapping[str, Any], processor: str) -> None:
    """Refuses, by name, a non-finite rescale factor or mean, a zero or non-finite std, and an
    unknown resampling filter (the settings every image processor shares).

    Raises:
        ValueError: naming the setting and its value.
    """

    def bad(name: str, value: Any, rule: str) -> ValueError:
        return ValueError(f"{processor}: {name} is {value!r}; {rule}")

    for name in ("image_mean", "image_std", "rescale_factor"):
        value = s.get(name)
        values = value if isinstance(value, list | tuple) else [value]
        if not values or not all(
            isinstance(v, int | float | np.number) and not isinstance(v, bool) for v in values
        ):
            raise bad(name, value, "it must be a number or a list of numbers")
        if not all(math.isfinite(v) for v in values):
            raise bad(name, value, "it must be finite")
        if name == "image_std" and any(v == 0 for v in values):
            raise bad(name, value, "a standard deviation of 0 divides by zero")
    if s.get("resample") not in RESAMPLE:
        raise bad("resample", s.get("resample"), f"it must be one of {sorted(RESAMPLE)}")


class ViTImageProcessor:
    """transformers' ``ViTImageProcessor``: resize to a fixed size, rescale, normalize.

    Attributes:
        config: the settings (transformers' names): do_resize, size ({"height", "width"}),
            resample, do_rescale, rescale_factor, do_normalize, image_mean, image_std.
    """

    NAME = "ViTImageProcessor"
    DEFAULTS: Mapping[str, Any] = {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }

    def __init__(self, config: Mapping[str, Any]):
        self.config = {k: config.get(k, v) for k, v in self.DEFAULTS.items()}
        for k in ("image_mean", "image_std", "size", "crop_size"):
            if k in self.config and self.config[k] is None:
                self.config[k] = self.DEFAULTS[k]
        check_settings(self.config, self.NAME)

    def settings(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The settings with ``options`` (transformers' names) in place of the configured ones."""
        unknown = sorted(set(options) - set(self.DEFAULTS))
        if unknown:
            raise TypeError(
                f"unknown {self.NAME} options {unknown}; known: {sorted(self.DEFAULTS)}"
            )
        merged = {**self.config, **{k: v for k, v in options.items() if v is not None}}
        check_settings(merged, self.NAME)
        return merged

    def _pixels(self, image: ImageInput, s: Mapping[str, Any]) -> np.ndarray:
        """One image's float32 [height, width, 3] after every step."""
        rgb = load_image(image)
        if s["do_resize"]:
            size = size_dict(s["size"])
            pixels = resize(rgb, size["height"], size["width"], int(s["resample"]))
        else:
            pixels = np.asarray(rgb)
        if s.get("do_center_crop"):
            crop = size_dict(s["crop_size"], "crop_size")
            pixels = center_crop(pixels, crop["height"], crop["width"])
        if s["do_rescale"]:
            pixels = rescale(pixels, s["rescale_factor"])
        if s["do_normalize"]:
            pixels = normalize(pixels, s["image_mean"], s["image_std"])
        return np.asarray(pixels, np.float32)

    def __call__(self, images: Sequence[ImageInput], **options: Any) -> np.ndarray:
        """The pixel values of ``images``: float32 [batch, 3, height, width].

        Args:
            images: the images (paths, bytes, PIL images, numpy arrays; see :func:`load_image`).
            **options: settings for this call, by transformers' names (size, resample, ...).
        """
        s = self.settings(options)
        out = [self._pixels(image, s).transpose(2, 0, 1) for image in images]  # HWC -> CHW
        shapes = {p.shape for p in out}
        if len(shapes) > 1:
            raise ValueError(
                f"the images have different sizes {sorted(shapes)}: give do_resize=True"
            )
        return np.stack(out)


class DeiTImageProcessor(ViTImageProcessor):
    """transformers' ``DeiTImageProcessor``: resize to ``size``, centre-crop to ``crop_size``,
    rescale, normalize (the defaults: 256 x 256 bicubic, then 224 x 224)."""

    NAME = "DeiTImageProcessor"
    DEFAULTS: Mapping[str, Any] = {
        **ViTImageProcessor.DEFAULTS,
        "size": {"height": 256, "width": 256},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
    }


class BeitImageProcessor(DeiTImageProcessor):
    """transformers' ``BeitImageProcessor`` on images: the steps and defaults of DeiT's
    (``do_reduce_labels`` concerns segmentation maps only: images are never reduced)."""

    NAME = "BeitImageProcessor"
    DEFAULTS: Mapping[str, Any] = {**DeiTImageProcessor.DEFAULTS, "do_reduce_labels": False}


PROCESSORS: Mapping[str, type[ViTImageProcessor]] = {
    "ViTImageProcessor": ViTImageProcessor,
    "ViTFeatureExtractor": ViTImageProcessor,
    "DeiTImageProcessor": DeiTImageProcessor,
    "DeiTFeatureExtractor": DeiTImageProcessor,
    "BeitImageProcessor": BeitImageProcessor,
    "BeitFeatureExtractor": BeitImageProcessor,
}
"""The implemented image processors by the type names of ``preprocessor_config.json``."""

BY_MODEL_TYPE = {
    "vit": "ViTImageProcessor",
    "swin": "ViTImageProcessor",
    "swinv2": "ViTImageProcessor",
    "deit": "DeiTImageProcessor",
    "beit": "BeitImageProcessor",
}
"""The image processor transformers' ``AutoImageProcessor`` picks for config.json's model_type
when ``preprocessor_config.json`` names none."""


def _model_type(repo: str | os.PathLike) -> str:
    """The model_type of config.json ("" without one)."""
    return str(hub.read_json(repo, "config.json").get("model_type") or "")


def image_processor(repo: str | os.PathLike) -> ViTImageProcessor:
    """The image processor of ``preprocessor_config.json`` in ``repo``: its
    ``image_processor_type`` (or ``feature_extractor_type``; a ``…Fast`` type as the Pillow one),
    else the one transformers' ``AutoImageProcessor`` picks for config.json's model_type.

    Raises:
        ValueError: the repo has no preprocessor_config.json, or one of a processor this
            library does not implement.
    """
    config = hub.read_json(repo, "preprocessor_config.json")
    if not config:
        raise ValueError(f"{os.fspath(repo)!r} has no preprocessor_config.json")
    kind = config.get("image_processor_type") or config.get("feature_extractor_type") or ""
    kind = kind.removesuffix("Fast")
    named = f"image processor {kind!r}"
    if not kind:
        model_type = _model_type(repo)
        kind = BY_MODEL_TYPE.get(model_type, "")
        named = f"no image processor type, and config.json's model_type is {model_type!r}"
    if kind in PROCESSORS:
        return PROCESSORS[kind](config)
    implemented = sorted({c.NAME for c in PROCESSORS.values()})
    raise ValueError(
        f"{os.fspath(repo)!r}: {named}: not implemented; implemented: {', '.join(implemented)}"
        f" (and by model_type: {', '.join(sorted(BY_MODEL_TYPE))})"
    )
