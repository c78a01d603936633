"""Image and text to text with Qwen2-VL / Qwen2.5-VL in the onnx-community and
onnxruntime-genai layouts."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import hub
from ..generation.steps import embed_inputs
from ..onnx.errors import DynamicShapeError, GraphError, ModelFileError, UnsupportedOpError
from ..onnx.model import load
from .image_text_to_text import ImageTextToText, Messages, community_vision_encoder
from .qwen2vl import Qwen2VLProcessor

GRID_INPUTS = ("grid_thw", "image_grid_thw")  # transformers.js's name, and transformers'


class VisionEncoderError(ValueError):
    """A vision encoder this engine cannot run: the message names the file and why."""


class Qwen2VLImageTextToText(ImageTextToText):
    """A Qwen2-VL / Qwen2.5-VL vision encoder, the token embeddings and a decoder of
    inputs_embeds with 3-axis positions, with the processor, from ``image_text_to_text``.

    The vision encoder takes the patches of all the images of a call (``pixel_values``
    [patches, C*T*P*P]) and their grids (``grid_thw`` [images, 3]) and gives one feature per
    merged token (``image_features`` [tokens, hidden]). The prompt's embeddings are embed_tokens
    of its ids with the ``<|image_pad|>`` positions replaced, in order, by the features; the
    positions of the prompt are transformers' ``get_rope_index``, and generation continues them
    with the rope delta. In the onnxruntime-genai layout, genai_config.json's ``model.vision``,
    ``model.embedding`` and ``model.decoder`` sections name the graphs; its embedding graph takes
    the image features and merges them itself.

    Attributes:
        files: the files of the decoder and the embeddings (folder, family, decoder, embed).
        genai: whether the folder is in the onnxruntime-genai layout.
        vision_encoder: the path of the vision encoder.
        grid_input: the name of the vision graph's grid input that genai_config.json gives
            (None: grid_thw or image_grid_thw, whichever the graph takes).
        processor: the chat and image processor (:class:`~.qwen2vl.Qwen2VLProcessor`).
        tokenizer: the tokenizer of ``tokenizer.json``.
        image_token_id: the id of ``<|image_pad|>``.
        options: the default generation options (transformers' names).
    """

    def load_vision(self, repo: Any) -> tuple[Any, Any]:
        """Loads Qwen2-VL's processor and vision encoder (genai or onnx-community layout);
        returns the decoder, of 3-axis positions, and its embeddings."""
        self.genai = self.files.family == "genai"
        if self.genai:
            self.vision_encoder, self.grid_input = genai_vision(self.files)
        else:
            self.vision_encoder = community_vision_encoder(repo, self.files)
            self.grid_input = None
        self.processor = Qwen2VLProcessor(self.files.folder, self.tokenizer)
        self.image_token_id = self.processor.rope.image_token_id
        self.encoder = load_vision_encoder(self.vision_encoder, self.grid_input)
        decoder, embed = self.load_decoder()
        if self.genai:
            check_genai_embedding(self.files, embed)
        position = next((i for i in decoder.inputs if i.name == "position_ids"), None)
        if position is None or position.shape is None or len(position.shape) != 3:
            shape = None if position is None else position.shape
            raise ValueError(
                f"the decoder {self.files.decoder!r} takes position_ids of shape {shape}, not the "
                "3-axis positions [3, batch, sequence] of Qwen2-VL"
            )
        return decoder, embed

    def inputs(
        self, conversations: Sequence[Messages], **processor_options: Any
    ) -> tuple[list[list[int]], np.ndarray | None]:
        """The prompt ids of each conversation and the image features of all their image
        tokens, in order ([tokens, hidden]; None without images)."""
        ids, given = self.prepare(conversations, processor_options)
        return ids, given.get("image_features")

    def prepare(
        self, conversations: Sequence[Messages], processing: Mapping[str, Any]
    ) -> tuple[list[list[int]], dict[str, Any]]:
        """The prompt ids and what generate takes beside them: the image features and the
        positions of each prompt."""
        if isinstance(conversations, str) or not conversations:
            raise TypeError("conversations is a non-empty list of chat message lists")
        ids, images, positions = self.processor(conversations, **processing)
        given: dict[str, Any] = {"position_ids": positions}
        if images is None:
            return ids, given
        features = run_vision_encoder(
            self.encoder, self.vision_encoder, images.pixel_values, images.image_grid_thw
        )
        tokens = sum(row.count(self.image_token_id) for row in ids)
        if tokens != features.shape[0]:
            raise ValueError(
                f"the prompts have {tokens} image tokens for {features.shape[0]} image features "
                f"of {self.vision_encoder!r}"
            )
        given["image_features"] = features
        return ids, given

    def _split(self, options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The generation options and the image processor options of ``options``."""
        known = self.processor.images.OPTIONS
        processing = {k: v for k, v in options.items() if k in known}
        return {k: v for k, v in options.items() if k not in known}, processing


def load_vision_encoder(path: str, grid: str | None = None):
    """The Model of a Qwen2-VL vision encoder; ``grid``: the name of its grid input (None:
    grid_thw or image_grid_thw).

    Raises:
        VisionEncoderError: the file cannot be loaded here (an op without implementation, a
            malformed graph), or it does not take pixel_values and the grid.
    """
    try:
        encoder = load(path)
    except (UnsupportedOpError, GraphError, ModelFileError) as error:
        raise VisionEncoderError(f"the vision encoder {path!r} cannot run here: {error}") from error
    names = {i.name for i in encoder.inputs}
    grids = set(GRID_INPUTS) if grid is None else {grid}
    if "pixel_values" not in names or not names & grids or len(names) != 2:
        raise VisionEncoderError(
            f"the vision encoder {path!r} takes {sorted(names)}, not pixel_values [patches, "
            f"C*T*P*P] and {' or '.join(sorted(grids))} [images, 3] (Qwen2-VL's vision encoder)"
        )
    return encoder


def run_vision_encoder(encoder, path: str, pixels: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The image features of ``pixels`` [patches, C*T*P*P] with ``grid`` [images, 3]: float32
    [tokens, hidden].

    Raises:
        VisionEncoderError: the graph computes a shape from the values of its inputs (such as
            a loop over the images of grid_thw), which a compiled program cannot take, or it
            cannot be traced for these inputs.
    """
    name = next(i.name for i in encoder.inputs if i.name != "pixel_values")
    try:
        out = encoder({"pixel_values": pixels, name: grid})
    except (DynamicShapeError, UnsupportedOpError, GraphError) as error:
        raise VisionEncoderError(
            f"the vision encoder {path!r} cannot run here: {error}. A graph whose shapes follow "
            f"from the shape of pixel_values alone runs; one that reads shapes from the values of "
            f"{name} (a loop over the images, a range per grid) does not."
        ) from error
    features = out.get("image_features", next(iter(out.values())))
    return np.asarray(features, np.float32)


def _genai_section(files, name: str) -> tuple[str, dict[str, Any]]:
    """The path of genai_config.json of ``files`` and its ``model.NAME`` section."""
    path = os.path.join(os.path.dirname(files.decoder), "genai_config.json")
    if not os.path.exists(path):
        path = os.path.join(files.folder, "genai_config.json")
    model = hub.parse_json(path).get("model", {})
    section = model.get(name) if isinstance(model, dict) else None
    if not isinstance(section, dict) or not section.get("filename"):
        raise ModelFileError(
            f"{path!r} has no model.{name}.filename: a Qwen2-VL folder in the onnxruntime-genai "
            "layout names its vision, embedding and decoder graphs there (see docs/vision.md)"
        )
    return path, section


def _genai_name(path: str, section: str, entry: dict[str, Any], kind: str, key: str) -> str:
    """The graph name that ``model.SECTION.KIND.KEY`` of ``path`` gives (KEY if absent)."""
    names = entry.get(kind, {})
    if not isinstance(names, dict):
        raise ModelFileError(f"{path!r}: model.{section}.{kind} is not an object")
    value = names.get(key, key)
    if not isinstance(value, str):
        raise ModelFileError(f"{path!r}: model.{section}.{kind}.{key} is not a name")
    return value


def genai_vision(files) -> tuple[str, str]:
    """The vision graph of an onnxruntime-genai folder and the name of its grid input, from
    genai_config.json's ``model.vision`` section.

    Raises:
        ModelFileError: no vision section, a graph it names is missing, or its inputs are not
            pixel_values and image_grid_thw (by the names the section gives).
    """
    path, section = _genai_section(files, "vision")
    folder = os.path.dirname(path)
    vision = os.path.normpath(os.path.join(folder, section["filename"]))
    if not os.path.exists(vision):
        raise ModelFileError(
            f"{path!r}: model.vision.filename names {section['filename']!r}, which is not in "
            f"{folder!r}"
        )
    if files.embed is None or not os.path.exists(files.embed):
        _genai_section(files, "embedding")  # its own error when the section is missing
        raise ModelFileError(
            f"{path!r}: model.embedding.filename names {files.embed!r}, which does not exist"
        )
    pixels = _genai_name(path, "vision", section, "inputs", "pixel_values")
    if pixels != "pixel_values":
        raise ModelFileError(
            f"{path!r}: model.vision.inputs.pixel_values is {pixels!r}; this engine feeds "
            "pixel_values"
        )
    grid = _genai_name(path, "vision", section, "inputs", "image_grid_thw")
    return vision, grid


def check_genai_embedding(files, embed) -> None:
    """Checks that the embedding graph of an onnxruntime-genai folder takes the input_ids and
    image_features and gives the inputs_embeds that genai_config.json's ``model.embedding``
    section names.

    Raises:
        ModelFileError: the graph's inputs or outputs are not the ones the section names.
    """
    path, section = _genai_section(files, "embedding")
    ids = _genai_name(path, "embedding", section, "inputs", "input_ids")
    features = _genai_name(path, "embedding", section, "inputs", "image_features")
    out = _genai_name(path, "embedding", section, "outputs", "inputs_embeds")
    try:
        roles = embed_inputs(embed)
    except ValueError as error:
        raise ModelFileError(str(error)) from error
    if roles != (ids, features) or embed.outputs[0].name != out:
        got = [i.name for i in embed.inputs], [o.name for o in embed.outputs]
        raise ModelFileError(
            f"the embedding graph {files.embed!r} takes {got[0]} and gives {got[1]}, not "
            f"{ids!r} (token ids), {features!r} (image features) -> {out!r} as model.embedding "
            f"of {path!r} names them"
        )
