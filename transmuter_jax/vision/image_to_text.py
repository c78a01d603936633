"""Image to text with a VisionEncoderDecoder model (ViT encoder, GPT-2 decoder: captioning, OCR)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..onnx.model import load
from ..tasks import detect
from ..tasks.runner import Result, Runner, load_decoder, mesh_of, resolve, texts_of
from ..text.tokenizer import Tokenizer
from .images import ImageInput
from .processing import image_processor


class ImageToText:
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

    def __init__(self, repo, *, dtype=None, file=None, mesh=None, devices=None, **options):
        self.files = resolve(repo, dtype, file)
        mesh = mesh_of(mesh, devices)
        detect.check(detect.IMAGE_TO_TEXT, repo, self.files)
        self.encoder = load(self.files.encoder)
        self.processor = image_processor(self.files.folder)
        self.tokenizer = Tokenizer.from_folder(self.files.folder)
        decoder, embed = load_decoder(self.files, mesh)
        names = {i.name for i in decoder.inputs}
        if "encoder_hidden_states" not in names:
            raise ValueError(f"the decoder {self.files.decoder!r} takes no encoder_hidden_states")
        self._mask = "encoder_attention_mask" in names
        given = ["encoder_hidden_states"] + (["encoder_attention_mask"] if self._mask else [])
        self._runner = Runner(
            self.files.folder, decoder, embed=embed, given=given, options=options,
            tokenizer=self.tokenizer, mesh=mesh,
        )  # fmt: skip
        self.options = dict(options)

    @property
    def defaults(self) -> dict[str, Any]:
        """The generation options a call starts from: transformers' defaults,
        generation_config.json, then the pipeline's options."""
        return dict(self._runner.defaults)

    @property
    def compiled_shapes(self) -> int:
        """How many decoder step shapes have been compiled so far."""
        return self._runner.compiled_shapes

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
        start = self._runner.context(batch, options).options.decoder_start_token_id
        if start is None:
            raise ValueError(f"{self.files.folder!r} has no decoder_start_token_id")
        return [int(start)]

    def generate(
        self, images: Sequence[ImageInput], *, seed: int | None = None, **options: Any
    ) -> list[Result] | list[list[Result]]:
        """Generates the text of each image, in one batch.

        Args:
            images: the images (paths, bytes, PIL images, numpy uint8 HWC arrays).
            seed: the sampling seed of the first image (the next get seed + 1, ...); None: random.
            **options: generation options for this call (max_new_tokens, num_beams, ...).

        Returns:
            One :class:`Result` per image (text, token_ids without the decoder start token,
            logprobs, finish_reason); with num_return_sequences n > 1, a list of n per image.
        """
        given = self._encode(images)
        prompt = self._start(len(images), options)
        return self._runner.run(
            self.tokenizer, [prompt] * len(images), options, seed=seed, inputs=given
        )

    def __call__(
        self,
        images: ImageInput | Sequence[ImageInput],
        *,
        seed: int | None = None,
        **options: Any,
    ) -> str | list[str] | list[list[str]]:
        """The text of an image, or of each image of a list (a batch)."""
        single = not isinstance(images, list | tuple)
        out = texts_of(self.generate([images] if single else images, seed=seed, **options))
        return out[0] if single else out

    def stream(
        self, image: ImageInput, *, seed: int | None = None, **options: Any
    ) -> Iterator[str]:
        """Yields the text of one image in pieces as it is generated; they join to the text the
        same call without streaming gives (with beam search, as one piece at the end)."""
        given = self._encode([image])
        prompt = self._start(1, options)
        return self._runner.stream(self.tokenizer, prompt, options, seed=seed, inputs=given)


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
