"""Image to text with a VisionEncoderDecoder model (ViT encoder, GPT-2 decoder: captioning, OCR)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..onnx.model import load
from ..tasks import detect
from ..tasks.pipeline import OnToken, Pipeline, Request
from ..tasks.runner import Result
from ..text.tokenizer import Tokenizer
from .images import ImageInput
from .processing import image_processor


class ImageToText(Pipeline):
    """An image encoder and a text decoder with the image processor and tokenizer, from
    :func:`image_to_text`.

    The encoder runs once per image; generation then starts from decoder_start_token_id with the
    encoder's last_hidden_state given to every decoder step as encoder_hidden_states.

    Attributes:
        files: the files it was loaded from (folder, exporter family, encoder, decoder).
        processor: the image processor of ``preprocessor_config.json``.
        tokenizer: the tokenizer of ``tokenizer.json``.
        options: the default generation options (transformers' names).
    """

    TASK = detect.IMAGE_TO_TEXT

    def __init__(self, repo, *, dtype=None, file=None, mesh=None, devices=None, **options):
        super().__init__(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
        self.encoder = load(self.files.encoder)
        self.processor = image_processor(self.files.folder)
        self.tokenizer = Tokenizer.from_folder(self.files.folder)
        decoder, embed = self.load_decoder()
        names = {i.name for i in decoder.inputs}
        if "encoder_hidden_states" not in names:
            raise ValueError(f"the decoder {self.files.decoder!r} takes no encoder_hidden_states")
        self._mask = "encoder_attention_mask" in names
        given = ["encoder_hidden_states"] + (["encoder_attention_mask"] if self._mask else [])
        self.start(decoder, embed, given=given)

    def pixel_values(self, images: Sequence[ImageInput], **processor_options: Any) -> np.ndarray:
        """The encoder's input for ``images``: float32 [batch, 3, height, width], as
        transformers' image processor of this model makes it."""
        return self.processor(images, **processor_options)

    def _encode(self, images: Sequence[ImageInput]) -> dict[str, np.ndarray]:
        """The decoder inputs of the images' encoder outputs (each image encoded alone)."""
        if isinstance(images, str | bytes) or not isinstance(images, Sequence) or not images:
            raise TypeError("images is a non-empty list of images")
        pixels = self.pixel_values(images)
        states = []
        for row in pixels:
            out = self.encoder({"pixel_values": row[None]})
            states.append(np.asarray(out.get("last_hidden_state", next(iter(out.values())))))
        hidden = np.concatenate(states)  # [batch, patches + 1, hidden]
        given = {"encoder_hidden_states": hidden}
        if self._mask:
            given["encoder_attention_mask"] = np.ones(hidden.shape[:2], np.int64)
        return given

    def _start(self, batch: int, options: dict[str, Any]) -> list[int]:
        """[decoder_start_token_id], read from the context the run of ``batch`` images uses."""
        start = self.chosen(batch, options).decoder_start_token_id
        if start is None:
            raise ValueError(f"{self.files.folder!r} has no decoder_start_token_id")
        return [int(start)]

    def request(self, batch: Sequence[ImageInput], options: dict[str, Any]) -> Request:
        """The encoder outputs of each image and the decoder's start token."""
        given = self._encode(batch)
        return Request([self._start(len(batch), options)] * len(batch), options, given)

    def single(self, inputs: Any) -> bool:
        return not isinstance(inputs, list | tuple)

    def generate(
        self,
        images: Sequence[ImageInput],
        *,
        seed: int | None = None,
        on_token: OnToken | None = None,
        **options: Any,
    ) -> list[Result] | list[list[Result]]:
        """Generates the text of each image, in one batch.

        Args:
            images: the images (paths, bytes, PIL images, numpy uint8 HWC arrays).
            seed: the sampling seed of the first image (the next get seed + 1, ...); None: random.
            on_token: called after each step with the new token of each row (int32 [rows]).
            **options: generation options for this call (max_new_tokens, num_beams, ...).

        Returns:
            One :class:`Result` per image (text, token_ids without the decoder start token,
            logprobs, finish_reason); with num_return_sequences n > 1, a list of n per image.
        """
        return super().generate(images, seed=seed, on_token=on_token, **options)


def image_to_text(
    repo: str | os.PathLike,
    *,
    dtype: str | None = None,
    file: str | None = None,
    mesh: Any = None,
    devices: Sequence[Any] | None = None,
    **options: Any,
) -> ImageToText:
    """An image-to-text pipeline over a VisionEncoderDecoder model (captioning, OCR).

    Args:
        repo: a local folder or a hub id with ``encoder_model.onnx`` (taking pixel_values), a
            merged decoder and ``preprocessor_config.json``.
        dtype: which variant of the ONNX files (such as "fp32", "q4"); None: fp32.
        file: the decoder file to use, relative to the repo; overrides ``dtype``.
        mesh: a ``jax.sharding.Mesh`` with axes "model" and/or "data": the decoder's weights
            are split over it at load and its steps run over it (docs/distributed.md); the
            encoder stays on the default device.
        devices: without ``mesh``, the devices of a mesh that puts them all on "model".
        **options: default generation options, transformers' names.

    Returns:
        An :class:`ImageToText`: call it with an image or a list, or use ``generate``/``stream``.
    """
    return ImageToText(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
