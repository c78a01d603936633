"""Quantization ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul and
the com.microsoft block-quantized MatMulNBits and GatherBlockQuantized."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ... import kernels
from ...runtime import switch
from ..prepack import DOMAIN as PACKED
from ..registry import op
from ._util import onnx_dtype, precision, xp

MS = "com.microsoft"
# MatMulNBits nodes with accuracy_level 4 quantize their input to int8 per row and block, as
# onnxruntime's CPU kernels do; "0" dequantizes the weights exactly at every level instead.
INT8_ENV = switch.INT8_ENV


int8_activations = switch.int8_activations


# ---------------------------------------------------------------- shared helpers


def _unpack(packed, bits):
    """uint8 [..., D] holding 8/bits values per byte, low bits first -> int32 [..., D*8/bits]."""
    packed = jnp.asarray(packed).astype(jnp.int32)
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.int32) * bits  # [8/bits]
    values = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [..., D, 8/bits]
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _expand_blocks(params, axis, block_size, size):
    """Per-block params (one per block_size entries along axis) repeated to size entries."""
    return jax.lax.slice_in_dim(jnp.repeat(params, block_size, axis=axis), 0, size, axis=axis)


def _broadcast_params(param, x_ndim, axis, x_shape, block_size):
    """A scale or zero point (scalar, per-axis 1-D, or blocked) broadcast against x."""
    m = xp(param)
    param = m.asarray(param)
    if param.ndim == 0 or (param.size == 1 and not block_size):
        return param.reshape(())
    axis = axis % x_ndim
    if block_size:
        return _expand_blocks(jnp.asarray(param), axis, block_size, x_shape[axis])
    shape = [1] * x_ndim
    shape[axis] = param.shape[0]
    return param.reshape(shape)


def _round_half_even(x):
    return jnp.round(x)  # jnp.round rounds half to even


def _saturate(x, dtype):
    info = jnp.iinfo(dtype)
    return jnp.clip(x, info.min, info.max).astype(dtype)


# ---------------------------------------------------------------- DequantizeLinear, QuantizeLinear


@op("DequantizeLinear", since=10)
@op("DequantizeLinear", domain=MS)
def DequantizeLinear(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    """(x - x_zero_point) * x_scale: per tensor, per axis or per block along axis."""
    x = jnp.asarray(x)
    scale = _broadcast_params(x_scale, x.ndim, axis, x.shape, block_size)
    values = x.astype(jnp.float32)
    if x_zero_point is not None:
        zp = _broadcast_params(x_zero_point, x.ndim, axis, x.shape, block_size)
        values = values - jnp.asarray(zp).astype(jnp.float32)
    y = values * jnp.asarray(scale).astype(jnp.float32)
    dtype = onnx_dtype(output_dtype, jnp) if output_dtype else jnp.asarray(x_scale).dtype
    return y.astype(dtype)


@op("QuantizeLinear", since=10)
@op("QuantizeLinear", domain=MS)
def QuantizeLinear(
    x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0, saturate=1, precision=0
):
    """saturate(round_half_even(x / y_scale) + y_zero_point) in the zero point's type (integer,
    or float8/float4 rounded to nearest even)."""
    x = jnp.asarray(x)
    if y_zero_point is not None:
        dtype = jnp.asarray(y_zero_point).dtype
    elif output_dtype:
        dtype = onnx_dtype(output_dtype, jnp)
    else:
        dtype = jnp.dtype(jnp.uint8)
    scale = _broadcast_params(y_scale, x.ndim, axis, x.shape, block_size)
    y = x.astype(jnp.float32) / jnp.asarray(scale).astype(jnp.float32)
    zp = 0.0
    if y_zero_point is not None:
        zp = _broadcast_params(y_zero_point, x.ndim, axis, x.shape, block_size)
        zp = jnp.asarray(zp).astype(jnp.float32)
    if jnp.issubdtype(dtype, jnp.integer):
        return _saturate(_round_half_even(y) + zp, dtype)
    y = y + zp  # a float8/float4 type: round to nearest even, saturating unless told not to
    if saturate:
        top = float(jnp.finfo(dtype).max)
        y = jnp.clip(y, -top, top)
    return y.astype(dtype)


@op("DynamicQuantizeLinear", since=11)
def DynamicQuantizeLinear(x):
    """x to uint8 with the scale and zero point that map [min(x, 0), max(x, 0)] onto [0, 255]."""
    x = jnp.asarray(x).astype(jnp.float32)
    low = jnp.minimum(jnp.min(x), 0.0)
    high = jnp.maximum(jnp.max(x), 0.0)
    scale = (high - low) / 255.0
    safe = jnp.where(scale == 0, 1.0, scale)
    zp = _saturate(_round_half_even(-low / safe), jnp.uint8)
    y = _saturate(_round_half_even(x / safe) + zp.astype(jnp.float32), jnp.uint8)
    return y, scale, zp


@op("QLinearMatMul", since=10)
def QLinearMatMul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    """quantize((a - a_zp) a_scale @ (b - b_zp) b_scale, y_scale, y_zp) with an exact integer
    product; b's scale and zero point may be per column."""
    a_int = jnp.asarray(a).astype(jnp.int32) - _row_param(a_zero_point, jnp.int32)
    b_int = jnp.asarray(b).astype(jnp.int32) - _col_param(b_zero_point, jnp.int32)
    acc = jnp.matmul(a_int, b_int).astype(jnp.float32)  # [..., M, N]
    factor = _row_param(a_scale, jnp.float32) * _col_param(b_scale, jnp.float32)
    y = _round_half_even(acc * factor / jnp.asarray(y_scale).astype(jnp.float32))
    y = y + jnp.asarray(y_zero_point).astype(jnp.float32)
    return _saturate(y, jnp.asarray(y_zero_point).dtype)


