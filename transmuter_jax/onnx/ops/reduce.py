"""Reductions (ReduceSum, ..., ArgMax, ArgMin), CumSum and TopK.

The Reduce ops take ``axes`` as an attribute (before opset 13 for ReduceSum, 18 for the others)
or as a static input; the same parameter receives either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..registry import op
from ._util import ints, xp


def _reduce(fn, data, axes, keepdims, noop_with_empty_axes, **kwargs):
    """``fn(data, axis=..., keepdims=...)`` over ``axes``; all axes when none are given, unless
    ``noop_with_empty_axes`` makes that the identity."""
    axes = ints(axes) if axes is not None else []
    if not axes and noop_with_empty_axes:
        return data
    axis = tuple(a % max(np.ndim(data), 1) for a in axes) if axes else None
    return fn(data, axis=axis, keepdims=bool(keepdims), **kwargs)


def _input(data):
    """The module for ``data`` and ``data`` in it: with jax.numpy, in its device dtype."""
    m = xp(data)
    return m, m.asarray(data)


def _initial(dtype, largest):
    """The largest (or lowest) value of ``dtype``: what min (or max) gives for an empty set."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return bool(largest)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return info.max if largest else info.min
    return np.inf if largest else -np.inf


@op("ReduceSum", static=(1,))
def ReduceSum(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    m, data = _input(data)
    return _reduce(m.sum, data, axes, keepdims, noop_with_empty_axes, dtype=data.dtype)


@op("ReduceMean", static=(1,))
def ReduceMean(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    m, data = _input(data)
    return _reduce(m.mean, data, axes, keepdims, noop_with_empty_axes).astype(data.dtype)


@op("ReduceMax", static=(1,))
def ReduceMax(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    """An empty set gives the lowest value of the dtype (-inf for floats)."""
    m, data = _input(data)
    initial = _initial(data.dtype, largest=False)
    return _reduce(m.max, data, axes, keepdims, noop_with_empty_axes, initial=initial)


@op("ReduceMin", static=(1,))
def ReduceMin(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    """An empty set gives the highest value of the dtype (inf for floats)."""
    m, data = _input(data)
    initial = _initial(data.dtype, largest=True)
    return _reduce(m.min, data, axes, keepdims, noop_with_empty_axes, initial=initial)


@op("ReduceProd", static=(1,))
def ReduceProd(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    m, data = _input(data)
    return _reduce(m.prod, data, axes, keepdims, noop_with_empty_axes, dtype=data.dtype)


@op("ReduceL1", static=(1,))
def ReduceL1(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    m, data = _input(data)
    x = m.abs(data)
    return _reduce(m.sum, x, axes, keepdims, noop_with_empty_axes, dtype=data.dtype)


@op("ReduceL2", static=(1,))
def ReduceL2(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    m, data = _input(data)
    x = _reduce(m.sum, data * data, axes, keepdims, noop_with_empty_axes, dtype=data.dtype)
    return m.sqrt(x).astype(data.dtype)


@op("ReduceSumSquare", static=(1,))
def ReduceSumSquare(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    m, data = _input(data)
    return _reduce(m.sum, data * data, axes, keepdims, noop_with_empty_axes, dtype=data.dtype)


@op("ReduceLogSum", static=(1,))
def ReduceLogSum(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    m, data = _input(data)
    x = _reduce(m.sum, data, axes, keepdims, noop_with_empty_axes, dtype=data.dtype)
    return m.log(x).astype(data.dtype)


@op("ReduceLogSumExp", static=(1,))
def ReduceLogSumExp(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    """Computed stably (the maximum is subtracted before exponentiating)."""
    x = jnp.asarray(data)
    if x.size == 0:
        x = _reduce(jnp.sum, x, axes, keepdims, noop_with_empty_axes)
        return jnp.log(x).astype(data.dtype)
    fn = jax.scipy.special.logsumexp
    return _reduce(fn, x, axes, keepdims, noop_with_empty_axes).astype(data.dtype)


def _arg(fn, data, axis, keepdims, select_last_index):
    m = xp(data)
    if select_last_index:
        last = data.shape[axis] - 1
        index = last - fn(m.flip(data, axis), axis=axis)
    else:
        index = fn(data, axis=axis)
    index = index.astype(np.int64) if m is np else index
    return m.expand_dims(index, axis) if keepdims else index


@op("ArgMax")
def ArgMax(data, *, axis=0, keepdims=1, select_last_index=0):
    """The first index of the maximum, or the last with ``select_last_index``."""
    return _arg(xp(data).argmax, data, axis, keepdims, select_last_index)


@op("ArgMin")
def ArgMin(data, *, axis=0, keepdims=1, select_last_index=0):
    """The first index of the minimum, or the last with ``select_last_index``."""
    return _arg(xp(data).argmin, data, axis, keepdims, select_last_index)


def _cumulative(fn, x, axis, exclusive, reverse, identity):
    """``fn`` (cumsum, cumprod) along ``axis``; ``exclusive`` leaves out each element itself
    (``identity`` first); ``reverse`` runs from the end."""
    (m, x), axis = _input(x), ints(axis)[0] % max(np.ndim(x), 1)
    if reverse:
        x = m.flip(x, axis)
    y = getattr(m, fn)(x, axis=axis, dtype=x.dtype)
    if exclusive:
        pad = [(0, 0)] * np.ndim(x)
        pad[axis] = (1, 0)
        y = m.pad(y, pad, constant_values=identity)[
            tuple(slice(0, -1) if i == axis else slice(None) for i in range(np.ndim(x)))
        ]
    return m.flip(y, axis) if reverse else y


@op("CumSum", since=11, static=(1,))
def CumSum(x, axis, *, exclusive=0, reverse=0):
    """``exclusive`` leaves out each element itself; ``reverse`` sums from the end."""
    return _cumulative("cumsum", x, axis, exclusive, reverse, 0)


@op("CumProd", since=26, static=(1,))
def CumProd(x, axis, *, exclusive=0, reverse=0):
    """``exclusive`` leaves out each element itself; ``reverse`` multiplies from the end."""
    return _cumulative("cumprod", x, axis, exclusive, reverse, 1)


@op("TopK", static=(1,))
def TopK(x, k, *, axis=-1, largest=1, sorted=1):
    """The ``k`` largest (or smallest) along ``axis``, sorted; ties keep the lower index first.

    Before opset 10 ``k`` is an attribute. Results are always sorted, also with ``sorted=0``.
    """
    x = jnp.moveaxis(jnp.asarray(x), axis, -1)
    key = x if largest else (~x if jnp.issubdtype(x.dtype, jnp.integer) else -x)
    _, indices = jax.lax.top_k(key, ints(k)[0])
    values = jnp.take_along_axis(x, indices, axis=-1)
    return jnp.moveaxis(values, -1, axis), jnp.moveaxis(indices, -1, axis)
