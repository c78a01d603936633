"""Helpers shared by the op implementations."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import numpy as np

from ... import kernels
from .. import provenance
from ..dtypes import device_dtype, np_dtype
from ..fold import xp  # noqa: F401  (re-exported for the op modules)


def ints(value: Any) -> list[int]:
    """A static integer array (shape, axes, pads) as a list of Python ints."""
    return [int(v) for v in np.asarray(value).reshape(-1)]


def transposed(value: Any, perm: Any) -> Any:
    """``value`` with its axes in the order ``perm``; a projection split into heads (Reshape,
    onnx.provenance) put head-major ([B, T, N, H] -> [B, N, T, H]) by kernels.swap_axes where it
    runs: one copy that every reader shares (XLA:CPU copied it once for a graph output and once
    more for each kernel reading it). Other transposes stay XLA's, which fuses or cancels them."""
    m = xp(value)
    perm = None if perm is None else tuple(int(p) for p in perm)
    if m is not np and perm == (0, 2, 1, 3) and provenance.split(value):
        out = kernels.swap_axes(value)
        if out is not None:
            return out
    return m.transpose(value, perm)


def onnx_dtype(to: int, module: ModuleType = np) -> np.dtype:
    """The dtype of ONNX element type ``to``; with jax.numpy, the device dtype."""
    dtype = np_dtype(to)
    return dtype if module is np else device_dtype(dtype)


def precision() -> jax.lax.Precision | None:
    """The precision of float matrix products: full float32 everywhere.

    On CPU the default already is full float32 (and asking for HIGHEST picks a slower kernel); on
    GPU and TPU the default may round the inputs to TF32 or bfloat16, so ask for HIGHEST there.
    """
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST


# Up to this many batch rows, write_rows updates the buffer with one slice update per row, which
# XLA does in place; more rows use one scatter (XLA copies the buffer around it).
UNROLLED_ROWS = 32


def write_rows(buffer: jax.Array, block: jax.Array, start: jax.Array, axis: int) -> jax.Array:
    """``buffer`` [B, ...] with ``block`` [B, ...] written at index ``start[b]`` of ``axis`` in
    each batch row b (clamped so that the block fits, as dynamic_update_slice does)."""
    block = block.astype(buffer.dtype)
    start = jax.numpy.asarray(start, np.int32)
    zeros = [np.int32(0)] * (buffer.ndim - 1)
    if buffer.shape[0] <= UNROLLED_ROWS:
        for b in range(buffer.shape[0]):
            at = [np.int32(b), *zeros]
            at[axis] = start[b]
            buffer = jax.lax.dynamic_update_slice(buffer, block[b : b + 1], at)
        return buffer

    def one(rows, new, first):
        at = list(zeros)
        at[axis - 1] = first
        return jax.lax.dynamic_update_slice(rows, new, at)

    return jax.vmap(one)(buffer, block, start)
