"""Shape ops: Shape, Reshape, Concat, Unsqueeze, Squeeze, Transpose, Expand, Slice, Pad, Resize, ...

Attributes that later opsets turned into inputs (Squeeze axes, Slice starts, Pad pads, Split split,
Upsample scales) share one function: the attribute arrives as the keyword of the same name.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .. import provenance
from ..dtypes import device_dtype
from ..registry import op
from ._util import ints, onnx_dtype, transposed, xp


def _axes(axes, rank: int) -> list[int]:
    return [a % rank if rank else a for a in ints(axes)]


@op("Shape")
def Shape(x, *, start=0, end=None):
    return np.asarray(np.shape(x)[start:end], dtype=np.int64)


@op("Size")
def Size(x):
    return np.asarray(math.prod(np.shape(x)), dtype=np.int64)


@op("Reshape", since=5, static=(1,))
def Reshape(x, shape, *, allowzero=0):
    target = ints(shape)
    if not allowzero:
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    out = xp(x).reshape(x, target)
    provenance.reshaped(out, x)
    return out


@op("Flatten")
def Flatten(x, *, axis=1):
    axis = axis + x.ndim if axis < 0 else axis
    return xp(x).reshape(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


@op("Concat")
def Concat(*inputs, axis=1):
    out = xp(*inputs).concatenate(inputs, axis=axis)
    provenance.concatenated(out, inputs, axis)
    return out


@op("Unsqueeze", static=(1,))
def Unsqueeze(data, axes=None):
    where = _axes(axes, data.ndim + len(ints(axes)))
    out = xp(data).expand_dims(data, tuple(where))
    provenance.unsqueezed(out, data, where)
    return out


@op("Squeeze", static=(1,))
def Squeeze(data, axes=None):
    m = xp(data)
    if axes is None or np.size(axes) == 0:
        return m.squeeze(data)
    return m.squeeze(data, axis=tuple(_axes(axes, data.ndim)))


@op("Transpose")
def Transpose(data, *, perm=None, ctx):
    """A head split the graph returns (a present's keys or values) is copied once, for the
    output and the products that read it alike (ops._util.transposed); others stay XLA's."""
    if any(o.name == ctx.node.output[0] for o in ctx.graph.proto.output):
        return transposed(data, perm)
    return xp(data).transpose(data, None if perm is None else tuple(perm))


@op("Expand", since=8, static=(1,))
def Expand(x, shape):
    """Broadcasts ``x`` and ``shape`` against each other (a 1 in ``shape`` keeps x's dim)."""
    out = xp(x).broadcast_to(x, np.broadcast_shapes(np.shape(x), tuple(ints(shape))))
    provenance.expanded(out, x)
    return out


@op("Tile", since=6, static=(1,))
def Tile(x, repeats):
    return xp(x).tile(x, ints(repeats))


@op("Split", static=(1,))
def Split(x, split=None, *, axis=0, num_outputs=None, ctx):
    """Sizes from ``split`` (input or attribute), else ``num_outputs`` chunks of ceil(dim / n)
    with a smaller last one, else equal parts, one per output."""
    dim = x.shape[axis]
    if split is not None and np.size(split):
        sizes = ints(split)
    else:
        n = num_outputs or ctx.num_outputs
        chunk = -(-dim // n)
        sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
    return tuple(xp(x).split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis))


@op("Slice", static=(1, 2, 3, 4))
def Slice(data, starts=None, ends=None, axes=None, steps=None):
    """Starts and ends clamp as the spec says (Python's ``slice.indices``): INT64_MAX or any
    end past the dim runs to the end, for negative steps too."""
    starts, ends = ints(starts), ints(ends)
    axes = range(len(starts)) if axes is None else _axes(axes, data.ndim)
    steps = [1] * len(starts) if steps is None else ints(steps)
    index = [slice(None)] * data.ndim
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
        start, end, step = slice(start, end, step).indices(data.shape[axis])
        index[axis] = slice(start, end if end >= 0 else None, step)
    return data[tuple(index)]


@op("Pad", since=2, static=(1, 3))
def Pad(data, pads=None, constant_value=None, axes=None, *, mode="constant", value=0.0):
    """``pads`` is [begin of each axis..., end of each axis...]; negative pads crop."""
    m = xp(data, constant_value)
    axes = range(data.ndim) if axes is None else _axes(axes, data.ndim)
    pads = ints(pads)
    n = len(pads) // 2
    width = [(0, 0)] * data.ndim
    for i, axis in enumerate(axes):
        width[axis] = (pads[i], pads[n + i])
    data = data[
        tuple(
            slice(max(-b, 0), d - max(-e, 0)) for (b, e), d in zip(width, data.shape, strict=True)
        )
    ]
    width = [(max(b, 0), max(e, 0)) for b, e in width]
    if mode != "constant":
        return m.pad(data, width, mode=mode)  # reflect, edge and wrap: numpy's names
    fill = value if constant_value is None else m.reshape(constant_value, ())
    return m.pad(data, width, constant_values=m.asarray(fill).astype(data.dtype))


@op("ConstantOfShape", since=9, static=(0,))
def ConstantOfShape(shape, *, value=None):
    value = np.zeros(1, np.float32) if value is None else np.asarray(value)
    m = xp()
    dtype = value.dtype if m is np else device_dtype(value.dtype)
    return m.full(ints(shape), value.reshape(-1)[0].astype(dtype), dtype=dtype)


@op("Range", since=11, static=(0, 1, 2))
def Range(start, limit, delta):
    """max(ceil((limit - start) / delta), 0) values start + i * delta, of start's dtype."""
    start, limit, delta = (np.asarray(v).reshape(()) for v in (start, limit, delta))
    count = max(int(np.ceil((limit.astype(np.float64) - start) / delta)), 0)
    m = xp()
    dtype = start.dtype if m is np else device_dtype(start.dtype)
    return (m.arange(count, dtype=dtype) * delta.astype(dtype) + start.astype(dtype)).astype(dtype)


@op("EyeLike", since=9)
def EyeLike(x, *, dtype=None, k=0):
    out = np.dtype(x.dtype) if dtype is None else onnx_dtype(dtype, xp(x))
    return np.eye(x.shape[0], x.shape[1], k, dtype=out)


@op("Trilu", since=14, static=(1,))
def Trilu(x, k=None, *, upper=1):
    k = 0 if k is None else ints(k)[0]
    m = xp(x)
    return m.triu(x, k) if upper else m.tril(x, k)


@op("DepthToSpace")
def DepthToSpace(x, *, blocksize, mode="DCR"):
    m = xp(x)
    b, c, h, w = x.shape
    s = blocksize
    if mode == "DCR":
        y = m.transpose(m.reshape(x, (b, s, s, c // s**2, h, w)), (0, 3, 4, 1, 5, 2))
    else:
        y = m.transpose(m.reshape(x, (b, c // s**2, s, s, h, w)), (0, 1, 4, 2, 5, 3))
    return m.reshape(y, (b, c // s**2, h * s, w * s))


@op("SpaceToDepth")
def SpaceToDepth(x, *, blocksize, mode="DCR"):
    """The inverse of DepthToSpace (``mode`` from opset 28)."""
    m = xp(x)
    b, c, h, w = x.shape
    s = blocksize
    perm = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
    y = m.transpose(m.reshape(x, (b, c, h // s, s, w // s, s)), perm)
    return m.reshape(y, (b, c * s * s, h // s, w // s))


@op("CenterCropPad", since=18, static=(1,))
def CenterCropPad(data, shape, *, axes=None):
    """Crops or zero-pads each axis to ``shape`` around the centre (the extra one at the end)."""
    m = xp(data)
    axes = range(data.ndim) if axes is None else _axes(axes, data.ndim)
    crop = [slice(None)] * data.ndim
    width = [(0, 0)] * data.ndim
    for axis, size in zip(axes, ints(shape), strict=True):
        dim = data.shape[axis]
        if size < dim:
            crop[axis] = slice((dim - size) // 2, (dim - size) // 2 + size)
        else:
            width[axis] = ((size - dim) // 2, size - dim - (size - dim) // 2)
    return m.pad(data[tuple(crop)], width)


# Resize ------------------------------------------------------------------------------------------


def _source(mode, out, size, scale, roi):
    """The input coordinate of each output index of one axis, and where it lies outside
    (tf_crop_and_resize only)."""
    y = np.arange(out, dtype=np.float64)
    length = scale * size
    outside = None
    if mode == "align_corners":
        x = np.zeros(out) if length == 1 else y * (size - 1) / (length - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_half_pixel_for_nn":
        x = (y + 0.5) / scale
    elif mode == "tf_crop_and_resize":
        start, end = roi
        if length == 1:
            x = np.full(out, (end - start) * (size - 1) / 2)
        else:
            x = y * (end - start) * (size - 1) / (length - 1)
        x = x + start * (size - 1)
        outside = (x < 0) | (x > size - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out, -0.5) if length == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        x = size / 2 * (1 - out / length) + (y + 0.5) / scale - 0.5
    else:
        raise NotImplementedError(f"Resize coordinate_transformation_mode {mode!r}")
    return x, outside


_NEAREST = {
    "round_prefer_floor": lambda x, scale: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x, scale: np.floor(x + 0.5),
    "floor": lambda x, scale: np.floor(x),
    "ceil": lambda x, scale: np.ceil(x),
    # Upsample and Resize-10: truncate when upsampling, ceil when downsampling (onnxruntime).
    "simple": lambda x, scale: np.ceil(x) if scale < 1 else np.trunc(x),
}


def _cubic(t, a):
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def _taps(kind, x, size, scale, antialias, cubic_coeff_a, exclude_outside):
    """Input indices (out, n) and weights (out, n) of the linear or cubic filter at ``x``."""
    base = np.ceil(x) - 1  # the left neighbour; the ratio lies in (0, 1]
    ratio = x - base
    support = 1.0 if kind == "linear" else 2.0
    stretch = min(scale, 1.0) if antialias else 1.0
    first = int(np.floor(-support / stretch) + 1) if antialias else int(1 - support)
    offsets = np.arange(first, 1 - first + 1)
    t = (offsets[None, :] - ratio[:, None]) * stretch
    weights = np.clip(1 - np.abs(t), 0, 1) if kind == "linear" else _cubic(t, cubic_coeff_a)
    if antialias:
        weights = weights / weights.sum(axis=1, keepdims=True)
    index = base[:, None].astype(np.int64) + offsets[None, :]
    if exclude_outside:
        weights = np.where((index < 0) | (index >= size), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, size - 1), weights


def _resize_axis(m, x, axis, out, scale, roi, mode, coordinate_mode, nearest_mode, **filter_args):
    size = x.shape[axis]
    source, outside = _source(coordinate_mode, out, size, scale, roi)
    if mode == "nearest":
        index = np.clip(_NEAREST[nearest_mode](source, scale), 0, size - 1).astype(np.int64)
        y = m.take(x, index, axis=axis)
    else:
        index, weights = _taps(mode, source, size, scale, **filter_args)
        taps = m.take(x, index.reshape(-1), axis=axis)
        taps = m.reshape(taps, x.shape[:axis] + index.shape + x.shape[axis + 1 :])
        shape = (1,) * axis + weights.shape + (1,) * (x.ndim - axis - 1)
        y = (taps * weights.reshape(shape).astype(x.dtype)).sum(axis=axis + 1)
    return y, outside


def _resize(
    x,
    roi,
    scales,
    sizes,
    *,
    mode,
    coordinate_mode,
    nearest_mode,
    extrapolation_value=0.0,
    axes=None,
    keep_aspect_ratio_policy="stretch",
    **filter_args,
):
    m = xp(x)
    rank = x.ndim
    axes = list(range(rank)) if axes is None else _axes(axes, rank)
    shape = list(x.shape)
    if sizes is not None and np.size(sizes):
        wanted = dict(zip(axes, ints(sizes), strict=True))
        factor = {a: wanted[a] / shape[a] for a in axes}
        if keep_aspect_ratio_policy != "stretch":
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            common = pick(factor.values())
            factor = dict.fromkeys(axes, common)
            wanted = {a: int(common * shape[a] + 0.5) for a in axes}
    else:
        factor = dict(zip(axes, np.asarray(scales, np.float64).reshape(-1).tolist(), strict=True))
        wanted = {a: int(factor[a] * shape[a]) for a in axes}
    roi = None if roi is None or np.size(roi) == 0 else np.asarray(roi, np.float64).reshape(-1)
    dtype = x.dtype
    integer = np.issubdtype(dtype, np.integer)
    if mode != "nearest":
        x = x.astype(np.float64 if m is np else jnp.float32) if integer else x
        x = x.astype(jnp.float32) if m is not np and x.dtype.itemsize < 4 else x
    outside = []
    for i, axis in enumerate(axes):
        window = None if roi is None else (roi[i], roi[len(axes) + i])
        unchanged = window is None or (math.isclose(window[0], 0) and math.isclose(window[1], 1))
        if wanted[axis] == shape[axis] and math.isclose(factor[axis], 1.0) and unchanged:
            continue
        x, mask = _resize_axis(
            m,
            x,
            axis,
            wanted[axis],
            factor[axis],
            window,
            mode,
            coordinate_mode,
            nearest_mode,
            **filter_args,
        )
        if mask is not None:
            outside.append(mask.reshape((1,) * axis + (-1,) + (1,) * (rank - axis - 1)))
    if outside:
        x = m.where(np.logical_or.reduce(np.broadcast_arrays(*outside)), extrapolation_value, x)
    if integer and mode != "nearest":
        info = np.iinfo(dtype)  # onnxruntime truncates (the reference rounds)
        x = m.clip(m.trunc(x), info.min, info.max)
    return x.astype(dtype)


_FILTER = {"antialias": 0, "cubic_coeff_a": -0.75, "exclude_outside": 0}


@op("Resize", since=10, static=(1,))
def Resize10(x, scales, *, mode="nearest"):
    """Resize-10: asymmetric coordinates, truncating nearest neighbour (as onnxruntime)."""
    return _resize(
        x,
        None,
        scales,
        None,
        mode=mode,
        coordinate_mode="asymmetric",
        nearest_mode="simple",
        **_FILTER,
    )


@op("Resize", since=11, static=(1, 2, 3))
def Resize(
    x,
    roi=None,
    scales=None,
    sizes=None,
    *,
    mode="nearest",
    coordinate_transformation_mode="half_pixel",
    nearest_mode="round_prefer_floor",
    cubic_coeff_a=-0.75,
    exclude_outside=0,
    extrapolation_value=0.0,
    antialias=0,
    axes=None,
    keep_aspect_ratio_policy="stretch",
):
    return _resize(
        x,
        roi,
        scales,
        sizes,
        mode=mode,
        coordinate_mode=coordinate_transformation_mode,
        nearest_mode=nearest_mode,
        extrapolation_value=extrapolation_value,
        axes=axes,
        keep_aspect_ratio_policy=keep_aspect_ratio_policy,
        antialias=antialias and mode != "nearest",
        cubic_coeff_a=cubic_coeff_a,
        exclude_outside=exclude_outside,
    )


@op("Upsample", since=7, static=(1,))
def Upsample(x, scales=None, *, mode="nearest"):
    """Upsample-7 (``scales`` attribute) and -9 (input): as Resize-10."""
    return Resize10(x, scales, mode=mode)
