"""Sampling ops on images and volumes: GridSample, AffineGrid, RoiAlign, Col2Im."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

from ..registry import op
from ._util import ints

_MODES = {"bilinear": "linear", "bicubic": "cubic"}  # the opset-16 names


def _denormalize(g, size, align_corners):
    """Grid coordinates in [-1, 1] -> pixel coordinates along an axis of ``size``."""
    if align_corners:
        return (g + 1) / 2 * (size - 1)
    return ((g + 1) * size - 1) / 2


def _reflect(x, low, high):
    """x reflected at ``low`` and ``high`` until it lies between them."""
    span = high - low
    if span <= 0:
        return jnp.full_like(x, low)
    below, above = low - x, x - high
    dist = jnp.where(x < low, below, above)
    n = jnp.floor(dist / span)
    r = dist - n * span
    even = jnp.mod(n, 2) == 0
    from_low = jnp.where(even, low + r, high - r)
    from_high = jnp.where(even, high - r, low + r)
    return jnp.where(x < low, from_low, jnp.where(x > high, from_high, x))


def _cubic(t):
    """Keys' cubic convolution weights (a = -0.75) of the 4 taps around a point at fraction t."""
    a = -0.75

    def near(d):
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _taps(x, mode):
    """The integer taps around each coordinate x and their weights."""
    if mode == "nearest":
        return [jnp.round(x)], [jnp.ones_like(x)]
    base = jnp.floor(x)
    t = x - base
    if mode == "linear":
        return [base, base + 1], [1 - t, t]
    return [base - 1, base, base + 1, base + 2], _cubic(t)


@op("GridSample", since=16)
def GridSample(X, grid, *, align_corners=0, mode="linear", padding_mode="zeros"):
    """X [N, C, *S] sampled at grid [N, *O, r] (coordinates in [-1, 1], last axis first) ->
    [N, C, *O], by nearest, (multi)linear or cubic interpolation; outside points are 0
    (``zeros``), the nearest border pixel (``border``), or reflected (``reflection``)."""
    mode = _MODES.get(mode, mode)
    x, grid = jnp.asarray(X), jnp.asarray(grid)
    sizes = x.shape[2:]
    rank = len(sizes)
    coords = []
    for axis, size in enumerate(sizes):
        c = _denormalize(grid[..., rank - 1 - axis].astype(jnp.float32), size, align_corners)
        low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        if mode == "nearest":
            c = jnp.round(c)
        if padding_mode == "border" and mode != "cubic":  # cubic clamps each tap (as torch)
            c = jnp.where((c < low) | (c > high), jnp.clip(c, 0, size - 1), c)
        elif padding_mode == "reflection":
            c = _reflect(c, low, high)
        coords.append((c, size, low, high))
    batch = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (grid.ndim - 2))
    out = 0.0
    per_axis = [list(zip(*_taps(c, mode), strict=True)) for c, _, _, _ in coords]
    for combo in itertools.product(*per_axis):
        index, weight, valid = [], 1.0, True
        for (tap, w), (_, size, low, high) in zip(combo, coords, strict=True):
            i = _pixel_index(tap, size, low, high, padding_mode)
            if padding_mode == "zeros":
                valid = valid & (tap >= 0) & (tap < size)
            index.append(jnp.clip(i, 0, size - 1).astype(jnp.int32))
            weight = weight * w
        values = x[(batch, slice(None), *index)]  # [N, *O, C]
        values = jnp.moveaxis(values, -1, 1).astype(jnp.float32)
        out = out + jnp.expand_dims(jnp.where(valid, weight, 0.0), 1) * values
    return out.astype(x.dtype)


def _pixel_index(tap, size, low, high, padding_mode):
    """The pixel a tap reads: itself (zeros: masked if outside), clamped, or reflected."""
    if padding_mode == "border":
        return jnp.clip(tap, 0, size - 1)
    if padding_mode == "reflection":
        return jnp.trunc(_reflect(tap, low, high))
    return tap