def _row_param(p, dtype):
    """A scalar or per-row ([M] / [..., M, 1]) parameter of a as a column [.., M, 1]."""
    p = jnp.asarray(p).astype(dtype)
    return p if p.ndim == 0 or p.size == 1 else p.reshape(*p.shape[:-1], -1, 1)


def _col_param(p, dtype):
    """A scalar or per-column ([N] / [..., 1, N]) parameter of b as a row [.., 1, N]."""
    p = jnp.asarray(p).astype(dtype)
    return p if p.ndim == 0 or p.size == 1 else p.reshape(*p.shape[:-1], 1, p.shape[-1])


# ---------------------------------------------------------------- MatMulNBits


@op("MatMulNBits", domain=MS)
def MatMulNBits(
    a,
    b,
    scales,
    zero_points=None,
    g_idx=None,
    bias=None,
    *,
    K,
    N,
    block_size,
    bits=4,
    accuracy_level=0,
    weight_prepacked=0,
):
    """a [..., K] @ the block-quantized weight [N, K] transposed (+ bias) -> [..., N].

    b: uint8 [N, n_blocks, block_size*bits/8], values low bits first; the weight is
    (value - zero point) * scale per block of K, the zero point 2^(bits-1) when absent. With
    accuracy_level 4 (4 bits, uint8 zero points or none, no g_idx), a is quantized to int8 per
    row and block first (see :func:`int8_activations` and :func:`int8_product`).
    """
    if weight_prepacked:
        raise NotImplementedError("MatMulNBits with weight_prepacked")
    return _matmul_nbits(
        a, b, scales, zero_points, g_idx, bias, K, N, block_size, bits, accuracy_level, False
    )


@op("PackedMatMulNBits", domain=PACKED, fold=False)
def PackedMatMulNBits(
    a,
    b,
    scales,
    zero_points=None,
    g_idx=None,
    bias=None,
    *,
    K,
    N,
    block_size,
    bits=4,
    accuracy_level=0,
    weight_prepacked=0,
):
    """MatMulNBits whose weight, scales and zero points were rearranged at load for the int4
    kernel (:func:`transmuter_jax.kernels.nbits_pack` and ``nbits_pack_scales``; see
    :mod:`transmuter_jax.onnx.prepack`)."""
    return _matmul_nbits(
        a, b, scales, zero_points, g_idx, bias, K, N, block_size, bits, accuracy_level, True
    )


