"""Audio in: a file path, raw file bytes or a float array, as mono float32 at a given rate.

The samples are read, mixed to mono and resampled a block at a time, so that memory holds the
result (4 bytes a sample at the model's rate: 230 MB an hour at 16 kHz) and one block, never
the whole input at its own rate and channels.
"""

from __future__ import annotations

import importlib
import io
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..runtime.paths import not_a_file

Audio = str | os.PathLike | bytes | np.ndarray

RATES = (100, 1_000_000)
"""The sampling rates (Hz) of audio taken, the least and the most."""
MAX_SECONDS = 6 * 3600
"""The longest audio taken (6 hours), so that resampling and features stay in bounded memory."""
BLOCK = 1 << 16
"""The frames read, mixed to mono and resampled at a time."""


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


def _open(source: str | os.PathLike | bytes) -> Any:
    """The opened sound file (``soundfile.SoundFile``) of a path or of a file's bytes."""
    soundfile = _needs("soundfile")

    what = "the audio bytes" if isinstance(source, bytes) else repr(os.fspath(source))
    handle = io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source)
    why = None if isinstance(source, bytes) else not_a_file(handle, "an audio")
    if why is not None:
        raise AudioError(why)
    try:
        return soundfile.SoundFile(handle)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise AudioError(f"cannot read {what} as audio (wav, flac, ogg, mp3): {error}") from None


def _file_blocks(sound: Any) -> Iterator[np.ndarray]:
    """The frames of an opened sound file, mixed to mono (the mean of the channels), in
    blocks."""
    soundfile = _needs("soundfile")
    while True:
        try:
            block = sound.read(BLOCK, dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError) as error:
            raise AudioError(f"cannot read the audio: {error}") from None
        if not len(block):
            return
        yield block[:, 0] if block.shape[1] == 1 else block.mean(axis=1)


def _array_blocks(samples: np.ndarray) -> Iterator[np.ndarray]:
    """The frames of an array of samples ([frames], [frames, channels] or [channels, frames]:
    few rows of many columns, as librosa and torchaudio give it), mixed to mono, in blocks."""
    if samples.ndim not in (1, 2):
        raise AudioError(f"audio is [samples] or [samples, channels], got shape {samples.shape}")
    first = samples.ndim == 2 and _channels_first(samples)
    frames = samples.shape[1] if first else len(samples)
    for start in range(0, frames, BLOCK):
        if samples.ndim == 1:
            yield samples[start : start + BLOCK]
        elif first:
            yield samples[:, start : start + BLOCK].mean(axis=0)
        else:
            yield samples[start : start + BLOCK].mean(axis=1)


def _channels_first(samples: np.ndarray) -> bool:
    """Whether a 2-D array of samples is [channels, frames] rather than [frames, channels]."""
    return samples.shape[0] < samples.shape[1] and samples.shape[0] <= 8


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
        [samples] float32: the channels mixed to mono, resampled with soxr when the rate differs
        (its stream, a block at a time, which gives what its one-shot resampling gives).

    Raises:
        AudioError: an unreadable file, an array without ``sampling_rate``, an empty input,
            samples that are not finite (NaN, inf), silence only, or more than
            :data:`MAX_SECONDS` (refused from a file's header before its samples are read).
    """
    if sampling_rate is not None:
        sampling_rate = _rate(sampling_rate, "sampling_rate")
    if isinstance(audio, str | os.PathLike | bytes):
        with _open(audio) as sound:
            given = _rate(sound.samplerate, "the file's sampling rate")
            if sampling_rate is not None and sampling_rate != given:
                raise AudioError(f"the file is at {given} Hz, not sampling_rate={sampling_rate}")
            return _mono_at(_file_blocks(sound), max(int(sound.frames), 0), given, rate)
    if sampling_rate is None:
        raise AudioError("an array of samples needs sampling_rate= (its rate in Hz)")
    try:
        samples = np.asarray(audio)
    except (TypeError, ValueError) as error:
        raise AudioError(f"audio is a path, bytes or a float array: {error}") from None
    if samples.dtype.kind != "f":
        raise AudioError(f"audio samples are floats in [-1, 1], got dtype {samples.dtype}")
    frames = samples.shape[1] if samples.ndim == 2 and _channels_first(samples) else len(samples)
    return _mono_at(_array_blocks(samples), frames, sampling_rate, rate)


def _too_long(frames: int, given: int) -> None:
    """Refuses audio of more than :data:`MAX_SECONDS`."""
    if frames / given > MAX_SECONDS:
        raise AudioError(
            f"the audio lasts {frames / given / 3600:.1f} h at {given} Hz, longer than the "
            f"limit of {MAX_SECONDS // 3600} h; cut it into parts"
        )


def _mono_at(blocks: Iterator[np.ndarray], frames: int, given: int, rate: int) -> np.ndarray:
    """The mono ``blocks`` (``frames`` samples, as far as known) as float32 resampled from
    ``given`` to ``rate`` Hz block by block, checked as they come."""
    _too_long(frames, given)
    stream = None
    if given != rate:
        stream = _needs("soxr").ResampleStream(given, rate, 1, dtype="float32")
    out = np.empty(math.ceil(frames * rate / given) + 2 if frames else BLOCK, np.float32)
    filled, read, sound = 0, 0, False
    largest = float(np.finfo(np.float32).max)
    for mono in blocks:
        if not np.isfinite(mono).all():
            raise AudioError("the audio has NaN or infinite samples")
        if mono.size and np.abs(mono).max() > largest:
            raise AudioError("the audio has samples beyond float32's range (floats in [-1, 1])")
        read += len(mono)
        _too_long(read, given)
        sound = sound or bool(np.any(mono))
        mono = mono.astype(np.float32)
        piece = mono if stream is None else stream.resample_chunk(mono, last=False)
        out, filled = _put(out, filled, piece)
    if not read:
        raise AudioError("the audio is empty (no samples)")
    if not sound:
        raise AudioError("the audio is silent (all samples are zero)")
    if stream is not None:
        out, filled = _put(out, filled, stream.resample_chunk(np.zeros(0, np.float32), last=True))
    return out[:filled]


def _put(out: np.ndarray, filled: int, piece: np.ndarray) -> tuple[np.ndarray, int]:
    """``piece`` written into ``out`` after its first ``filled`` samples (grown when full)."""
    if filled + len(piece) > len(out):
        grown = np.empty(max(2 * len(out), filled + len(piece)), np.float32)
        grown[:filled] = out[:filled]
        out = grown
    out[filled : filled + len(piece)] = piece
    return out, filled + len(piece)


def duration(path: str | os.PathLike) -> float:
    """The length of the audio file ``path`` in seconds (read from its header)."""
    soundfile = _needs("soundfile")
    return float(soundfile.info(os.fspath(path)).duration)
