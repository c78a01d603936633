"""Image processors: images to the pixel values a vision encoder takes, as transformers makes them.

The steps and their order are those of transformers' image processors: resize with Pillow
(``Image.resize`` with the configured filter and no reducing gap), rescale (in float64, then
float32), normalize (in float32). Their settings come from ``preprocessor_config.json`` with
transformers' names, and a call may override them by the same names.
"""

from __future__ import annotations

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


class ViTImageProcessor:
    """transformers' ``ViTImageProcessor``: resize to a fixed size, rescale, normalize.

    Attributes:
        config: the settings (transformers' names): do_resize, size ({"height", "width"}),
            resample, do_rescale, rescale_factor, do_normalize, image_mean, image_std.
    """

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
        for k in ("image_mean", "image_std"):
            if self.config[k] is None:
                self.config[k] = self.DEFAULTS[k]

    def settings(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The settings with ``options`` (transformers' names) in place of the configured ones."""
        unknown = sorted(set(options) - set(self.DEFAULTS))
        if unknown:
            raise TypeError(
                f"unknown image processor options {unknown}; known: {sorted(self.DEFAULTS)}"
            )
        return {**self.config, **{k: v for k, v in options.items() if v is not None}}

    def __call__(self, images: Sequence[ImageInput], **options: Any) -> np.ndarray:
        """The pixel values of ``images``: float32 [batch, 3, height, width].

        Args:
            images: the images (paths, bytes, PIL images, numpy arrays; see :func:`load_image`).
            **options: settings for this call, by transformers' names (size, resample, ...).
        """
        s = self.settings(options)
        out = []
        for image in images:
            rgb = load_image(image)
            if s["do_resize"]:
                size = s["size"]
                if not isinstance(size, Mapping) or set(size) != {"height", "width"}:
                    raise ValueError(f"size is {{'height': H, 'width': W}}, not {size!r}")
                pixels = resize(rgb, size["height"], size["width"], int(s["resample"]))
            else:
                pixels = np.asarray(rgb)
            if s["do_rescale"]:
                pixels = rescale(pixels, s["rescale_factor"])
            if s["do_normalize"]:
                pixels = normalize(pixels, s["image_mean"], s["image_std"])
            out.append(np.asarray(pixels, np.float32).transpose(2, 0, 1))  # HWC -> CHW
        shapes = {p.shape for p in out}
        if len(shapes) > 1:
            raise ValueError(
                f"the images have different sizes {sorted(shapes)}: give do_resize=True"
            )
        return np.stack(out)


def image_processor(repo: str | os.PathLike) -> ViTImageProcessor:
    """The image processor of ``preprocessor_config.json`` in ``repo``.

    Raises:
        ValueError: the repo has no preprocessor_config.json, or one of a processor this
            library does not implement.
    """
    config = hub.read_json(repo, "preprocessor_config.json")
    if not config:
        raise ValueError(f"{os.fspath(repo)!r} has no preprocessor_config.json")
    kind = config.get("image_processor_type") or config.get("feature_extractor_type") or ""
    kind = kind.removesuffix("Fast")
    if kind in ("ViTImageProcessor", "ViTFeatureExtractor"):
        return ViTImageProcessor(config)
    raise ValueError(
        f"{os.fspath(repo)!r}: image processor {kind or '(none named)'!r} is not implemented; "
        "implemented: ViTImageProcessor"
    )