@op("PackedGateUpNBits", domain=PACKED, fold=False)
def PackedGateUpNBits(
    a,
    gate_b,
    gate_scales,
    gate_zero_points=None,
    up_b=None,
    up_scales=None,
    up_zero_points=None,
    *,
    K,
    N,
    block_size,
    bits=4,
    accuracy_level=0,
    weight_prepacked=0,
):
    """``SiluMul(PackedMatMulNBits(a, gate...), PackedMatMulNBits(a, up...))``, fused at load
    (see onnx.fuse): on the kernels one call computes both products of ``a`` and the gated
    activation, with the values of the three ops."""
    args = (K, N, block_size, bits, accuracy_level, True)
    x = jnp.asarray(a)
    gate = (gate_b, gate_scales, gate_zero_points)
    up = (up_b, up_scales, up_zero_points)
    fused = _nbits_kernel(x, gate, None, *args) and _nbits_kernel(x, up, None, *args)
    if fused and np.ndim(x) >= 1 and x.shape[-1] == K:
        int8 = _int8(accuracy_level, bits, None, gate_zero_points)

        def reference(x, gb, gs, gzp, ub, us, uzp):
            g = _matmul_nbits(x, gb, gs, gzp, None, None, *args[:-1], False)
            u = _matmul_nbits(x, ub, us, uzp, None, None, *args[:-1], False)
            return kernels.silu_mul(g, u)

        y = kernels.matmul_nbits_gate_up(
            x.astype(jnp.float32), gate, up, n=N, block_size=block_size, reference=reference,
            int8=int8,
        )  # fmt: skip
        return y.astype(x.dtype)
    g = _matmul_nbits(a, *gate, None, None, *args)
    u = _matmul_nbits(a, *up, None, None, *args)
    return kernels.silu_mul(g, u).astype(g.dtype)


@op("PackedNBitsSkipNorm", domain=PACKED, fold=False)
def PackedNBitsSkipNorm(
    a,
    b,
    scales,
    zero_points=None,
    skip=None,
    gamma=None,
    *,
    K,
    N,
    block_size,
    bits=4,
    accuracy_level=0,
    weight_prepacked=0,
    epsilon=1e-12,
    ctx,
):
    """``SkipSimplifiedLayerNormalization(PackedMatMulNBits(a, b...), skip, gamma)``, fused at
    load (see onnx.fuse): on the kernels one call computes the product, its sum with ``skip``
    and the sum's RMS norm, with the two ops' values; outputs (y, mean, inv_std, sum) as the
    norm's."""
    from .attention import SkipSimplifiedLayerNormalization, rms_scaled, skip_rms_outputs

    args = (K, N, block_size, bits, accuracy_level, True)
    x = jnp.asarray(a)
    weights = (b, scales, zero_points)
    same = (
        np.ndim(x) >= 1
        and x.shape[-1] == K
        and jnp.shape(skip) == (*jnp.shape(x)[:-1], N)
        and jnp.shape(gamma) == (N,)
        and all(jnp.result_type(v) == jnp.float32 for v in (x, skip, gamma))
    )
    if not (same and _nbits_kernel(x, weights, None, *args)):
        product = _matmul_nbits(a, *weights, None, None, *args)
        return SkipSimplifiedLayerNormalization(product, skip, gamma, epsilon=epsilon, ctx=ctx)
    int8 = _int8(accuracy_level, bits, None, zero_points)

    def reference(x, skip, b, scales, zero_points, gamma):
        v = _matmul_nbits(x, b, scales, zero_points, None, None, *args[:-1], False) + skip
        return rms_scaled(v, gamma, epsilon), v

    y, total = kernels.matmul_nbits_skip_norm(
        x, b, scales, zero_points, skip, gamma, n=N, block_size=block_size, epsilon=epsilon,
        reference=reference, int8=int8, packed=True,
    )  # fmt: skip
    return skip_rms_outputs(y, total, epsilon, ctx.num_outputs)


def _int8(accuracy_level, bits, g_idx, zero_points) -> bool:
    """Whether onnxruntime quantizes MatMulNBits' input to int8: with 4 bits and integer zero
    points (or none)."""
    return bool(
        int8_activations(accuracy_level)
        and bits == 4
        and g_idx is None
        and (zero_points is None or jnp.asarray(zero_points).dtype == jnp.uint8)
    )


