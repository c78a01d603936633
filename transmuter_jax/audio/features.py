"""Whisper's log-mel features, in numpy, as transformers' WhisperFeatureExtractor computes them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import hub
from ..onnx.errors import ModelFileError


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """The Slaney mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, np.float64)
    step, knee = 200.0 / 3, 1000.0
    log_step = np.log(6.4) / 27.0
    linear = hz / step
    return np.where(
        hz >= knee, knee / step + np.log(np.maximum(hz, 1e-12) / knee) / log_step, linear
    )


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_hz_to_mel`."""
    mel = np.asarray(mel, np.float64)
    step, knee = 200.0 / 3, 1000.0
    log_step = np.log(6.4) / 27.0
    knee_mel = knee / step
    return np.where(mel >= knee_mel, knee * np.exp(log_step * (mel - knee_mel)), mel * step)


def mel_filters(bins: int, n_fft: int, rate: int, top: float = 8000.0) -> np.ndarray:
    """[n_fft // 2 + 1, bins] triangular filters, evenly spaced on the Slaney mel scale from 0 Hz
    to ``top``, each scaled to unit area (Slaney normalisation)."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(top), bins + 2))  # [bins + 2]
    fft = np.linspace(0.0, rate // 2, n_fft // 2 + 1)  # [F]
    low, mid, high = edges[:-2], edges[1:-1], edges[2:]  # [bins] each
    rising = (fft[:, None] - low) / (mid - low)
    falling = (high - fft[:, None]) / (high - mid)
    weights = np.maximum(0.0, np.minimum(rising, falling))  # [F, bins]
    return weights * (2.0 / (high - low))


@dataclasses.dataclass(frozen=True)
class FeatureExtractor:
    """The settings of ``preprocessor_config.json`` and the log-mel features they give.

    Attributes:
        bins: mel bins (feature_size: 80, or 128 for large-v3).
        rate: sampling rate in Hz.
        hop: samples between frames (hop_length).
        n_fft: the FFT size (and window length).
        samples: the length every input is padded or cut to (n_samples: chunk_length s).
        frames: the frames of the features (nb_max_frames).
        padding_value: the sample value of the padding.
    """

    bins: int = 80
    rate: int = 16000
    hop: int = 160
    n_fft: int = 400
    samples: int = 480000
    frames: int = 3000
    padding_value: float = 0.0
    normalize: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FeatureExtractor:
        """The extractor of a preprocessor_config.json dict (WhisperFeatureExtractor's defaults
        for missing keys).

        Raises:
            ModelFileError: a value of the wrong type, or zero, huge or degenerate, by name.
        """
        rate = _setting(config, "sampling_rate", 16000, 1000, 384000)
        hop = _setting(config, "hop_length", 160, 1, 1 << 16)
        chunk = _setting(config, "chunk_length", 30, 1, 3600)
        samples = _setting(config, "n_samples", chunk * rate, 1, 3600 * rate)
        n_fft = _setting(config, "n_fft", 400, 2, 1 << 16)
        padding = config.get("padding_value", 0.0)
        if not _number(padding) or not np.isfinite(padding):
            raise ModelFileError(
                f"preprocessor_config.json: padding_value is {padding!r}; it must be a finite "
                "number"
            )
        out = cls(
            bins=_setting(config, "feature_size", 80, 1, 1024),
            rate=rate,
            hop=hop,
            n_fft=n_fft,
            samples=samples,
            frames=_setting(config, "nb_max_frames", samples // hop, 1, samples),
            padding_value=float(padding),
            normalize=bool(config.get("do_normalize", False)),
        )
        if n_fft // 2 >= samples:
            raise ModelFileError(
                f"preprocessor_config.json: n_fft ({n_fft}) needs more than {n_fft // 2} "
                f"samples per input, and n_samples is {samples}"
            )
        return out

    @classmethod
    def from_folder(cls, repo: str | os.PathLike) -> FeatureExtractor:
        """The extractor of ``preprocessor_config.json`` in a model folder or hub repo, or where
        it has none, of the ``audio_processor_config.json`` that the onnxruntime-genai builder
        writes (see :func:`builder_settings`)."""
        config = hub.read_json(repo, "preprocessor_config.json")
        if not config:
            config = builder_settings(hub.read_json(repo, BUILDER_FILE))
        return cls.from_config(config)

    @property
    def filters(self) -> np.ndarray:
        """[n_fft // 2 + 1, bins] the mel filters."""
        return _filters(self.bins, self.n_fft, self.rate)

    def fit(self, samples: np.ndarray) -> np.ndarray:
        """[samples] padded with padding_value or cut to ``self.samples``."""
        samples = np.asarray(samples, np.float32)[: self.samples]
        if self.normalize:  # zero mean, unit variance over the real samples
            samples = (samples - samples.mean()) / np.sqrt(samples.var() + 1e-7)
        out = np.full(self.samples, self.padding_value, np.float32)
        out[: len(samples)] = samples
        return out

    def log_mel(self, samples: np.ndarray) -> np.ndarray:
        """[bins, frames] float32 the features of one fitted input (see :meth:`fit`).

        The frames past the input's last nonzero sample (a short clip's zero padding: most of a
        30 s window) are all zeros: their power is zero, and they are not transformed."""
        half = self.n_fft // 2
        padded = np.pad(np.asarray(samples, np.float64), half, mode="reflect")  # centred frames
        count = 1 + (len(padded) - self.n_fft) // self.hop
        nonzero = np.flatnonzero(padded)
        # frames from `live` on lie past the last nonzero sample; rounded up to SILENT_ROUND so
        # that the transformed frames fall in the same groups of rows as in a whole transform
        live = 0 if len(nonzero) == 0 else int(nonzero[-1]) // self.hop + 1
        live = min(count, -(-live // SILENT_ROUND) * SILENT_ROUND)
        starts = np.arange(live)[:, None] * self.hop
        window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.n_fft) / self.n_fft)  # periodic
        frames = padded[starts + np.arange(self.n_fft)] * window  # [live, n_fft]
        power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2  # [live, F]
        filters = self.filters
        # [T - 1, bins]: the last frame is dropped; the silent frames' rows are zeros, the others
        # computed in the blocks of rows a whole product takes
        mel = np.zeros((count - 1, filters.shape[1]), np.result_type(power, filters))
        block = _block_rows(power.shape[1], filters.shape[1])
        rows = min(count - 1, -(-live // block) * block)
        if rows > live:
            power = np.concatenate([power, np.zeros((rows - live, power.shape[1]))])
        mel[:rows] = _product(power[:rows], filters)
        log = np.log10(np.maximum(mel, 1e-10))
        log = np.maximum(log, log.max() - 8.0)
        return ((log + 4.0) / 4.0).T.astype(np.float32)

    def __call__(self, batch: Sequence[np.ndarray]) -> np.ndarray:
        """[len(batch), bins, frames] float32 input_features of mono samples at ``rate``."""
        return np.stack([self.log_mel(self.fit(s)) for s in batch])


SILENT_ROUND = 64
"""The transformed frames of :meth:`FeatureExtractor.log_mel` are a multiple of this many."""


def _block_rows(k: int, n: int) -> int:
    """The rows of one block of :func:`_product` for a [., k] @ [k, n] product."""
    return max(1, (1 << 18) // max(1, k * n) - 1)


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in blocks of rows small enough that numpy's BLAS runs each on the calling thread
    (OpenBLAS wakes its threads above 2^18 multiply-adds, and they then spin for about 0.1 s
    beside XLA's and the kernels' threads on the same cores: 10% of a Whisper call at batch 1).
    Each output is the same dot product as in one call."""
    rows = _block_rows(a.shape[1], b.shape[1])
    out = np.empty((a.shape[0], b.shape[1]), np.result_type(a, b))
    for start in range(0, a.shape[0], rows):
        np.matmul(a[start : start + rows], b, out=out[start : start + rows])
    return out


BUILDER_FILE = "audio_processor_config.json"
"""The feature settings that the onnxruntime-genai builder writes beside a Whisper export."""


def builder_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The preprocessor_config.json settings that :data:`BUILDER_FILE` ``config`` gives: its
    LogMelSpectrum operation's n_mel (feature_size), chunk_size (chunk_length), hop_length and
    n_fft; {} without one (WhisperFeatureExtractor's defaults)."""
    sequence = (config.get("feature_extraction") or {}) if isinstance(config, Mapping) else {}
    steps = sequence.get("sequence") if isinstance(sequence, Mapping) else None
    names = {"n_mel": "feature_size", "chunk_size": "chunk_length"}
    for step in steps if isinstance(steps, list) else ():
        operation = step.get("operation") if isinstance(step, Mapping) else None
        if isinstance(operation, Mapping) and operation.get("type") == "LogMelSpectrum":
            attrs = operation.get("attrs")
            attrs = attrs if isinstance(attrs, Mapping) else {}
            return {
                names.get(k, k): v for k, v in attrs.items() if k in (*names, "hop_length", "n_fft")
            }
    return {}


def _number(value: Any) -> bool:
    return isinstance(value, int | float | np.number) and not isinstance(value, bool)


def _setting(config: Mapping[str, Any], name: str, default: int, least: int, most: int) -> int:
    """The integer setting ``name`` of a preprocessor config, refused by name outside
    ``least..most`` or when not a whole number."""
    value = config.get(name, default)
    if value is None:
        value = default
    if not _number(value) or not np.isfinite(value) or value != int(value):
        raise ModelFileError(
            f"preprocessor_config.json: {name} is {value!r}; it must be a whole number"
        )
    if not least <= int(value) <= most:
        raise ModelFileError(
            f"preprocessor_config.json: {name} is {value!r}; it must be from {least:,} to {most:,}"
        )
    return int(value)


_FILTERS: dict[tuple[int, int, int], np.ndarray] = {}


def _filters(bins: int, n_fft: int, rate: int) -> np.ndarray:
    key = (bins, n_fft, rate)
    if key not in _FILTERS:
        _FILTERS[key] = mel_filters(bins, n_fft, rate)
    return _FILTERS[key]
