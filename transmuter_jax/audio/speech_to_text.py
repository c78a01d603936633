"""Speech to text with Whisper: audio in, the transcript (or its English translation) out."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .. import generation as gen
from .. import hub
from ..generation.options import seed_value
from ..tasks import detect
from ..tasks.pipeline import OnToken, Pipeline, Request
from ..tasks.runner import Result
from ..text.tokenizer import Tokenizer
from . import chunks as chunking
from . import layouts
from . import prompt as forced
from . import timestamps as stamps
from .defaults import pipeline_defaults
from .features import FeatureExtractor
from .load import Audio
from .load import load as load_audio

# the pipeline's options, not generation's
SPEECH_OPTIONS = ("language", "task", "return_timestamps", "chunk_length_s", "stride_length_s")
ROW_GROUP = 16
"""The most rows (whole inputs, or chunks of long ones) whose features, encoder outputs and
decoding are held at once: a call of more runs them in groups of this many, in order, so that
hours of audio take memory for their samples and one group, not for every chunk."""


@dataclasses.dataclass
class SpeechResult(Result):
    """One transcript: a :class:`~transmuter_jax.text.Result` (text without timestamps,
    token_ids with them) and, with return_timestamps=True, its chunks.

    Attributes:
        chunks: ``{"timestamp": (start, end), "text": ...}`` as transformers' ASR pipeline
            gives them (end None for text after a last lone timestamp); None without
            return_timestamps.
    """

    chunks: list[dict[str, Any]] | None = None


class SpeechToText(Pipeline):
    """A Whisper encoder-decoder with its tokenizer and feature extractor, from
    :func:`speech_to_text`.

    Each input is padded or cut to the extractor's 30 s, encoded once, and decoded after its
    forced prompt (``<|startoftranscript|><|lang|><|task|><|notimestamps|>``), as transformers'
    ``WhisperForConditionalGeneration.generate`` does.

    Attributes:
        files: the files it was loaded from (folder, exporter family, encoder, decoder): an
            optimum, transformers.js or onnxruntime-genai layout (see
            :mod:`transmuter_jax.audio.layouts`).
        tokenizer: the tokenizer of ``tokenizer.json``.
        features: the log-mel settings of ``preprocessor_config.json``.
        generation_config: generation_config.json (lang_to_id, task_to_id, ...).
        options: the default options (language, task and generation options).
    """

    TASK = detect.SPEECH_TO_TEXT

    def __init__(self, repo, *, dtype=None, file=None, mesh=None, devices=None, **options):
        if repo is None or repo in _default_aliases():
            from .. import default

            repo = default.speech_folder(repo)  # prepared offline on first use
        super().__init__(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
        folder = self.files.folder
        self.tokenizer = Tokenizer.from_folder(folder)
        self.features = FeatureExtractor.from_folder(folder)
        self.generation_config = hub.read_json(folder, "generation_config.json")
        if hub.stands_in(folder, "generation_config.json"):  # a genai builder's folder
            tokens = forced.from_tokens(self.tokenizer.token_id)
            self.generation_config = {**tokens, **self.generation_config}
        decoder, embed = self.load_decoder()
        config = hub.read_json(folder, "config.json")
        self.encoder = layouts.encoder(self.files.encoder, decoder, config)
        speech, generation = _split(options)
        forced.check(self.generation_config, speech.get("language"), speech.get("task"))
        generation = {**pipeline_defaults(self.generation_config, generation), **generation}
        self.start(decoder, embed, given=list(self.encoder.given), options=generation)
        self._stamps = None
        if self.timestamp_begin is not None:
            self._stamps = stamps.processor(self.generation_config)

    @property
    def timestamp_begin(self) -> int | None:
        """The id of the first timestamp token (<|0.00|>), or None for a model without them."""
        no_stamps = self.generation_config.get("no_timestamps_token_id")
        return None if no_stamps is None else int(no_stamps) + 1

    def input_features(
        self, audio: Sequence[Audio], sampling_rate: int | None = None
    ) -> np.ndarray:
        """[len(audio), bins, frames] float32 the log-mel features of each input (see
        :func:`transmuter_jax.audio.load` for the kinds of input)."""
        samples = [load_audio(a, self.features.rate, sampling_rate) for a in audio]
        return self.features(samples)

    def encode(self, features: np.ndarray) -> dict[str, np.ndarray]:
        """The decoder's inputs from the encoder (encoder_hidden_states [B, frames / 2, hidden],
        or a genai decoder's cross-attention cache), one row per input."""
        return self.encoder(features)

    def _detect(self, encoded: dict[str, np.ndarray]) -> list[int]:
        """The language token of each row: the most likely of lang_to_id after the start token
        (transformers' ``detect_language``)."""
        model = self.decoder
        start = int(self.generation_config["decoder_start_token_id"])
        inputs, static = gen.prompt_inputs(
            model, 1, 1, hub.read_json(self.files.folder, "config.json")
        )
        langs = np.asarray(sorted(self.generation_config["lang_to_id"].values()))
        ids = next(i for i in model.inputs if i.name == "input_ids")
        found = []
        for row in range(len(next(iter(encoded.values())))):
            feeds = {k: v[row : row + 1] for k, v in encoded.items()}
            feeds["input_ids"] = np.array([[start]], np.dtype(ids.dtype))
            logits = np.asarray(model({**inputs, **static, **feeds})["logits"])[0, -1]
            found.append(int(langs[np.argmax(logits[langs])]))
        return found

    def prompts(
        self,
        encoded: dict[str, np.ndarray],
        language: str | None = None,
        task: str | None = None,
        timestamps: bool = False,
    ) -> list[list[int]]:
        """The forced prompt of each row of ``encoded``, the encoder's outputs as the decoder
        takes them (without <|notimestamps|> when ``timestamps``)."""
        config = self.generation_config
        language = config.get("language") if language is None else language
        task = config.get("task") if task is None else task
        forced.check(config, language, task)
        detected: list[int | None] = [None] * len(next(iter(encoded.values())))
        if forced.needs_language(config, language, task):
            detected = list(self._detect(encoded))
        return [
            forced.forced_prompt(
                config, language=language, task=task, detected=d, timestamps=timestamps
            )
            for d in detected
        ]

    def request(self, audio: Sequence[Audio], options: dict[str, Any]) -> Request:
        """The forced prompts, encoder inputs, generation options and the task's processors of
        the rows: whole inputs and chunks of long ones (:func:`chunks.rows`, the request's
        state with whether timestamps are on); the option ``sampling_rate`` (see
        :meth:`generate`). All rows at once: :meth:`generate` runs them in groups of
        :data:`ROW_GROUP`."""
        return self._request(*self._rows(audio, options))

    def _rows(
        self, audio: Sequence[Audio], options: dict[str, Any]
    ) -> tuple[list[chunking.Row], dict[str, Any], dict[str, Any], bool]:
        """The rows of a call (its audio loaded and cut into chunks), its speech and generation
        options, and whether timestamps are on."""
        sampling_rate = options.pop("sampling_rate", None)
        if isinstance(audio, str | os.PathLike | bytes | np.ndarray) or not audio:
            raise TypeError("audio is a non-empty list of inputs (paths, bytes or arrays)")
        speech = _split({**self.options, **options})[0]
        timestamps = bool(speech.get("return_timestamps", False))
        if timestamps and self._stamps is None:
            raise ValueError("the model has no timestamp tokens (no no_timestamps_token_id)")
        samples = [load_audio(a, self.features.rate, sampling_rate) for a in audio]
        rows = chunking.rows(
            samples, self.features.rate, self.features.samples,
            speech.get("chunk_length_s"), speech.get("stride_length_s"),
        )  # fmt: skip
        generation = _split(options)[1]
        if any(r.stride is not None for r in rows):
            self._check_chunked(generation)
        return rows, speech, generation, timestamps

    def _request(
        self,
        rows: list[chunking.Row],
        speech: dict[str, Any],
        generation: dict[str, Any],
        timestamps: bool,
    ) -> Request:
        """The :class:`Request` of ``rows``: their features, encoder outputs and prompts."""
        encoded = self.encode(self.features([r.samples for r in rows]))
        prompts = self.prompts(encoded, speech.get("language"), speech.get("task"), timestamps)
        processors = (self._stamps,) if timestamps else ()
        return Request(prompts, generation, encoded, processors, (rows, timestamps))

    def finish(self, results: list, request: Request) -> list:
        """One :class:`SpeechResult` per input (the chunks of a long input merged)."""
        rows, timestamps = request.state
        return self._gather(rows, results, timestamps)

    def _check_chunked(self, generation: dict[str, Any]) -> None:
        """Refuses the options a merged transcript cannot give."""
        n = {**self.defaults, **self.options, **generation}.get("num_return_sequences")
        if n not in (None, 1):
            raise ValueError(f"chunked audio gives one transcript, not num_return_sequences={n}")
        if {**self.options, **generation}.get("stop"):
            raise ValueError("stop= is not supported on chunked audio (the text is merged)")

    def _transcript(self, rows: list[list[int]], strides: list, timestamps: bool):
        """:func:`chunks.merge` of the new tokens of an input's chunks (one row with stride
        ``(0, 0, 0)`` for an input decoded in one pass, as the pipeline without chunking)."""
        begin = self.timestamp_begin
        begin = len(self.tokenizer.token_texts) if begin is None else begin
        config = hub.read_json(self.files.folder, "config.json")
        window = self.features.samples / self.features.rate
        langs = self.generation_config.get("lang_to_id") or {}
        return chunking.merge(
            rows, strides, timestamps=timestamps, begin=begin,
            special=frozenset(t for t in self.tokenizer.special_ids if t < begin),
            languages={int(i): t.strip("<|>") for t, i in langs.items()},
            precision=window / int(config.get("max_source_positions", self.features.frames // 2)),
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
        )  # fmt: skip

    def _merge(self, results: list[Result], strides: list, timestamps: bool) -> SpeechResult:
        """The result of one input from those of its chunks (see :func:`chunks.merge`)."""
        merged = self._transcript([r.token_ids for r in results], strides, timestamps)
        pick = lambda field: (  # noqa: E731 - each merged token's value in its chunk
            None
            if getattr(results[0], field) is None
            else [getattr(results[c], field)[i] for _, c, i in merged.tokens]
        )
        reasons = {r.finish_reason for r in results}
        return SpeechResult(
            text=merged.text,
            token_ids=[t for t, _, _ in merged.tokens],
            logprobs=pick("logprobs"),
            finish_reason="length" if "length" in reasons else "eos",
            top_logprobs=pick("top_logprobs"),
            chunks=merged.chunks if timestamps else None,
        )

    def _gather(self, rows: list[chunking.Row], out: list, timestamps: bool) -> list:
        """One result per input from the results ``out`` of the ``rows``."""
        results: list = []
        for index in sorted({r.input for r in rows}):
            mine = [(r, x) for r, x in zip(rows, out, strict=True) if r.input == index]
            first = mine[0][1]
            if mine[0][0].stride is not None:
                strides = [r.stride for r, _ in mine]
                results.append(self._merge([x for _, x in mine], strides, timestamps))
            elif isinstance(first, list):
                results.append([self._result(r, timestamps) for r in first])
            else:
                results.append(self._result(first, timestamps))
        return results

    def _result(self, result: Result, timestamps: bool) -> SpeechResult:
        """``result`` with its text decoded without timestamp tokens, and its chunks."""
        begin = self.timestamp_begin
        ids = [t for t in result.token_ids if begin is None or t < begin]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        fields = {**dataclasses.asdict(result), "text": text}
        if timestamps:  # the pipeline's chunks of one item without stride
            fields["chunks"] = self._transcript([result.token_ids], [(0.0, 0.0, 0.0)], True).chunks
        return SpeechResult(**fields)

    def generate(
        self,
        audio: Sequence[Audio],
        *,
        sampling_rate: int | None = None,
        seed: int | None = None,
        on_token: OnToken | None = None,
        **options: Any,
    ) -> list[SpeechResult] | list[list[SpeechResult]]:
        """Transcribes (or translates) each input: its rows (the inputs, and the chunks of long
        ones) are decoded in batches of at most :data:`ROW_GROUP` rows, in order.

        Args:
            audio: file paths, file bytes, or float arrays of samples.
            sampling_rate: the rate of the arrays in Hz (files tell their own).
            seed: the sampling seed of the first row (the next get seed + 1, ...; each chunk of a
                long input is a row); None: random.
            on_token: called after each step with the new token of each row of the batch being
                decoded (int32 [rows]).
            **options: ``language`` (a code, name or token; None: detected for a multilingual
                model), ``task`` ("transcribe" or "translate"), ``return_timestamps`` (predict
                timestamp tokens, with transformers' rules, and give ``chunks``),
                ``chunk_length_s`` / ``stride_length_s`` (the ASR pipeline's chunking, by
                default 30 s chunks with 5 s strides for inputs longer than 30 s: see
                docs/speech.md), and generation options (max_new_tokens, num_beams, ...).

        Returns:
            One :class:`SpeechResult` per input: text, token_ids (the new tokens, without the
            forced prompt and eos; for a chunked input the merged text tokens), logprobs,
            finish_reason, chunks; with
            num_return_sequences n > 1, a list of n per input.
        """
        rows, speech, generation, timestamps = self._rows(
            audio, {**options, "sampling_rate": sampling_rate}
        )
        return self._run_rows(rows, speech, generation, timestamps, seed, on_token)

    def _run_rows(
        self,
        rows: list[chunking.Row],
        speech: dict[str, Any],
        generation: dict[str, Any],
        timestamps: bool,
        seed: int | None,
        on_token: OnToken | None = None,
    ) -> list:
        """The results of ``rows`` decoded in groups of :data:`ROW_GROUP`, one per input."""
        base = None if seed is None else seed_value(seed)
        out: list = []
        for start in range(0, len(rows), ROW_GROUP):  # the features of one group at a time
            request = self._request(rows[start : start + ROW_GROUP], speech, generation, timestamps)
            group_seed = None if base is None else base + start
            out += self.run(request, seed=group_seed, on_token=on_token)
        return self._gather(rows, out, timestamps)

    def single(self, inputs: Any) -> bool:
        return isinstance(inputs, str | os.PathLike | bytes) or (
            isinstance(inputs, np.ndarray) and inputs.dtype != object
        )

    def __call__(
        self,
        audio: Audio | Sequence[Audio],
        *,
        sampling_rate: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> str | list[str] | list[list[str]]:
        """The text of one input, or the texts of a list of inputs (see :meth:`generate`)."""
        batch = audio if self.single(audio) else list(audio)
        return super().__call__(batch, sampling_rate=sampling_rate, seed=seed, **options)

    def stream(
        self,
        audio: Audio,
        *,
        sampling_rate: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> Iterator[Any]:
        """Yields the text of one input in pieces as it is decoded; they join to the text of
        :meth:`generate` (with beam search, or for a chunked input, as one piece at the end).
        With num_return_sequences n > 1, ``(j, piece)`` pairs (see :meth:`Pipeline.stream`)."""
        rows, speech, generation, timestamps = self._rows(
            [audio], {**options, "sampling_rate": sampling_rate}
        )
        if len(rows) > 1 or rows[0].stride is not None:  # chunks: their merge comes at the end
            text = self._run_rows(rows, speech, generation, timestamps, seed)[0].text
            return iter([text] if text else [])
        return self.stream_request(self._request(rows, speech, generation, timestamps), seed=seed)


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the speech options, the generation options) of ``options``."""
    speech = {k: v for k, v in options.items() if k in SPEECH_OPTIONS}
    return speech, {k: v for k, v in options.items() if k not in SPEECH_OPTIONS}


def _default_aliases() -> tuple[str, ...]:
    from ..default.speech import SPEECH_ALIASES

    return ("default", *SPEECH_ALIASES)


def speech_to_text(
    repo: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    file: str | None = None,
    mesh: Any = None,
    devices: Sequence[Any] | None = None,
    **options: Any,
) -> SpeechToText:
    """A speech-to-text pipeline over a Whisper export.

    Args:
        repo: a local folder or a hub id of a Whisper export in the layout of optimum
            (encoder_model.onnx, decoder_model_merged.onnx), transformers.js (the same under
            onnx/, with dtype variants) or onnxruntime-genai (encoder.onnx, decoder.onnx,
            genai_config.json), with preprocessor_config.json and generation_config.json;
            None (or "speech"): the
            default whisper tiny.en, "speech-base": multilingual whisper base, both prepared
            offline on first use (:func:`transmuter_jax.default.speech_folder`).
        dtype: which variant of the ONNX files (such as "fp32", "fp16", "q4", "quantized" or
            "q8"), as for the text tasks; None: fp32 (a genai folder: its own).
        file: the decoder file to use, relative to the repo; overrides ``dtype``.
        mesh: a ``jax.sharding.Mesh`` with axes "model" and/or "data": the decoder's weights
            are split over it at load and its steps run over it (docs/distributed.md); the
            encoder stays on the default device.
        devices: without ``mesh``, the devices of a mesh that puts them all on "model".
        **options: default options: ``language``, ``task`` and generation options
            (transformers' names). Generation starts from the ASR pipeline's defaults:
            ``num_beams=5`` and, where generation_config.json sets no max_length,
            ``max_new_tokens=256`` (``num_beams=1``: greedy).

    Returns:
        A :class:`SpeechToText`: call it with audio, or use ``generate`` and ``stream``.
    """
    return SpeechToText(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
