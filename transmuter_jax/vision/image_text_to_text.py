"""Image and text to text with a decoder-only vision-language model (SmolVLM / Idefics3)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import hub
from ..onnx.model import load
from ..tasks import detect
from ..tasks.pipeline import OnToken, Pipeline, Request
from ..tasks.runner import Result, texts_of
from ..text.tokenizer import Tokenizer
from .idefics3 import Idefics3Processor
from .images import ImageInput

Messages = Sequence[Mapping[str, Any]]
QWEN2VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # model types of vision/qwen2vl_pipeline.py


def community_vision_encoder(repo: Any, files: Any) -> str:
    """The vision encoder of an onnx-community folder (beside its decoder), refused with the
    reason when it or embed_tokens.onnx is missing."""
    path = detect.vision_encoder_path(files.decoder)
    if not os.path.exists(path):  # (a genai folder's vision graph is not beside its decoder)
        detect.check(detect.IMAGE_TEXT_TO_TEXT, repo, files, also=())
        raise detect.WrongTask(
            f"{os.fspath(repo)!r} has no vision encoder ({path}): it is not an onnx-community "
            "image-text-to-text folder",
            detect.IMAGE_TEXT_TO_TEXT.key,
        )
    if files.embed is None:
        raise ValueError(f"{os.fspath(repo)!r} has no embed_tokens.onnx beside the decoder")
    return path


def real_frame_features(features: np.ndarray, pixels: Sequence[int], processed: Any) -> np.ndarray:
    """The features of the real frames, in order ([tokens, hidden]), from a vision encoder's
    output for pixel values of shape ``pixels`` ([batch, frames, 3, H, W], padded with all-zero
    frames): one row per frame (padding frames included), or one per real frame (transformers'
    ``get_image_features`` drops the padding frames itself)."""
    batch, count = pixels[0], pixels[1]
    frames = [
        sum(r * c + 1 for r, c in zip(rows, cols, strict=True))
        for rows, cols in zip(processed.rows, processed.cols, strict=True)
    ]
    hidden = features.shape[-1]
    if features.ndim == 3 and features.shape[0] == sum(frames):
        return features.reshape(-1, hidden)  # the padding frames were dropped by the graph
    if features.ndim != 3 or features.shape[0] != batch * count:
        raise ValueError(
            f"the vision encoder gives features of shape {features.shape} for {batch * count} "
            f"frames ({sum(frames)} of them images, the others padding); it must give one row "
            "per frame or one per image frame"
        )
    features = features.reshape(batch, count, -1, hidden)
    return np.concatenate([features[b, :n].reshape(-1, hidden) for b, n in enumerate(frames)])


class ImageTextToText(Pipeline):
    """A vision encoder, the token embeddings and a decoder of inputs_embeds, with the processor,
    from :func:`image_text_to_text`.

    The prompt's embeddings are embed_tokens of its ids with the image token positions replaced,
    in order, by the vision encoder's image features (as transformers' ``inputs_merger``).

    Attributes:
        files: the files of the decoder and the embeddings (folder, family, decoder, embed).
        vision_encoder: the path of the vision encoder.
        processor: the chat and image processor (Idefics3 / SmolVLM).
        tokenizer: the tokenizer of ``tokenizer.json``.
        image_token_id: the id of the image token.
        options: the default generation options (transformers' names).
    """

    TASK = detect.IMAGE_TEXT_TO_TEXT

    def __init__(self, repo, *, dtype=None, file=None, mesh=None, devices=None, **options):
        super().__init__(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
        self.tokenizer = Tokenizer.from_folder(self.files.folder)
        decoder, embed = self.load_vision(repo)
        self.start(decoder, embed, options={**self.options, "image_token": self.image_token_id})

    def load_vision(self, repo: Any) -> tuple[Any, Any]:
        """Loads the processor and the vision encoder (setting :attr:`vision_encoder`,
        :attr:`processor`, :attr:`image_token_id`); returns the decoder and its embeddings."""
        self.vision_encoder = community_vision_encoder(repo, self.files)
        self.processor = Idefics3Processor(self.files.folder, self.tokenizer)
        config = hub.read_json(self.files.folder, "config.json")
        token = config.get("image_token_id", config.get("image_token_index"))
        if token is None:
            raise ValueError(f"{self.files.folder!r}: no image_token_id in config.json")
        self.image_token_id = int(token)
        self.encoder = load(self.vision_encoder)
        names = {i.name for i in self.encoder.inputs}
        if not {"pixel_values", "pixel_attention_mask"} <= names:
            raise ValueError(
                f"the vision encoder {self.vision_encoder!r} takes {sorted(names)}, not "
                "pixel_values and pixel_attention_mask"
            )
        return self.load_decoder()

    def inputs(
        self, conversations: Sequence[Messages], **processor_options: Any
    ) -> tuple[list[list[int]], np.ndarray | None]:
        """The prompt ids of each conversation and the image features of all their image
        tokens, in order ([tokens, hidden]; None without images)."""
        if isinstance(conversations, str) or not conversations:
            raise TypeError("conversations is a non-empty list of chat message lists")
        images = [self.processor.images_of(c) for c in conversations]
        texts = [self.processor.chat_text(c) for c in conversations]
        if not any(images):
            for i, text in enumerate(texts):
                count = text.count(self.processor.tokens.image)
                if count:
                    raise ValueError(
                        f"conversation {i} has {count} {self.processor.tokens.image} tokens for 0 "
                        "images"
                    )
            return [self.tokenizer.encode(t, add_special_tokens=True) for t in texts], None
        ids, processed = self.processor.encode(texts, images, **processor_options)
        out = self.encoder(
            {
                "pixel_values": processed.pixel_values,
                "pixel_attention_mask": processed.pixel_attention_mask,
            }
        )
        features = np.asarray(out.get("image_features", next(iter(out.values()))), np.float32)
        merged = real_frame_features(features, processed.pixel_values.shape, processed)
        tokens = sum(row.count(self.image_token_id) for row in ids)
        if tokens != merged.shape[0]:
            raise ValueError(
                f"the prompts have {tokens} image tokens for {merged.shape[0]} image features"
            )
        return ids, merged

    def prepare(
        self, conversations: Sequence[Messages], processing: Mapping[str, Any]
    ) -> tuple[list[list[int]], dict[str, Any]]:
        """The prompt ids and what generate takes beside them (the image features)."""
        ids, features = self.inputs(conversations, **processing)
        return ids, {} if features is None else {"image_features": features}

    def request(self, batch: Sequence[Messages], options: dict[str, Any]) -> Request:
        """The prompt ids and image features of a batch of conversations; the image processor
        options of ``options`` go to the processor."""
        generation, processing = self._split(options)
        ids, given = self.prepare(batch, processing)
        return Request(ids, generation, given)

    def generate(
        self,
        conversations: Sequence[Messages],
        *,
        seed: int | None = None,
        on_token: OnToken | None = None,
        **options: Any,
    ) -> list[Result] | list[list[Result]]:
        """Generates the answer of each conversation, in one batch.

        Args:
            conversations: chat message lists whose content parts carry the images
                (``{"type": "image", "image": PATH_OR_PIL_OR_ARRAY}``).
            seed: the sampling seed of the first conversation (the next get seed + 1, ...).
            on_token: called after each step with the new token of each row (int32 [rows]).
            **options: generation options (max_new_tokens, ...) and image processor options by
                transformers' names (do_image_splitting, ...).

        Returns:
            One :class:`Result` per conversation (text, token_ids, logprobs, finish_reason);
            with num_return_sequences n > 1, a list of n per conversation.
        """
        return super().generate(conversations, seed=seed, on_token=on_token, **options)

    def __call__(
        self,
        messages: Messages | ImageInput,
        question: str | None = None,
        *,
        seed: int | None = None,
        **options: Any,
    ) -> str | list[str]:
        """The answer to chat messages, or with ``pipe(image, "question")`` to one user message
        of the image and the question."""
        out = texts_of(self.generate([self._messages(messages, question)], seed=seed, **options))
        return out[0]

    def stream(
        self,
        messages: Messages | ImageInput,
        question: str | None = None,
        *,
        seed: int | None = None,
        **options: Any,
    ) -> Iterator[Any]:
        """Yields the answer in pieces as it is generated; they join to the text the same call
        without streaming gives (with num_return_sequences n > 1, ``(j, piece)`` pairs: see
        :meth:`Pipeline.stream`)."""
        return super().stream(self._messages(messages, question), seed=seed, **options)

    @staticmethod
    def _messages(messages: Messages | ImageInput, question: str | None) -> Messages:
        """Chat messages as given, or the user message of an image and a question."""
        if question is None:
            if isinstance(messages, Sequence) and not isinstance(messages, str | bytes):
                if messages and all(isinstance(m, Mapping) for m in messages):
                    return messages
            raise TypeError("give chat messages, or an image and a question: pipe(image, 'q')")
        return [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": messages},
                    {"type": "text", "text": question},
                ],
            }
        ]

    def _split(self, options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The generation options and the image processor options of ``options``."""
        known = self.processor.images.DEFAULTS
        processing = {k: v for k, v in options.items() if k in known}
        return {k: v for k, v in options.items() if k not in known}, processing