def _nbits_kernel(x, weights, g_idx, K, N, block_size, bits, accuracy_level, packed) -> bool:
    """Whether _matmul_nbits runs the kernel on ``x`` and ``weights`` (b, scales, zero points)."""
    b, scales, zero_points = weights
    int8 = _int8(accuracy_level, bits, g_idx, zero_points)
    rows = int(np.prod(jnp.shape(x)[:-1]))
    return bool(
        np.size(b)
        and (int8 or rows <= kernels.NBITS_MAX_ROWS)
        and (int8 or not packed)
        and kernels.nbits_supported(bits, block_size, K, g_idx, scales, zero_points)
    )


def _matmul_nbits(
    a, b, scales, zero_points, g_idx, bias, K, N, block_size, bits, accuracy_level, packed
):
    a = jnp.asarray(a)
    if a.ndim == 0 or a.shape[-1] != K:  # else the kernel would refuse it only when run
        what = "is a scalar" if a.ndim == 0 else f"has {a.shape[-1]} values per row"
        raise ValueError(f"input A {what}, not K = {K}")
    int8 = _int8(accuracy_level, bits, g_idx, zero_points)

    def reference(x, b, scales, zero_points):
        if int8:
            return int8_product(x, b, scales, zero_points, K, N, block_size)
        weight = _nbits_weight(b, scales, zero_points, g_idx, K, N, block_size, bits)  # [N, K]
        return jnp.matmul(x, weight.T, precision=precision())  # [..., N]

    x = a.astype(jnp.float32)
    weights = (b, scales, zero_points)
    if _nbits_kernel(x, weights, g_idx, K, N, block_size, bits, accuracy_level, packed):
        y = kernels.matmul_nbits(
            x,
            b,
            scales,
            zero_points,
            n=N,
            block_size=block_size,
            reference=reference,
            int8=int8,
            packed=packed,
        )
    else:  # the layouts as stored (the switches changed since the weight was packed)
        if packed:
            b, scales, zero_points = kernels.nbits_unpack_all(b, scales, zero_points, N)
        y = reference(x, b, scales, zero_points)
    if bias is not None:
        y = y + jnp.asarray(bias).astype(jnp.float32)
    return y.astype(a.dtype)


