"""Text to text with an encoder-decoder model (Marian-style translation)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..onnx.model import load
from ..tasks import detect
from ..tasks.pipeline import OnToken, Pipeline, Request
from ..tasks.runner import Result
from .tokenizer import Tokenizer


class TextToText(Pipeline):
    """An encoder-decoder model with its tokenizer, from :func:`text_to_text`.

    The encoder runs once per text; generation then starts from decoder_start_token_id with the
    encoder outputs given to every decoder step.

    Attributes:
        files: the files it was loaded from (folder, exporter family, encoder, decoder).
        tokenizer: the tokenizer of ``tokenizer.json``.
        encoder: the encoder model.
        options: the default generation options (transformers' names).
    """

    TASK = detect.TEXT_TO_TEXT

    def __init__(self, repo, *, dtype=None, file=None, mesh=None, devices=None, **options):
        super().__init__(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
        self.tokenizer = Tokenizer.from_folder(self.files.folder)
        self.encoder = load(self.files.encoder)
        decoder, embed = self.load_decoder()
        names = {i.name for i in decoder.inputs}
        self.given = [n for n in ("encoder_hidden_states", "encoder_attention_mask") if n in names]
        if "encoder_hidden_states" not in self.given:
            raise ValueError(f"the decoder {self.files.decoder!r} takes no encoder_hidden_states")
        self.start(decoder, embed, given=self.given)

    def _encode(self, texts: Sequence[str]) -> tuple[dict[str, np.ndarray], int]:
        """The encoder outputs of each text (run alone, as a batch of one), padded to one length,
        with each text's ids as "encoder_input_ids" (the encoder options read them), and the
        length of the longest text in tokens."""
        if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts is a non-empty list of strings")
        names = {i.name for i in self.encoder.inputs}
        states, encoded = [], []
        for text in texts:
            ids = np.asarray([self.tokenizer.encode(text)], np.int64)
            encoded.append(ids[0].tolist())
            feeds = {"input_ids": ids}
            if "attention_mask" in names:
                feeds["attention_mask"] = np.ones_like(ids)
            out = self.encoder(feeds)
            states.append(np.asarray(out.get("last_hidden_state", next(iter(out.values()))))[0])
        longest = max(len(s) for s in states)
        hidden = np.zeros((len(texts), longest, states[0].shape[-1]), states[0].dtype)
        mask = np.zeros((len(texts), longest), np.int64)
        for row, state in enumerate(states):
            hidden[row, : len(state)], mask[row, : len(state)] = state, 1
        given = {"encoder_hidden_states": hidden}
        if "encoder_attention_mask" in self.given:
            given["encoder_attention_mask"] = mask
        elif longest != min(len(s) for s in states):
            raise ValueError(
                "the decoder takes no encoder_attention_mask: give texts one at a time"
            )
        given["encoder_input_ids"] = encoded
        return given, longest

    def _start(self, batch: int, options: dict[str, Any]) -> list[int]:
        """[decoder_start_token_id], read from the context the run of ``batch`` texts uses."""
        start = self.chosen(batch, options).decoder_start_token_id
        if start is None:
            raise ValueError(f"{self.files.folder!r} has no decoder_start_token_id")
        return [int(start)]

    def request(self, batch: Sequence[str], options: dict[str, Any]) -> Request:
        """The encoder outputs of each text and the decoder's start token (see :meth:`generate`)."""
        given, _ = self._encode(batch)
        return Request([self._start(len(batch), options)] * len(batch), options, given)

    def generate(
        self,
        texts: Sequence[str],
        *,
        seed: int | None = None,
        on_token: OnToken | None = None,
        **options: Any,
    ) -> list[Result] | list[list[Result]]:
        """Generates the output text of each input text, in one batch.

        Args:
            texts: the input texts.
            seed: the sampling seed of the first text (the next get seed + 1, ...); None: random.
            on_token: called after each step with the new token of each row (int32 [rows]).
            **options: generation options for this call (max_new_tokens, num_beams, ...).

        Returns:
            One :class:`Result` per text; with num_return_sequences n > 1, a list of n per text
            (beam search: the n best hypotheses, best first).
        """
        return super().generate(texts, seed=seed, on_token=on_token, **options)


def text_to_text(
    repo: str | os.PathLike,
    *,
    dtype: str | None = None,
    file: str | None = None,
    mesh: Any = None,
    devices: Sequence[Any] | None = None,
    **options: Any,
) -> TextToText:
    """A text-to-text pipeline over an encoder-decoder model (translation, summarisation).

    Args:
        repo: a local folder or a hub id with an encoder and a merged decoder.
        dtype: which variant of the ONNX files (such as "fp32", "q4"); None: fp32.
        file: the decoder file to use, relative to the repo; overrides ``dtype``.
        mesh: a ``jax.sharding.Mesh`` with axes "model" and/or "data": the decoder's weights
            are split over it at load and its steps run over it (docs/distributed.md); the
            encoder stays on the default device.
        devices: without ``mesh``, the devices of a mesh that puts them all on "model".
        **options: default generation options, transformers' names.
    """
    return TextToText(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
