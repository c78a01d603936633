"""Whisper's log-mel features, in numpy, as transformers' WhisperFeatureExtractor computes them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import hub


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
        for missing keys)."""
        rate = int(config.get("sampling_rate", 16000))
        hop = int(config.get("hop_length", 160))
        samples = int(config.get("n_samples", int(config.get("chunk_length", 30)) * rate))
        return cls(
            bins=int(config.get("feature_size", 80)),
            rate=rate,
            hop=hop,
            n_fft=int(config.get("n_fft", 400)),
            samples=samples,
            frames=int(config.get("nb_max_frames", samples // hop)),
            padding_value=float(config.get("padding_value", 0.0)),
            normalize=bool(config.get("do_normalize", False)),
        )

    @classmethod
    def from_folder(cls, repo: str | os.PathLike) -> FeatureExtractor:
        """The extractor of ``preprocessor_config.json`` in a model folder or hub repo."""
        return cls.from_config(hub.read_json(repo, "preprocessor_config.json"))

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
        """[bins, frames] float32 the features of one fitted input (see :meth:`fit`)."""
        half = self.n_fft // 2
        padded = np.pad(np.asarray(samples, np.float64), half, mode="reflect")  # centred frames
        count = 1 + (len(padded) - self.n_fft) // self.hop
        starts = np.arange(count)[:, None] * self.hop
        window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.n_fft) / self.n_fft)  # periodic
        frames = padded[starts + np.arange(self.n_fft)] * window  # [T, n_fft]
        power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2  # [T, F]
        mel = power[:-1] @ self.filters  # [T - 1, bins]: the last frame is dropped
        log = np.log10(np.maximum(mel, 1e-10))
        log = np.maximum(log, log.max() - 8.0)
        return ((log + 4.0) / 4.0).T.astype(np.float32)

    def __call__(self, batch: Sequence[np.ndarray]) -> np.ndarray:
        """[len(batch), bins, frames] float32 input_features of mono samples at ``rate``."""
        return np.stack([self.log_mel(self.fit(s)) for s in batch])


_FILTERS: dict[tuple[int, int, int], np.ndarray] = {}


def _filters(bins: int, n_fft: int, rate: int) -> np.ndarray:
    key = (bins, n_fft, rate)
    if key not in _FILTERS:
        _FILTERS[key] = mel_filters(bins, n_fft, rate)
    return _FILTERS[key]