def int8_quantize(x, block_size):
    """x [..., K] quantized per row and block of K as onnxruntime's CompInt8 does: with
    s = max|x| / 127 per block, q = round_half_even(x * (127 / max|x|)) (0 where s is 0).

    Returns:
        q [..., blocks, block_size] (int8 values in float32, zero past K) and s [..., blocks].
    """
    k = x.shape[-1]
    blocks = -(-k // block_size)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * block_size - k)])
    v = padded.reshape(*x.shape[:-1], blocks, block_size)
    amax = jnp.max(jnp.abs(v), axis=-1)
    scale = amax / jnp.float32(127.0)
    safe = jnp.where(amax != 0, amax, jnp.float32(1.0))
    inv = jnp.where(amax != 0, jnp.float32(127.0) / safe, jnp.float32(0.0))
    q = jnp.clip(jnp.round(v * inv[..., None]), -127.0, 127.0)
    return q, scale


def int8_product(x, b, scales, zero_points, k, n, block_size):
    """MatMulNBits (4 bits) with x quantized to int8 (:func:`int8_quantize`), strictly per row.

    Per block b of K, d = sum(q * value) - zero_point * sum(q) (integers, exact in float32),
    and y = fma(d_b, s_b * scale_b, y) in block order from 0: the steps of the C++ kernel.
    Returns float32 ``[..., N]``.
    """
    lead = x.shape[:-1]
    blocks = -(-k // block_size)
    if np.size(b) == 0:
        return jnp.zeros((*lead, n), jnp.float32)
    q, sx = int8_quantize(jnp.asarray(x, jnp.float32).reshape(-1, k), block_size)  # [M, B, bs]
    sq = jnp.sum(q, axis=-1)  # [M, B], exact
    packed = jnp.reshape(jnp.asarray(b), (n, blocks, block_size // 2))
    sw = jnp.asarray(scales).astype(jnp.float32).reshape(n, blocks)
    if zero_points is None:
        zp = jnp.full((n, blocks), 8.0, jnp.float32)
    elif jnp.asarray(zero_points).dtype == jnp.uint8:
        zp = _unpack(jnp.reshape(zero_points, (n, -1)), 4)[:, :blocks].astype(jnp.float32)
    else:
        zp = jnp.asarray(zero_points).astype(jnp.float32).reshape(n, blocks)

    def step(acc, block):
        q_b, sx_b, sq_b, packed_b, sw_b, zp_b = block  # [M, bs], [M], [M], [N, bs/2], [N], [N]
        values = _unpack(packed_b, 4).astype(jnp.float32)  # [N, bs]
        dot = jnp.matmul(q_b, values.T, precision=jax.lax.Precision.HIGHEST)  # [M, N], exact
        d = dot - zp_b[None, :] * sq_b[:, None]
        return acc + d * (sx_b[:, None] * sw_b[None, :]), None

    blocks_first = (
        jnp.moveaxis(q, 1, 0),
        sx.T,
        sq.T,
        jnp.moveaxis(packed, 1, 0),
        sw.T,
        zp.T,
    )
    acc = jnp.zeros((q.shape[0], n), jnp.float32)
    acc, _ = jax.lax.scan(step, acc, blocks_first)
    return acc.reshape(*lead, n)


def _nbits_weight(b, scales, zero_points, g_idx, k, n, block_size, bits):
    """The dequantized MatMulNBits weight [N, K] in float32."""
    blocks = -(-k // block_size)
    if np.size(b) == 0:  # an omitted projection
        return jnp.zeros((n, k), jnp.float32)
    q = _unpack(jnp.reshape(b, (n, -1)), bits)[:, :k]  # [N, K]
    scale = jnp.asarray(scales).astype(jnp.float32).reshape(n, blocks)
    if zero_points is None:
        zp = jnp.full((n, blocks), 1 << (bits - 1), jnp.float32)
    elif jnp.asarray(zero_points).dtype == jnp.uint8:
        zp = _unpack(jnp.reshape(zero_points, (n, -1)), bits)[:, :blocks].astype(jnp.float32)
    else:
        zp = jnp.asarray(zero_points).astype(jnp.float32).reshape(n, blocks)
    group = jnp.arange(k) // block_size if g_idx is None else jnp.asarray(g_idx).astype(jnp.int32)
    return (q.astype(jnp.float32) - zp[:, group]) * scale[:, group]


# ---------------------------------------------------------------- GatherBlockQuantized


@op("GatherBlockQuantized", domain=MS)
def GatherBlockQuantized(
    data,
    indices,
    scales,
    zero_points=None,
    *,
    bits=4,
    block_size=128,
    gather_axis=0,
    quantize_axis=1,
):
    """Gather of a block-quantized table: (value - zero point) * scale per block along
    quantize_axis; out-of-range indices give zeros.

    uint8 data packs 8/bits values per byte along its last axis (low bits first) with a default
    zero point of 2^(bits-1); int4/uint4 data is unpacked with a default zero point of 0.
    """
    rank = np.ndim(data)
    gather_axis, quantize_axis = gather_axis % rank, quantize_axis % rank
    packed = jnp.asarray(data).dtype == jnp.uint8
    scales = jnp.asarray(scales)
    size = np.shape(data)[gather_axis]
    idx = jnp.asarray(indices).astype(jnp.int32)
    inside = (idx >= -size) & (idx < size)
    idx = jnp.where(idx < 0, idx + size, idx)
    idx = jnp.where(inside, idx, 0)
    if gather_axis != quantize_axis:  # gather the rows first, then dequantize only them
        # (packed values too, when the gather is not along the packed last axis: unpacking the
        # whole table first would hold it as int32)
        early = packed and gather_axis != rank - 1
        data = jnp.take(jnp.asarray(data), idx, axis=gather_axis) if early else data
        values = _unpack(data, bits) if packed else jnp.asarray(data).astype(jnp.int32)
        values = values if early else jnp.take(values, idx, axis=gather_axis)
        scale_count = np.shape(scales)[-1]
        scales = jnp.take(scales, idx, axis=gather_axis)
        if zero_points is None:
            zp = jnp.full((), (1 << (bits - 1)) if packed else 0, jnp.int32)
        elif early:
            zp = jnp.take(jnp.asarray(zero_points), idx, axis=gather_axis)
            zp = _unpack(zp, bits)[..., :scale_count]
        elif packed:
            zp = _unpack(zero_points, bits)[..., :scale_count]
            zp = jnp.take(zp, idx, axis=gather_axis)
        else:
            zp = jnp.take(jnp.asarray(zero_points).astype(jnp.int32), idx, axis=gather_axis)
        axis = quantize_axis + (idx.ndim - 1 if quantize_axis > gather_axis else 0)
        out = _dequant_blocks(values, scales, zp, axis, block_size)
    else:
        values = _unpack(data, bits) if packed else jnp.asarray(data).astype(jnp.int32)
        if zero_points is None:
            zp = jnp.full((), (1 << (bits - 1)) if packed else 0, jnp.int32)
        elif packed:
            zp = _unpack(zero_points, bits)[..., : np.shape(scales)[-1]]
        else:
            zp = jnp.asarray(zero_points).astype(jnp.int32)
        table = _dequant_blocks(values, scales, zp, quantize_axis, block_size)
        out = jnp.take(table, idx, axis=gather_axis)
    keep = inside.reshape((1,) * gather_axis + idx.shape + (1,) * (rank - gather_axis - 1))
    return jnp.where(keep, out, 0).astype(scales.dtype)


@op("PackedGatherBlockQuantized", domain=PACKED, fold=False)
def PackedGatherBlockQuantized(
    data, indices, scales, zero_points=None, *, n, bits=4, block_size=32, gather_axis=0,
    quantize_axis=1,
):  # fmt: skip
    """GatherBlockQuantized of rows of an embedding tied to a MatMulNBits weight that was
    rearranged at load (:mod:`transmuter_jax.onnx.prepack`): ``data`` is that weight ``[N,
    blocks, 16]`` in :func:`transmuter_jax.kernels.nbits_pack`'s layout, ``scales`` and
    ``zero_points`` in tiles of 16 columns. Only the gathered rows are put back as stored."""
    idx = jnp.asarray(indices).astype(jnp.int32)
    inside = (idx >= -n) & (idx < n)
    idx = jnp.where(inside, jnp.where(idx < 0, idx + n, idx), 0)
    flat = idx.reshape(-1)
    rows = kernels.nbits_unpack(jnp.take(jnp.asarray(data), flat, axis=0))  # [M, blocks, 16]
    tile, lane = flat // kernels.NBITS_TILE, flat % kernels.NBITS_TILE
    row_scales = jnp.asarray(scales)[tile, :, lane]  # [M, blocks]
    zp = None
    if zero_points is not None:
        values = jnp.asarray(zero_points)[tile, :, lane]  # [M, blocks], one a byte
        zp = jnp.pad(values, ((0, 0), (0, values.shape[1] % 2))).reshape(len(flat), -1, 2)
        zp = (zp[..., 0] | (zp[..., 1] << 4)).astype(jnp.uint8)
    out = GatherBlockQuantized(
        rows.reshape(len(flat), -1),
        jnp.arange(len(flat), dtype=jnp.int32),
        row_scales,
        zp,
        bits=bits,
        block_size=block_size,
        gather_axis=0,
        quantize_axis=1,
    )
    out = jnp.where(inside.reshape(-1, 1), out, 0)
    return out.reshape(*idx.shape, out.shape[-1])


def _dequant_blocks(values, scales, zp, axis, block_size):
    """(values - zp) * scales with one scale (and zero point) per block_size values along axis."""
    size = values.shape[axis]
    scale = _expand_blocks(scales.astype(jnp.float32), axis, block_size, size)
    if zp.ndim:
        zp = _expand_blocks(zp, axis, block_size, size)
    return (values - zp).astype(jnp.float32) * scale
