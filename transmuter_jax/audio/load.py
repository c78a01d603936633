"""Audio in: a file path, raw file bytes or a float array, as mono float32 at a given rate."""

from __future__ import annotations

import importlib
import io
import os
from typing import Any

import numpy as np

Audio = str | os.PathLike | bytes | np.ndarray

RATES = (100, 1_000_000)
"""The sampling rates (Hz) of audio taken, the least and the most."""
MAX_SECONDS = 6 * 3600
"""The longest audio taken (6 hours), so that resampling and features stay in bounded memory."""


class AudioError(ValueError):
    """The audio cannot be used: unreadable, empty, silent, not finite, or of unknown rate."""


def _needs(package: str):
    """The module ``package`` of the ``audio`` extra, or ImportError saying how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ImportError(
            f"reading and resampling audio needs {package}: pip install 'transmuter_jax[audio]'"
        ) from None


def _read(source: str | os.PathLike | bytes) -> tuple[np.ndarray, int]:
    """The samples ([frames] or [frames, channels]) and rate of an audio file or its bytes."""
    soundfile = _needs("soundfile")

    what = "the audio bytes" if isinstance(source, bytes) else repr(os.fspath(source))
    handle = io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source)
    if not isinstance(source, bytes) and not os.path.isfile(handle):
        raise AudioError(f"no audio file {what}")
    try:
        samples, rate = soundfile.read(handle, dtype="float32", always_2d=False)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise AudioError(f"cannot read {what} as audio (wav, flac, ogg, mp3): {error}") from None
    return samples, int(rate)


def _mono(samples: np.ndarray) -> np.ndarray:
    """[frames] or [frames, channels] as [frames]: the mean of the channels."""
    if samples.ndim == 1:
        return samples
    if samples.ndim == 2:
        # soundfile gives [frames, channels]; an array of few rows and many columns is
        # [channels, frames] (as librosa and torchaudio give it)
        channels_first = samples.shape[0] < samples.shape[1] and samples.shape[0] <= 8
        return samples.mean(axis=0 if channels_first else 1)
    raise AudioError(f"audio is [samples] or [samples, channels], got shape {samples.shape}")


def _rate(value: Any, name: str) -> int:
    """A sampling rate in Hz: a whole number within :data:`RATES`, else AudioError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise AudioError(f"{name} is a number of Hz, got {value!r}")
    if not np.isfinite(value) or value != int(value):
        raise AudioError(f"{name} is a whole number of Hz, got {value!r}")
    if not RATES[0] <= int(value) <= RATES[1]:
        raise AudioError(f"{name} is {int(value):,} Hz, outside {RATES[0]:,} to {RATES[1]:,} Hz")
    return int(value)


def load(audio: Any, rate: int, sampling_rate: int | None = None) -> np.ndarray:
    """Mono float32 samples of ``audio`` at ``rate`` Hz.

    Args:
        audio: a file path (wav, flac, ogg, mp3), the bytes of such a file, or a float array
            of samples ([samples], or [samples, channels] / [channels, samples]).
        rate: the sampling rate the samples are wanted at (the feature extractor's).
        sampling_rate: the rate of an array; a file or bytes tell their own, and this must be
            None or agree with it.

    Returns:
        [samples] float32: the channels mixed to mono, resampled with soxr when the rate differs.

    Raises:
        AudioError: an unreadable file, an array without ``sampling_rate``, an empty input,
            samples that are not finite (NaN, inf), or silence only.
    """
    if sampling_rate is not None:
        sampling_rate = _rate(sampling_rate, "sampling_rate")
    if isinstance(audio, str | os.PathLike | bytes):
        samples, given = _read(audio)
        given = _rate(given, "the file's sampling rate")
        if sampling_rate is not None and sampling_rate != given:
            raise AudioError(f"the file is at {given} Hz, not sampling_rate={sampling_rate}")
    else:
        if sampling_rate is None:
            raise AudioError("an array of samples needs sampling_rate= (its rate in Hz)")
        try:
            samples = np.asarray(audio)
        except (TypeError, ValueError) as error:
            raise AudioError(f"audio is a path, bytes or a float array: {error}") from None
        if samples.dtype.kind != "f":
            raise AudioError(f"audio samples are floats in [-1, 1], got dtype {samples.dtype}")
        given = sampling_rate
    samples = _mono(np.asarray(samples))
    if samples.size == 0:
        raise AudioError("the audio is empty (no samples)")
    if not np.isfinite(samples).all():
        raise AudioError("the audio has NaN or infinite samples")
    if np.abs(samples).max() > np.finfo(np.float32).max:
        raise AudioError("the audio has samples beyond float32's range (floats in [-1, 1])")
    if len(samples) / given > MAX_SECONDS:
        raise AudioError(
            f"the audio lasts {len(samples) / given / 3600:.1f} h at {given} Hz, longer than the "
            f"limit of {MAX_SECONDS // 3600} h; cut it into parts"
        )
    if not np.any(samples):
        raise AudioError("the audio is silent (all samples are zero)")
    samples = samples.astype(np.float32)
    if given != rate:
        soxr = _needs("soxr")
        samples = soxr.resample(samples, given, rate).astype(np.float32)
    return samples


def duration(path: str | os.PathLike) -> float:
    """The length of the audio file ``path`` in seconds (read from its header)."""
    soundfile = _needs("soundfile")
    return float(soundfile.info(os.fspath(path)).duration)
