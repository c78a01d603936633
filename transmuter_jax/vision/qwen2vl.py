"""The image processor, prompt expansion and M-RoPE positions of Qwen2-VL and Qwen2.5-VL, as
transformers makes them.

``Qwen2VLImageProcessor`` (Qwen2.5-VL uses the same one), per image:

1. ``smart_resize``: height and width rounded to multiples of ``patch_size * merge_size``, then
   scaled (keeping the aspect ratio) into ``[min_pixels, max_pixels]`` pixels;
2. resize with Pillow (``resample``, bicubic by default), rescale, normalize;
3. the image repeated ``temporal_patch_size`` times (a still video of one temporal patch) and cut
   into patches of ``channels * temporal_patch_size * patch_size * patch_size`` values, ordered
   by blocks of ``merge_size x merge_size`` patches (the vision encoder merges each block into one
   token): ``image_grid_thw`` is (1, height / patch_size, width / patch_size).

The prompt's ``<|image_pad|>`` of each image becomes ``t * h * w / merge_size**2`` of them, and
the positions of the prompt are transformers' ``get_rope_index``: text tokens count up on the
three axes together; the tokens of an image start after the text before it and count its merged
rows and columns on the height and width axes (the temporal axis stays at the start, for
Qwen2.5-VL because an image has no seconds, for Qwen2-VL because it has one temporal patch).
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
from .processing import MAX_SIDE, RESAMPLE, check_values, normalize, rescale, resize, whole

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # transformers' OPENAI_CLIP_MEAN
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]  # transformers' OPENAI_CLIP_STD
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) as multiples of ``factor`` with about the same aspect ratio and between
    ``min_pixels`` and ``max_pixels`` pixels (transformers' ``smart_resize``).

    Raises:
        ValueError: the aspect ratio is 200 or more.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"an image of {height}x{width} has an aspect ratio over 200, which Qwen2-VL refuses"
        )
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass
class Qwen2VLImages:
    """The processed images of a call.

    Attributes:
        pixel_values: float32 [patches, channels * temporal_patch_size * patch_size**2], the
            patches of every image, image after image.
        image_grid_thw: int64 [images, 3], the (temporal, height, width) patch grid of each.
        merge_size: the patches merged into one token along each axis.
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    merge_size: int

    def tokens(self) -> list[int]:
        """The image tokens of each image (its merged patch count)."""
        return [int(np.prod(g)) // self.merge_size**2 for g in self.image_grid_thw]


MAX_PIXELS = MAX_SIDE * MAX_SIDE
"""The most pixels an image is resized to (min_pixels and max_pixels are at most this)."""


def check_qwen2vl(s: Mapping[str, Any], processor: str) -> None:
    """Refuses, by name, Qwen2-VL settings that are zero, huge or degenerate: a patch size,
    merge size or temporal patch size that is not a positive whole number (a patch block of
    ``patch_size * merge_size`` pixels at most :data:`~.processing.MAX_SIDE`), min_pixels or
    max_pixels outside 1..:data:`MAX_PIXELS` or in the wrong order, and the shared values
    (:func:`.processing.check_values`).

    Raises:
        ValueError: naming the setting and its value.
    """
    patch = whole(s["patch_size"], "patch_size", 1, MAX_SIDE, processor)
    whole(s["merge_size"], "merge_size", 1, MAX_SIDE // patch, processor)
    whole(s["temporal_patch_size"], "temporal_patch_size", 1, 64, processor)
    least = whole(s["min_pixels"], "min_pixels", 1, MAX_PIXELS, processor)
    most = whole(s["max_pixels"], "max_pixels", 1, MAX_PIXELS, processor)
    if least > most:
        raise ValueError(
            f"{processor}: min_pixels is {least:,}, more than max_pixels ({most:,}); it must be "
            "at most max_pixels"
        )
    check_values(s, processor)


class Qwen2VLImageProcessor:
    """transformers' ``Qwen2VLImageProcessor`` (the slow one, for Qwen2-VL and Qwen2.5-VL).

    Attributes:
        config: the settings, by transformers' names.
    """

    NAME = "Qwen2VLImageProcessor"

    DEFAULTS: Mapping[str, Any] = {
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "min_pixels": 56 * 56,
        "max_pixels": 28 * 28 * 1280,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    OPTIONS = (*DEFAULTS, "size")

    def __init__(self, config: Mapping[str, Any]):
        # as transformers' constructor: a configured `size` is replaced by the default one, then
        # by min_pixels and max_pixels where they are given
        size = config.get("size")
        if size is not None and not {"shortest_edge", "longest_edge"} <= set(size):
            raise ValueError(f"size must have 'shortest_edge' and 'longest_edge', not {size!r}")
        self.config = {k: config.get(k, v) for k, v in self.DEFAULTS.items()}
        for k, v in self.DEFAULTS.items():
            if self.config[k] is None:
                self.config[k] = v
        check_qwen2vl(self.config, self.NAME)

    def settings(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The settings with ``options`` (transformers' names) in place of the configured ones;
        ``size`` ({"shortest_edge", "longest_edge"}) sets min_pixels and max_pixels."""
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise TypeError(
                f"unknown image processor options {unknown}; known: {sorted(self.OPTIONS)}"
            )
        given = {k: v for k, v in options.items() if v is not None}
        size = given.pop("size", None)
        s = {**self.config, **given}
        if size is not None:
            if not {"shortest_edge", "longest_edge"} <= set(size):
                raise ValueError(f"size must have 'shortest_edge' and 'longest_edge', not {size!r}")
            s["min_pixels"], s["max_pixels"] = size["shortest_edge"], size["longest_edge"]
        check_qwen2vl(s, self.NAME)
        return s

    def patches(self, image: ImageInput, s: Mapping[str, Any]) -> tuple[np.ndarray, tuple]:
        """The patches of one image, float32 [t * h * w, C * T * P * P], and its grid (t, h, w)."""
        patch, temporal, merge = (
            int(s["patch_size"]),
            int(s["temporal_patch_size"]),
            int(s["merge_size"]),
        )
        resample = int(s["resample"])
        if resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE)}, not {resample!r}")
        rgb = load_image(image)
        if s["do_resize"]:
            height, width = smart_resize(
                rgb.height, rgb.width, patch * merge, int(s["min_pixels"]), int(s["max_pixels"])
            )
            pixels = resize(rgb, height, width, resample)
        else:
            pixels = np.asarray(rgb)
            height, width = pixels.shape[:2]
            if height % (patch * merge) or width % (patch * merge):
                raise ValueError(
                    f"an image of {height}x{width} is not cut into {patch * merge}-pixel blocks: "
                    "give do_resize=True"
                )
        if s["do_rescale"]:
            pixels = rescale(pixels, s["rescale_factor"])
        if s["do_normalize"]:
            pixels = normalize(pixels, s["image_mean"], s["image_std"])
        frame = np.asarray(pixels, np.float32).transpose(2, 0, 1)  # HWC -> CHW
        channels = frame.shape[0]
        frames = np.broadcast_to(frame, (temporal, *frame.shape))  # one temporal patch
        grid_h, grid_w = height // patch, width // patch
        blocks = frames.reshape(
            1, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        )
        # [t, block rows, block cols, merge row, merge col, C, T, P, P]
        blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = blocks.reshape(grid_h * grid_w, channels * temporal * patch * patch)
        return np.ascontiguousarray(flat), (1, grid_h, grid_w)

    def __call__(self, images: Sequence[ImageInput], **options: Any) -> Qwen2VLImages:
        """The patches and grids of ``images``, image after image.

        Args:
            images: the images (paths, bytes, PIL images, numpy uint8 arrays; see load_image).
            **options: settings for this call, by transformers' names (min_pixels, ...).

        Raises:
            ValueError: no images, or an image of an aspect ratio over 200.
        """
        s = self.settings(options)
        if not images:
            raise ValueError("no images given")
        got = [self.patches(image, s) for image in images]
        return Qwen2VLImages(
            np.concatenate([p for p, _ in got]),
            np.array([g for _, g in got], np.int64),
            int(s["merge_size"]),
        )


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """What ``get_rope_index`` reads of config.json.

    Attributes:
        model_type: "qwen2_vl" or "qwen2_5_vl".
        image_token_id: the id of ``<|image_pad|>``.
        video_token_id: the id of ``<|video_pad|>``.
        vision_start_token_id: the id of ``<|vision_start|>``.
        spatial_merge_size: patches merged into one token along each axis.
    """

    model_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    spatial_merge_size: int = 2

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RopeConfig:
        """From the dict of config.json.

        Raises:
            ValueError: a model_type other than qwen2_vl and qwen2_5_vl, or a missing token id.
        """
        kind = config.get("model_type")
        if kind not in MODEL_TYPES:
            raise ValueError(f"model_type {kind!r} is not one of {MODEL_TYPES}")
        ids = {}
        for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
            if config.get(name) is None:
                raise ValueError(f"config.json of a {kind} model has no {name}")
            ids[name] = int(config[name])
        merge = (config.get("vision_config") or {}).get("spatial_merge_size", 2)
        merge = whole(merge, "vision_config.spatial_merge_size", 1, MAX_SIDE, "config.json")
        return cls(kind, spatial_merge_size=merge, **ids)


def rope_index(
    ids: Sequence[int], grids: Sequence[Sequence[int]], config: RopeConfig
) -> tuple[np.ndarray, int]:
    """The M-RoPE positions of one prompt (no padding) and its rope delta, as transformers'
    ``get_rope_index`` computes them for images.

    Args:
        ids: the prompt ids, each image expanded to its tokens after ``<|vision_start|>``.
        grids: the (t, h, w) patch grid of each image of the prompt, in order.
        config: the token ids and merge size.

    Returns:
        int64 positions [3, len(ids)] (temporal, height, width) and the rope delta (the first
        position after the prompt minus its length).

    Raises:
        ValueError: a video in the prompt, or other image counts in ids and grids.
    """
    ids = [int(t) for t in ids]
    if not ids:
        return np.zeros((3, 0), np.int64), 0
    starts = [i for i, t in enumerate(ids[:-1]) if t == config.vision_start_token_id]
    following = [ids[i + 1] for i in starts]
    if config.video_token_id in following:
        raise ValueError("the prompt has a video: videos are not supported")
    images = following.count(config.image_token_id)
    if images != len(grids):
        raise ValueError(f"the prompt has {images} images for {len(grids)} image grids")
    merge = config.spatial_merge_size
    pieces, st, nxt = [], 0, 0  # nxt: the first position after the pieces so far
    for t, h, w in grids:
        ed = ids.index(config.image_token_id, st)
        pieces.append(np.broadcast_to(np.arange(ed - st) + nxt, (3, ed - st)))
        t, h, w = int(t), int(h) // merge, int(w) // merge
        base = nxt + ed - st
        if config.model_type == "qwen2_5_vl":
            temporal = np.zeros(t, np.int64)  # an image has second_per_grid_t = 0
        else:
            temporal = np.arange(t)
        grid = np.stack(
            [
                np.repeat(temporal, h * w),
                np.tile(np.repeat(np.arange(h), w), t),
                np.tile(np.arange(w), t * h),
            ]
        )
        pieces.append(grid + base)
        nxt = int(pieces[-1].max()) + 1
        st = ed + t * h * w
    if st < len(ids):
        pieces.append(np.broadcast_to(np.arange(len(ids) - st) + nxt, (3, len(ids) - st)))
    positions = np.concatenate(pieces, axis=1).astype(np.int64)
    if positions.shape[1] != len(ids):
        raise ValueError(
            f"the image grids cover {positions.shape[1]} positions of a {len(ids)}-token prompt: "
            "an image has another number of tokens than its grid"
        )
    return positions, int(positions.max()) + 1 - len(ids)


def batch_rope_index(
    ids: Sequence[Sequence[int]], grids: Sequence[Sequence[int]], config: RopeConfig
) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``get_rope_index`` of a left-padded batch: positions int64 [3, batch,
    longest] (1 at the padding) and the rope deltas [batch] (against the padded length).

    Args:
        ids: the prompt ids of each row, not padded.
        grids: the grids of all the images of the batch, row after row.
        config: the token ids and merge size.
    """
    width = max(map(len, ids))
    out = np.ones((3, len(ids), width), np.int64)
    deltas, used = [], 0
    for i, row in enumerate(ids):
        starts = [j for j, t in enumerate(row[:-1]) if t == config.vision_start_token_id]
        count = sum(1 for j in starts if row[j + 1] == config.image_token_id)
        positions, delta = rope_index(row, grids[used : used + count], config)
        used += count
        out[:, i, width - len(row) :] = positions
        deltas.append(delta - (width - len(row)))
    return out, np.array(deltas, np.int64)


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """The strings of an image in the prompt (transformers' tokenizer attributes)."""

    image: str = "<|image_pad|>"
    start: str = "<|vision_start|>"
    end: str = "<|vision_end|>"


def expand_prompt(text: str, counts: Sequence[int], tokens: ImageTokens = ImageTokens()) -> str:
    """``text`` with its i-th image token repeated ``counts[i]`` times.

    Raises:
        ValueError: the text has another number of image tokens than there are images.
    """
    parts = text.split(tokens.image)
    if len(parts) - 1 != len(counts):
        raise ValueError(
            f"the prompt has {len(parts) - 1} {tokens.image} tokens for {len(counts)} images"
        )
    out = parts[0]
    for count, part in zip(counts, parts[1:], strict=True):
        out += tokens.image * count + part
    return out


class Qwen2VLProcessor:
    """Chat messages with images to prompt ids, patches and M-RoPE positions, as transformers'
    ``Qwen2VLProcessor`` and ``Qwen2_5_VLProcessor`` make them.

    Attributes:
        images: the image processor.
        tokenizer: the tokenizer (with the chat template).
        rope: what the positions read of config.json.
        tokens: the image prompt strings.
    """

    def __init__(self, folder: str | os.PathLike, tokenizer: Any):
        config = hub.read_json(folder, "preprocessor_config.json")
        kind = (config.get("image_processor_type") or "").removesuffix("Fast")
        if kind != "Qwen2VLImageProcessor":
            raise ValueError(
                f"{os.fspath(folder)!r}: image processor {kind or '(none named)'!r} is not "
                "Qwen2VLImageProcessor"
            )
        self.images = Qwen2VLImageProcessor(config)
        self.tokenizer = tokenizer
        self.rope = RopeConfig.from_config(hub.read_json(folder, "config.json"))
        self.tokens = ImageTokens()

    @staticmethod
    def images_of(messages: Sequence[Mapping[str, Any]]) -> list[ImageInput]:
        """The images of the content parts of ``messages`` ({"type": "image", "image": ...})."""
        from .idefics3 import Idefics3Processor

        return Idefics3Processor.images_of(messages)

    def chat_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat template applied to ``messages``: a final assistant message is continued,
        else the generation prompt is added."""
        if messages and messages[-1].get("role") == "assistant":
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=False, continue_final_message=True
            )
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def __call__(
        self, conversations: Sequence[Sequence[Mapping[str, Any]]], **options: Any
    ) -> tuple[list[list[int]], Qwen2VLImages | None, list[np.ndarray]]:
        """The prompt ids, the processed images (None without any) and the positions
        [3, len(ids)] of each conversation.

        Args:
            conversations: chat message lists whose content parts carry the images.
            **options: image processor settings by transformers' names (max_pixels, ...).
        """
        images = [self.images_of(c) for c in conversations]
        texts = [self.chat_text(c) for c in conversations]
        return self.encode(texts, images, **options)

    def encode(
        self, texts: Sequence[str], images: Sequence[Sequence[ImageInput]], **options: Any
    ) -> tuple[list[list[int]], Qwen2VLImages | None, list[np.ndarray]]:
        """The prompt ids of texts (each with one image token per image of its list), the
        processed images of all and the positions of each prompt.

        Raises:
            ValueError: a text has another number of image tokens than its images.
        """
        flat = [image for row in images for image in row]
        processed = self.images(flat, **options) if flat else None
        counts = processed.tokens() if processed is not None else []
        grids = processed.image_grid_thw.tolist() if processed is not None else []
        ids, positions, used = [], [], 0
        for i, (text, row) in enumerate(zip(texts, images, strict=True)):
            try:
                full = expand_prompt(text, counts[used : used + len(row)], self.tokens)
            except ValueError as error:
                raise ValueError(f"conversation {i}: {error}") from None
            prompt = self.tokenizer.encode(full, add_special_tokens=True)
            ids.append(prompt)
            positions.append(rope_index(prompt, grids[used : used + len(row)], self.rope)[0])
            used += len(row)
        return ids, processed, positions
