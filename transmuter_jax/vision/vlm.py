"""Which image-and-text-to-text pipeline a model takes: Qwen2-VL's, else SmolVLM / Idefics3's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .. import hub
from ..tasks.runner import resolve
from .image_text_to_text import QWEN2VL_TYPES, ImageTextToText
from .qwen2vl_pipeline import Qwen2VLImageTextToText


def image_text_to_text(
    repo: str | os.PathLike,
    *,
    dtype: str | None = None,
    file: str | None = None,
    mesh: Any = None,
    devices: Sequence[Any] | None = None,
    **options: Any,
) -> ImageTextToText:
    """An image-and-text-to-text pipeline over a SmolVLM / Idefics3 or Qwen2-VL / Qwen2.5-VL model
    (onnx-community layout: ``onnx/vision_encoder.onnx``, ``onnx/embed_tokens.onnx``,
    ``onnx/decoder_model_merged.onnx``; for Qwen2.5-VL also the onnxruntime-genai layout, whose
    genai_config.json names the vision, embedding and decoder graphs).

    Args:
        repo: a local folder or a hub id.
        dtype: which variant of the ONNX files (such as "fp32", "q4"); None: fp32.
        file: the decoder file to use, relative to the repo; overrides ``dtype``.
        mesh: a ``jax.sharding.Mesh`` with axes "model" and/or "data": the decoder's weights
            are split over it at load and its steps run over it (docs/distributed.md); the
            encoder stays on the default device.
        devices: without ``mesh``, the devices of a mesh that puts them all on "model".
        **options: default generation options, transformers' names.

    Returns:
        An :class:`ImageTextToText`: call it with messages or ``(image, question)``, or use
        ``generate``/``stream``.
    """
    files = resolve(repo, dtype, file)
    if hub.read_json(files.folder, "config.json").get("model_type") in QWEN2VL_TYPES:
        pipeline = Qwen2VLImageTextToText
    else:
        pipeline = ImageTextToText
    return pipeline(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