@op("AffineGrid", since=20, static=(1,))
def AffineGrid(theta, size, *, align_corners=0):
    """The sampling grid [N, *S, r] of the affine maps theta [N, r, r + 1] over an output of
    ``size`` (N, C, *S), for GridSample."""
    dims = ints(size)[2:]
    axes = []
    for d in dims:
        if align_corners:
            a = np.linspace(-1.0, 1.0, d) if d > 1 else np.zeros(1)
        else:
            a = (np.arange(d) * 2 + 1) / d - 1
        axes.append(a.astype(np.float32))
    mesh = np.meshgrid(*axes, indexing="ij")  # each [*S]
    base = np.stack([*mesh[::-1], np.ones_like(mesh[0])], axis=-1)  # [*S, r + 1], x first
    theta = jnp.asarray(theta)
    return jnp.einsum("...k,nrk->n...r", base.astype(theta.dtype), theta)


def _roi_axis(start, size, bins, grid, limit):
    """Sample coordinates [R, bins, grid] along one axis, clamped as RoiAlign's bilinear
    sampling clamps them, with their low/high pixels, weights and validity."""
    step = size / bins
    at = jnp.arange(bins)[None, :, None] * step[:, None, None]
    at = (
        start[:, None, None]
        + at
        + (jnp.arange(grid)[None, None, :] + 0.5) * (step / grid)[:, None, None]
    )
    valid = (at >= -1.0) & (at <= limit)
    at = jnp.maximum(at, 0.0)
    low = jnp.floor(at)
    edge = low >= limit - 1
    low = jnp.where(edge, limit - 1, low)
    at = jnp.where(edge, low, at)
    high = jnp.where(edge, low, low + 1)
    frac = at - low
    return low.astype(jnp.int32), high.astype(jnp.int32), 1 - frac, frac, valid


@op("RoiAlign", since=10)
def RoiAlign(
    X,
    rois,
    batch_indices,
    *,
    coordinate_transformation_mode="half_pixel",
    mode="avg",
    output_height=1,
    output_width=1,
    sampling_ratio=0,
    spatial_scale=1.0,
):
    """The average (or max) of bilinear samples of X [N, C, H, W] on a grid of
    ``sampling_ratio``^2 points in each of output_height x output_width bins of each roi
    [R, 4] (x1, y1, x2, y2) -> [R, C, output_height, output_width]."""
    if sampling_ratio <= 0:
        raise NotImplementedError("RoiAlign with sampling_ratio 0 (a grid sized by the rois)")
    x = jnp.asarray(X)
    height, width = x.shape[2], x.shape[3]
    boxes = jnp.asarray(rois).astype(jnp.float32) * spatial_scale
    offset = 0.5 if coordinate_transformation_mode == "half_pixel" else 0.0
    start, end = boxes[:, :2] - offset, boxes[:, 2:] - offset
    size = end - start
    if coordinate_transformation_mode != "half_pixel":
        size = jnp.maximum(size, 1.0)
    ys = _roi_axis(start[:, 1], size[:, 1], output_height, sampling_ratio, height)
    xs = _roi_axis(start[:, 0], size[:, 0], output_width, sampling_ratio, width)
    n = jnp.asarray(batch_indices).astype(jnp.int32)[:, None, None, None, None]
    corners = []
    for yi, wy in ((ys[0], ys[2]), (ys[1], ys[3])):
        for xi, wx in ((xs[0], xs[2]), (xs[1], xs[3])):
            y_at = yi[:, :, :, None, None]  # [R, bh, gh, 1, 1]
            x_at = xi[:, None, None, :, :]  # [R, 1, 1, bw, gw]
            values = x[n, :, y_at, x_at]  # [R, bh, gh, bw, gw, C]
            weight = wy[:, :, :, None, None] * wx[:, None, None, :, :]
            corners.append(values.astype(jnp.float32) * weight[..., None])
    valid = (ys[4][:, :, :, None, None] & xs[4][:, None, None, :, :])[..., None]
    if mode == "max":
        out = jnp.where(valid, jnp.max(jnp.stack(corners), axis=0), 0.0).max(axis=(2, 4))
    else:
        out = jnp.where(valid, sum(corners), 0.0).mean(axis=(2, 4))
    return jnp.moveaxis(out, -1, 1).astype(x.dtype)  # [R, C, bh, bw]
