"""The image processor and prompt expansion of Idefics3 and SmolVLM, as transformers makes them.

``Idefics3ImageProcessor`` (also for ``SmolVLMImageProcessor``, whose steps are the same):

1. resize so the longest edge is ``size["longest_edge"]`` (the other edge keeps the aspect ratio,
   rounded down, then up to an even number; at most 4096);
2. with ``do_image_splitting``: resize both edges up to multiples of
   ``max_image_size["longest_edge"]`` (M), cut the image into tiles of about M x M (row by row),
   and add the whole image resized to M x M (the global image); without: only the global image;
3. rescale, normalize (images load as RGB, as in transformers' pipelines, so the processor's
   blending of alpha over white has nothing to do);
4. pad every image of the batch with zeros to the largest height and width, with a
   ``pixel_attention_mask`` of ones over the real pixels; rows with fewer images get all-zero
   images.

The prompt of each image is ``<fake_token_around_image><row_R_col_C>`` and ``image_seq_len``
image tokens per tile, a newline after each row of tiles, then a newline,
``<fake_token_around_image><global-img>``, the image tokens and ``<fake_token_around_image>``;
an image without tiles gets only the global part, without the newlines.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import hub
from .images import ImageInput, load_image
from .processing import MAX_SIDE, RESAMPLE, check_values, normalize, rescale, whole

MAX_IMAGE_SIZE = 4096  # transformers' bound on the longest edge after the first resize


@dataclasses.dataclass
class Idefics3Images:
    """The processed images of a batch.

    Attributes:
        pixel_values: float32 [batch, images, 3, height, width] (tiles and global images).
        pixel_attention_mask: int64 [batch, images, height, width], 1 over real pixels.
        rows: per prompt, the tile rows of each image (0: not split).
        cols: per prompt, the tile columns of each image (0: not split).
    """

    pixel_values: np.ndarray
    pixel_attention_mask: np.ndarray
    rows: list[list[int]]
    cols: list[list[int]]


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge ``longest`` and the other scaled and made even."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * ratio)
    return max(height, 1), max(width, 1)


def multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of ``tile``, the shorter edge after the longer."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


MAX_IMAGE_TOKENS = 1 << 16
"""The most image tokens one tile may take in the prompt (image_seq_len)."""


def check_idefics3(s: Mapping[str, Any], processor: str) -> None:
    """Refuses, by name, Idefics3 settings that are zero, huge or degenerate: ``size`` (a
    ``longest_edge``, or a height and a width) and ``max_image_size``'s ``longest_edge`` outside
    1..:data:`~.processing.MAX_SIDE`, and the shared values (:func:`.processing.check_values`).

    Raises:
        ValueError: naming the setting and its value.
    """
    for name, keys in (("size", ("longest_edge", "height")), ("max_image_size", ("longest_edge",))):
        value = s[name]
        if not isinstance(value, Mapping) or not any(k in value for k in keys):
            shape = "{'longest_edge': N}"
            shape += " or {'height': H, 'width': W}" if len(keys) > 1 else ""
            raise ValueError(f"{processor}: {name} is {value!r}; it must be {shape}")
        sides = ("longest_edge",) if "longest_edge" in value else ("height", "width")
        for side in sides:
            whole(value.get(side), f"{name}[{side!r}]", 1, MAX_SIDE, processor)
    check_values(s, processor)


class Idefics3ImageProcessor:
    """transformers' ``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor`` (the slow ones).

    Attributes:
        config: the settings, by transformers' names.
    """

    DEFAULTS: Mapping[str, Any] = {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": 4 * 364},
        "resample": 1,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": 364},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }

    NAME = "Idefics3ImageProcessor"

    def __init__(self, config: Mapping[str, Any]):
        self.config = {k: config.get(k, v) for k, v in self.DEFAULTS.items()}
        for k in ("image_mean", "image_std", "size", "max_image_size"):
            if self.config[k] is None:
                self.config[k] = self.DEFAULTS[k]
        check_idefics3(self.config, self.NAME)

    def settings(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The settings with ``options`` (transformers' names) in place of the configured ones."""
        unknown = sorted(set(options) - set(self.DEFAULTS))
        if unknown:
            raise TypeError(
                f"unknown image processor options {unknown}; known: {sorted(self.DEFAULTS)}"
            )
        merged = {**self.config, **{k: v for k, v in options.items() if v is not None}}
        check_idefics3(merged, self.NAME)
        return merged

    def frames(self, image: ImageInput, s: Mapping[str, Any]) -> tuple[list[np.ndarray], int, int]:
        """The uint8 RGB frames of one image (tiles, then the global image), rows, columns."""
        resample = int(s["resample"])
        if resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE)}, not {resample!r}")
        image = load_image(image)

        def resized(img, height, width):
            return img.resize((width, height), resample=resample)

        if s["do_resize"]:
            size = s["size"]
            if "longest_edge" in size:
                image = resized(
                    image, *longest_edge_size(image.height, image.width, size["longest_edge"])
                )
            elif {"height", "width"} <= set(size):
                image = resized(image, size["height"], size["width"])
            else:
                raise ValueError(
                    f"size is {{'longest_edge': N}} or {{'height', 'width'}}, not {size!r}"
                )
        tile = int(s["max_image_size"]["longest_edge"])
        if not s["do_image_splitting"]:
            return [np.asarray(resized(image, tile, tile))], 0, 0
        image = resized(image, *multiple_size(image.height, image.width, tile))
        height, width = image.height, image.width
        if height <= tile and width <= tile:
            return [np.asarray(image)], 0, 0
        rows, cols = math.ceil(height / tile), math.ceil(width / tile)
        tile_h, tile_w = math.ceil(height / rows), math.ceil(width / cols)
        pixels = np.asarray(image)
        out = [
            pixels[
                r * tile_h : min((r + 1) * tile_h, height),
                c * tile_w : min((c + 1) * tile_w, width),
            ]
            for r in range(rows)
            for c in range(cols)
        ]
        out.append(
            np.asarray(image if (height, width) == (tile, tile) else resized(image, tile, tile))
        )
        return out, rows, cols

    def __call__(self, images: Sequence[Sequence[ImageInput]], **options: Any) -> Idefics3Images:
        """The pixel values of the images of each prompt (a list of images per prompt).

        Args:
            images: per prompt, its images (paths, bytes, PIL images, numpy uint8 arrays).
            **options: settings for this call, by transformers' names (do_image_splitting, ...).
        """
        s = self.settings(options)
        batch, rows, cols = [], [], []
        for prompt_images in images:
            frames, r_list, c_list = [], [], []
            for image in prompt_images:
                got, r, c = self.frames(image, s)
                frames.extend(got)
                r_list.append(r)
                c_list.append(c)
            batch.append([self._finish(f, s) for f in frames])
            rows.append(r_list)
            cols.append(c_list)
        if not any(batch):
            raise ValueError("no images given")
        if not s["do_pad"]:
            shapes = {f.shape for frames in batch for f in frames}
            if len(shapes) > 1 or len({len(frames) for frames in batch}) > 1:
                raise ValueError("images of several sizes or counts need do_pad=True")
        height = max(f.shape[1] for frames in batch for f in frames)
        width = max(f.shape[2] for frames in batch for f in frames)
        count = max(len(frames) for frames in batch)
        pixels = np.zeros((len(batch), count, 3, height, width), np.float32)
        mask = np.zeros((len(batch), count, height, width), np.int64)
        for b, frames in enumerate(batch):
            for i, f in enumerate(frames):
                pixels[b, i, :, : f.shape[1], : f.shape[2]] = f
                mask[b, i, : f.shape[1], : f.shape[2]] = 1
        return Idefics3Images(pixels, mask, rows, cols)

    def _finish(self, frame: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
        """Rescale, normalize: float32 [3, height, width] (the frame is RGB already: loading
        converts every image to RGB, as transformers' pipelines do: no alpha is left)."""
        pixels: np.ndarray = frame
        if s["do_rescale"]:
            pixels = rescale(pixels, s["rescale_factor"])
        if s["do_normalize"]:
            pixels = normalize(pixels, s["image_mean"], s["image_std"])
        return np.asarray(pixels, np.float32).transpose(2, 0, 1)


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """The strings of the image prompt: transformers' tokenizer attributes and their defaults."""

    image: str = "<image>"
    fake: str = "<fake_token_around_image>"
    global_image: str = "<global-img>"


def image_prompt(rows: int, cols: int, seq_len: int, tokens: ImageTokens = ImageTokens()) -> str:
    """The text that stands for one image of ``rows`` x ``cols`` tiles (0 x 0: not split)."""
    image = tokens.image * seq_len
    whole = f"{tokens.fake}{tokens.global_image}{image}{tokens.fake}"
    if rows == 0 and cols == 0:
        return whole
    lines = "".join(
        "".join(f"{tokens.fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{lines}\n{whole}"


def expand_prompt(
    text: str,
    rows: Sequence[int],
    cols: Sequence[int],
    seq_len: int,
    tokens: ImageTokens = ImageTokens(),
) -> str:
    """``text`` with its i-th image token replaced by the prompt of the i-th image.

    Raises:
        ValueError: the text has another number of image tokens than there are images.
    """
    parts = text.split(tokens.image)
    if len(parts) - 1 != len(rows):
        raise ValueError(
            f"the prompt has {len(parts) - 1} {tokens.image} tokens for {len(rows)} images"
        )
    out = parts[0]
    for r, c, part in zip(rows, cols, parts[1:], strict=True):
        out += image_prompt(r, c, seq_len, tokens) + part
    return out


class Idefics3Processor:
    """Chat messages with images to prompt ids and pixel values, as transformers'
    ``SmolVLMProcessor`` (and ``Idefics3Processor``) make them.

    Attributes:
        images: the image processor.
        tokenizer: the tokenizer (with the chat template).
        image_seq_len: image tokens per tile (``processor_config.json``, else from config.json).
        tokens: the image prompt strings.
    """

    def __init__(self, folder: str | os.PathLike, tokenizer: Any):
        config = hub.read_json(folder, "preprocessor_config.json")
        kind = (config.get("image_processor_type") or "").removesuffix("Fast")
        if kind not in ("Idefics3ImageProcessor", "SmolVLMImageProcessor"):
            raise ValueError(
                f"{os.fspath(folder)!r}: image processor {kind or '(none named)'!r} is not "
                "Idefics3ImageProcessor or SmolVLMImageProcessor"
            )
        self.images = Idefics3ImageProcessor(config)
        self.tokenizer = tokenizer
        seq_len = hub.read_json(folder, "processor_config.json").get("image_seq_len")
        where = "processor_config.json: image_seq_len"
        if seq_len is None:
            model = hub.read_json(folder, "config.json")
            vision = model.get("vision_config") or {}
            size = whole(vision.get("image_size", 512), "image_size", 1, MAX_SIDE, "config.json")
            patch = whole(vision.get("patch_size", 16), "patch_size", 1, size, "config.json")
            scale = whole(model.get("scale_factor", 4), "scale_factor", 1, size, "config.json")
            seq_len, where = (size // patch) ** 2 / scale**2, "config.json: the image tokens"
        self.image_seq_len = whole(seq_len, where, 1, MAX_IMAGE_TOKENS, "Idefics3Processor")
        self.tokens = ImageTokens()

    @staticmethod
    def images_of(messages: Sequence[Mapping[str, Any]]) -> list[ImageInput]:
        """The images of the content parts of ``messages`` ({"type": "image", "image": ...}), in
        order."""
        found = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) or content is None:
                continue
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == "image":
                    if "image" not in part:
                        raise ValueError(
                            "an image part needs its image: {'type': 'image', 'image': ...}"
                        )
                    found.append(part["image"])
        return found

    def chat_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat template applied to ``messages``: a final assistant message is continued,
        else the generation prompt is added."""
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant":
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=False, continue_final_message=True
            )
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def __call__(
        self, conversations: Sequence[Sequence[Mapping[str, Any]]], **options: Any
    ) -> tuple[list[list[int]], Idefics3Images]:
        """The prompt ids of each conversation and the processed images of all.

        Args:
            conversations: chat message lists whose content parts carry the images.
            **options: image processor settings by transformers' names (do_image_splitting, ...).

        Raises:
            ValueError: a conversation has another number of image tokens than of images.
        """
        images = [self.images_of(c) for c in conversations]
        texts = [self.chat_text(c) for c in conversations]
        return self.encode(texts, images, **options)

    def encode(
        self, texts: Sequence[str], images: Sequence[Sequence[ImageInput]], **options: Any
    ) -> tuple[list[list[int]], Idefics3Images]:
        """The prompt ids of texts (each with one image token per image of its list) and the
        processed images."""
        processed = self.images(images, **options)
        ids = []
        for text, rows, cols in zip(texts, processed.rows, processed.cols, strict=True):
            full = expand_prompt(text, rows, cols, self.image_seq_len, self.tokens)
            ids.append(self.tokenizer.encode(full, add_special_tokens=True))
        return ids, processed
