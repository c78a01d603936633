"""Indexing ops: Gather*, Scatter*, OneHot, NonZero, Compress and Unique.

Negative indices count from the end of their axis; they are wrapped explicitly, since jnp.take
and friends clamp or fill them. NonZero, Compress and Unique give shapes that depend on values:
the values they read are static inputs, so a traced one raises DynamicShapeError naming the node.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..registry import op
from ._util import ints, write_rows, xp


def _wrap(m, indices, size):
    return m.where(indices < 0, indices + size, indices)


def _index_dtype(m):
    return np.int64 if m is np else jnp.int32


def _along(m, indices, axis):
    """The full index tuple addressing element ``indices[i]`` along ``axis`` of position i."""
    grid = list(m.indices(indices.shape, sparse=True))
    grid[axis] = indices
    return tuple(grid)


def _scatter(m, data, index, updates, reduction):
    """``data`` with ``updates`` written (or combined by ``reduction``) at ``index``."""
    if m is np:
        out = np.array(data, copy=True)
        if reduction == "none":
            out[index] = updates
        else:
            ufunc = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
            ufunc[reduction].at(out, index, updates)
        return out
    at = jnp.asarray(data).at[index]
    method = {"none": at.set, "add": at.add, "mul": at.multiply, "max": at.max, "min": at.min}
    return method[reduction](jnp.asarray(updates, data.dtype))


@op("Gather")
def Gather(data, indices, *, axis=0):
    m = xp(data, indices)
    return m.take(data, _wrap(m, indices, data.shape[axis]), axis=axis)


@op("GatherElements", since=11)
def GatherElements(data, indices, *, axis=0):
    m = xp(data, indices)
    axis %= data.ndim
    data = m.asarray(data)  # a numpy table indexed by traced indices indexes as JAX
    return data[_along(m, _wrap(m, indices, data.shape[axis]), axis)]


@op("GatherND", since=11)
def GatherND(data, indices, *, batch_dims=0):
    """Index tuples in the last axis of ``indices``, per batch of the first ``batch_dims`` axes."""
    m = xp(data, indices)
    b, k = batch_dims, indices.shape[-1]
    count = math.prod(data.shape[:b])
    # m.asarray: jnp.reshape keeps a numpy table numpy, which traced indices cannot index
    flat = m.reshape(m.asarray(data), (count,) + data.shape[b:])
    index = m.reshape(indices, (count, math.prod(indices.shape[b:-1]), k))
    index = _wrap(m, index, np.asarray(data.shape[b : b + k], np.int64))
    batch = m.arange(count)[:, None]
    out = flat[(batch,) + tuple(index[..., j] for j in range(k))]
    return m.reshape(out, indices.shape[:-1] + data.shape[b + k :])


@op("ScatterND", since=11)
def ScatterND(data, indices, updates, *, reduction="none"):
    m = xp(data, indices, updates)
    k = indices.shape[-1]
    index = _wrap(m, indices, np.asarray(data.shape[:k], np.int64))
    return _scatter(m, data, tuple(index[..., j] for j in range(k)), updates, reduction)


@op("ScatterElements", since=11)
def ScatterElements(data, indices, updates, *, axis=0, reduction="none"):
    m = xp(data, indices, updates)
    axis %= data.ndim
    index = _along(m, _wrap(m, indices, data.shape[axis]), axis)
    return _scatter(m, data, index, updates, reduction)


@op("Scatter", since=9)
def Scatter(data, indices, updates, *, axis=0):
    """The deprecated name of ScatterElements (opsets 9 and 10)."""
    return ScatterElements(data, indices, updates, axis=axis)


@op("OneHot", since=9, static=(1,))
def OneHot(indices, depth, values, *, axis=-1):
    """``values[1]`` where the (wrapped, truncated to integer) index equals the position along
    the new axis, else ``values[0]``; out-of-range indices give a row of ``values[0]``."""
    m = xp(indices, values)
    depth = ints(depth)[0]
    axis %= indices.ndim + 1
    index = _wrap(m, m.asarray(indices).astype(_index_dtype(m)), depth)
    positions = np.arange(depth).reshape((-1,) + (1,) * (indices.ndim - axis))
    hot = m.expand_dims(index, axis) == positions
    return m.where(hot, values[1], values[0])


@op("NonZero", since=9, static=(0,))
def NonZero(x):
    return np.argwhere(np.asarray(x)).T.astype(np.int64)


@op("Compress", since=9, static=(1,))
def Compress(data, condition, *, axis=None):
    m = xp(data)
    kept = np.flatnonzero(np.asarray(condition))
    if axis is None:
        return m.take(m.reshape(data, (-1,)), kept)
    return m.take(data, kept, axis=axis)


@op("Unique", since=11, static=(0,))
def Unique(x, *, axis=None, sorted=1):  # noqa: A002 - the ONNX attribute's name
    """Y, indices (first occurrences), inverse_indices and counts; unsorted keeps the order of
    first occurrence."""
    x = np.asarray(x)
    y, first, inverse, counts = np.unique(
        x, return_index=True, return_inverse=True, return_counts=True, axis=axis
    )
    inverse = inverse.reshape(-1)
    if not sorted:
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        y = np.take(y, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return y, *(a.astype(np.int64) for a in (first, inverse, counts))


@op("TensorScatter", since=24)
def TensorScatter(past_cache, update, write_indices=None, *, mode="linear", axis=-2):
    """past_cache [B, ..., L, ...] with update [B, ..., S, ...] written along ``axis`` from row
    write_indices[b] of each batch row b (0 without), wrapping around in ``circular`` mode."""
    cache, update = jnp.asarray(past_cache), jnp.asarray(update)
    b, axis = cache.shape[0], axis % cache.ndim
    starts = jnp.zeros((b,), jnp.int32)
    if write_indices is not None:
        starts = jnp.asarray(write_indices).astype(jnp.int32).reshape(b)
    if mode == "linear":
        return write_rows(cache, update, starts, axis=axis)
    length, count = cache.shape[axis], update.shape[axis]
    rows = (starts[:, None] + jnp.arange(count)[None, :]) % length  # [B, S]
    moved = jnp.moveaxis(cache, axis, 1)
    new = jnp.moveaxis(update, axis, 1)
    index = [jnp.arange(b)[:, None], rows] + [slice(None)] * (moved.ndim - 2)
    return jnp.moveaxis(moved.at[tuple(index)].set(new.astype(moved.dtype)), 1, axis)


@op("ReverseSequence", since=10)
def ReverseSequence(input, sequence_lens, *, batch_axis=1, time_axis=0):
    """Reverses the first sequence_lens[b] entries along ``time_axis`` of each batch entry b."""
    m = xp(input, sequence_lens)
    x = m.asarray(input)
    lens = m.asarray(sequence_lens).astype(np.int32)
    t = m.arange(x.shape[time_axis], dtype=np.int32)
    shape = [1] * x.ndim
    shape[time_axis] = x.shape[time_axis]
    t = t.reshape(shape)
    shape = [1] * x.ndim
    shape[batch_axis] = x.shape[batch_axis]
    n = lens.reshape(shape)
    source = m.where(t < n, n - 1 - t, t)
    source = m.broadcast_to(source, x.shape)
    return m.take_along_axis(x, source, axis=time_axis)


@op("TfIdfVectorizer", since=9)
def TfIdfVectorizer(
    X,
    *,
    max_gram_length,
    max_skip_count,
    min_gram_length,
    mode,
    ngram_counts,
    ngram_indexes,
    pool_int64s=None,
    pool_strings=None,
    weights=None,
):
    """Counts of the pool's n-grams (n in [min, max], items ``skip + 1`` apart for each skip up
    to max_skip_count; 1-grams once) in each row of X [C] or [B, C], as TF, IDF or TFIDF
    [B, max(ngram_indexes) + 1] float32 (columns by ngram_indexes, weights by column)."""
    if pool_int64s is None:
        raise NotImplementedError("TfIdfVectorizer on strings")
    x = jnp.asarray(X).astype(jnp.int32)
    rows = x if x.ndim == 2 else x[None]
    length = rows.shape[-1]
    bounds = [*ngram_counts, len(pool_int64s)]
    size = max(ngram_indexes) + 1
    out = jnp.zeros((rows.shape[0], size), jnp.float32)
    k = 0
    for n in range(1, len(ngram_counts) + 1):
        pool = list(pool_int64s[bounds[n - 1] : bounds[n]])
        for start in range(0, len(pool), n):
            gram, column = pool[start : start + n], ngram_indexes[k]
            k += 1
            if not min_gram_length <= n <= max_gram_length:
                continue
            count = 0
            for distance in range(1, (max_skip_count + 1 if n > 1 else 1) + 1):
                starts = length - distance * (n - 1)
                if starts <= 0:
                    continue
                hit = jnp.ones((rows.shape[0], starts), bool)
                for j, item in enumerate(gram):
                    hit = hit & (rows[:, j * distance : j * distance + starts] == item)
                count = count + jnp.sum(hit, axis=-1)
            out = out.at[:, column].add(count)
    w = jnp.ones((size,), jnp.float32) if not weights else jnp.asarray(weights, jnp.float32)
    if mode == "IDF":
        out = jnp.where(out > 0, w, 0.0)
    elif mode == "TFIDF":
        out = out * w
    return out if x.ndim == 2 else out[0]


@op("ArrayFeatureExtractor", domain="ai.onnx.ml")
def ArrayFeatureExtractor(X, Y):
    """The entries Y of the last axis of X (a 1-D X gives [1, len(Y)])."""
    m = xp(X, Y)
    out = m.take(X, m.asarray(Y).reshape(-1).astype(np.int32), axis=-1)
    return out.reshape(1, -1) if np.ndim(X) == 1 else out
