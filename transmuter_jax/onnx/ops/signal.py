"""Signal ops: DFT, STFT, the Hann, Hamming and Blackman windows and MelWeightMatrix.

Signals carry a last axis of size 1 (real) or 2 (real, imaginary), as in the spec.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..registry import op
from ._util import ints, onnx_dtype, precision


def _complex(x):
    """[..., 1] real or [..., 2] (real, imaginary) -> complex [...]."""
    x = jnp.asarray(x).astype(jnp.float32)
    if x.shape[-1] == 1:
        return x[..., 0].astype(jnp.complex64)
    return x[..., 0] + 1j * x[..., 1]


def _pair(z, dtype):
    """complex [...] -> [..., 2] (real, imaginary) of ``dtype``."""
    return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1).astype(dtype)


# Up to this length a DFT is one product with a table of cos/sin computed in float64, which
# keeps the exact zeros of the float64 result (an FFT in float32 leaves ~1e-6 there).
TABLE_LENGTH = 2048


def _table(n, length, bins, inverse):
    """The DFT matrix [n, bins] (complex64) from the first n inputs to the first bins outputs."""
    k = np.arange(bins)[None, :]
    t = np.arange(n)[:, None]
    angle = (2 if inverse else -2) * np.pi * ((t * k) % length) / length
    table = np.exp(1j * angle) / (length if inverse else 1)
    return table.astype(np.complex64)


def _dft(x, length, axis, inverse, onesided):
    """The DFT of x along ``axis`` (an axis of x, not the last), as the spec defines it."""
    dtype = jnp.asarray(x).dtype
    axis = axis % np.ndim(x)
    if length is None:
        length = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    z = _complex(x)
    if length <= TABLE_LENGTH and not (inverse and onesided):
        n = min(z.shape[axis], length)
        bins = length // 2 + 1 if onesided and not inverse else length
        z = jnp.moveaxis(jnp.take(z, jnp.arange(n), axis=axis), axis, -1)
        out = jnp.matmul(z, _table(n, length, bins, inverse), precision=precision())
        return _pair(jnp.moveaxis(out, -1, axis), dtype)
    if inverse and onesided:
        return jnp.fft.irfft(z, n=length, axis=axis)[..., None].astype(dtype)
    if inverse:
        return _pair(jnp.fft.ifft(z, n=length, axis=axis), dtype)
    out = jnp.fft.fft(z, n=length, axis=axis)
    if onesided:
        out = jnp.take(out, jnp.arange(length // 2 + 1), axis=axis)
    return _pair(out, dtype)


def _length(dft_length):
    return None if dft_length is None else ints(dft_length)[0]


@op("DFT", since=17, static=(1,))
def DFT_17(input, dft_length=None, *, axis=1, inverse=0, onesided=0):
    """The discrete Fourier transform along ``axis`` (opsets 17-19)."""
    return _dft(input, _length(dft_length), axis, inverse, onesided)


@op("DFT", since=20, static=(1, 2))
def DFT(input, dft_length=None, axis=None, *, inverse=0, onesided=0):
    """The discrete Fourier transform along the ``axis`` input (default -2)."""
    along = -2 if axis is None else ints(axis)[0]
    return _dft(input, _length(dft_length), along, inverse, onesided)


@op("STFT", since=17, static=(1, 3))
def STFT(signal, frame_step, window=None, frame_length=None, *, onesided=1):
    """Short-time Fourier transform of signal [B, T, 1|2]: frames of ``frame_length`` every
    ``frame_step`` samples, times ``window`` -> [B, frames, bins, 2]."""
    step = ints(frame_step)[0]
    if frame_length is not None:
        size = ints(frame_length)[0]
    else:
        size = window.shape[0] if window is not None else signal.shape[-2]
    signal = jnp.asarray(signal)
    count = 1 + (signal.shape[-2] - size) // step
    starts = np.arange(count)[:, None] * step + np.arange(size)[None, :]  # [frames, size]
    frames = signal[:, starts]  # [B, frames, size, 1|2]
    if window is not None:
        frames = frames * jnp.asarray(window).astype(frames.dtype)[:, None]
    return _dft(frames, size, -2, 0, onesided)


def _window(size, periodic, output_datatype, terms):
    """sum_k a_k cos(2 pi k n / N) for n < size (N = size if periodic else size - 1)."""
    count = ints(size)[0]
    n = np.arange(count, dtype=np.float64)
    span = count if periodic else count - 1
    out = sum(a * np.cos(2 * math.pi * k * n / span) for k, a in enumerate(terms))
    return np.asarray(out).astype(onnx_dtype(output_datatype))


@op("HannWindow", since=17, static=(0,))
def HannWindow(size, *, output_datatype=1, periodic=1):
    """sin^2(pi n / N)."""
    return _window(size, periodic, output_datatype, (0.5, -0.5))


@op("HammingWindow", since=17, static=(0,))
def HammingWindow(size, *, output_datatype=1, periodic=1):
    """25/46 - 21/46 cos(2 pi n / N)."""
    return _window(size, periodic, output_datatype, (25 / 46, -21 / 46))


@op("BlackmanWindow", since=17, static=(0,))
def BlackmanWindow(size, *, output_datatype=1, periodic=1):
    """0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)."""
    return _window(size, periodic, output_datatype, (0.42, -0.5, 0.08))


def _mel(hertz):
    return 2595 * np.log1p(hertz / 700) / np.log(10)


@op("MelWeightMatrix", since=17, static=(0, 1, 2, 3, 4))
def MelWeightMatrix(
    num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz, *, output_datatype=1
):
    """Triangular filters [dft_length / 2 + 1, num_mel_bins], evenly spaced on the mel scale
    between the edges, on the DFT bins (as the spec's reference computes them)."""
    mels, length = ints(num_mel_bins)[0], ints(dft_length)[0]
    rate = float(np.asarray(sample_rate).reshape(-1)[0])
    low = _mel(float(np.asarray(lower_edge_hertz).reshape(-1)[0]))
    high = _mel(float(np.asarray(upper_edge_hertz).reshape(-1)[0]))
    points = np.arange(mels + 2) * ((high - low) / (mels + 2)) + low
    hertz = 700 * np.expm1(points / 2595 * np.log(10))
    bins = (((length + 1) * hertz) // rate).astype(int)
    out = np.zeros((length // 2 + 1, mels))
    for i in range(mels):
        left, center, right = bins[i], bins[i + 1], bins[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            j = np.arange(left, center + 1)
            out[j, i] = (j - left) / (center - left)
        if right > center:
            j = np.arange(center, right)
            out[j, i] = (right - j) / (right - center)
    return out.astype(onnx_dtype(output_datatype))
